//! The hashed n-gram table of the PLE layers: row sizes, multipliers and the row ids of a token.
//!
//! Per PLE layer (index `k` among the PLE layers) there are `(ngram_size - 1) * heads_per_ngram`
//! heads. Head `h` hashes into a table of `prime_h` rows, where the primes are the successive primes
//! from `ngram_vocab_size_base` on, numbered across all PLE layers (`k * heads + h`); the heads'
//! tables are concatenated (`offset_h`) and the total padded to `make_ngram_vocab_size_divisible_by`.
//! For the token at position p and n in 2..=ngram_size:
//!   `mix_n = t[p]*m[0] ^ t[p-1]*m[1] ^ ... ^ t[p-n+1]*m[n-1]`
//!   row   = (mix_n mod prime_h) + offset_h        for each head h of order n
//! where t[p-s] is replaced by EOS when it lies before the sequence or at/before the last EOS
//! strictly before p (segments restart after EOS). The multipliers m come from splitmix64 seeded
//! with `seed + 10007 * k`. This mirrors transformers' `Qwen4ExpTextNGramEmbedding`.

use crate::config::TextConfig;

const SPLITMIX_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;
const SPLITMIX_M1: u64 = 0xBF58_476D_1CE4_E5B9;
const SPLITMIX_M2: u64 = 0x94D0_49BB_1331_11EB;
const PRIME_1: u64 = 10007;

pub fn splitmix64(v: u64) -> u64 {
    let v = v.wrapping_add(SPLITMIX_GAMMA);
    let v = (v ^ (v >> 30)).wrapping_mul(SPLITMIX_M1);
    let v = (v ^ (v >> 27)).wrapping_mul(SPLITMIX_M2);
    v ^ (v >> 31)
}

fn is_prime(v: u64) -> bool {
    if v < 2 {
        return false;
    }
    if v.is_multiple_of(2) {
        return v == 2;
    }
    let mut d = 3;
    while d * d <= v {
        if v.is_multiple_of(d) {
            return false;
        }
        d += 2;
    }
    true
}

/// Advances an n-gram context (the last `ngram_size - 1` tokens, most recent first) past `tokens`.
pub fn advance_context(ngram_size: usize, ctx: &mut Vec<u32>, tokens: &[u32]) {
    for &tok in tokens {
        ctx.insert(0, tok);
        ctx.truncate(ngram_size.saturating_sub(1));
    }
}

/// The hash of one PLE layer.
#[derive(Clone, Debug, PartialEq)]
pub struct NgramHash {
    pub ngram_size: usize,
    pub heads_per_ngram: usize,
    /// One odd multiplier per position in the n-gram (current token first).
    pub multipliers: Vec<u64>,
    /// Rows of each head's table (a prime).
    pub head_rows: Vec<u64>,
    /// First row of each head's table.
    pub head_offsets: Vec<u64>,
    /// Rows of the whole (padded) table.
    pub table_rows: u64,
    pub eos: u32,
}

impl NgramHash {
    pub fn new(cfg: &TextConfig, ple_index: usize) -> NgramHash {
        let heads = cfg.ngram_heads();
        // Multipliers: odd, below (i64::MAX / vocab) so token * m never overflows an i64.
        let multiplier_max = (i64::MAX as u64) / (cfg.vocab_size.max(1) as u64);
        let half_bound = (multiplier_max / 2).max(1);
        let base_seed = cfg.seed.wrapping_add(PRIME_1.wrapping_mul(ple_index as u64));
        let multipliers = (0..cfg.ngram_size as u64)
            .map(|i| 2 * (splitmix64(base_seed.wrapping_add(SPLITMIX_GAMMA.wrapping_mul(i + 1))) % half_bound) + 1)
            .collect();
        // Successive primes from ngram_vocab_size_base on, counted across PLE layers.
        let mut p = cfg.ngram_vocab_size_base.saturating_sub(1);
        let mut next_prime = || {
            p += 1;
            while !is_prime(p) {
                p += 1;
            }
            p
        };
        for _ in 0..ple_index * heads {
            next_prime();
        }
        let head_rows: Vec<u64> = (0..heads).map(|_| next_prime()).collect();
        let mut head_offsets = Vec::with_capacity(heads);
        let mut total = 0u64;
        for &r in &head_rows {
            head_offsets.push(total);
            total += r;
        }
        let div = cfg.make_ngram_vocab_size_divisible_by.max(1);
        NgramHash {
            ngram_size: cfg.ngram_size,
            heads_per_ngram: cfg.heads_per_ngram,
            multipliers,
            head_rows,
            head_offsets,
            table_rows: total.div_ceil(div) * div,
            eos: cfg.eos().unwrap_or(0),
        }
    }

    /// Table rows for a token, head by head (2-gram heads first).
    ///
    /// `previous` holds the tokens before it, most recent first (`previous[0]` is t[p-1]); it needs
    /// `ngram_size - 1` entries, padded with EOS at the start of a sequence.
    pub fn rows(&self, token: u32, previous: &[u32], out: &mut Vec<u64>) {
        out.clear();
        // Segment-aware context: once an EOS is met walking back, everything earlier is EOS.
        let mut ctx = vec![token as u64];
        let mut hit_eos = false;
        for s in 1..self.ngram_size {
            let t = previous.get(s - 1).copied().unwrap_or(self.eos);
            if hit_eos || t == self.eos {
                hit_eos = true;
                ctx.push(self.eos as u64);
            } else {
                ctx.push(t as u64);
            }
        }
        for n in 2..=self.ngram_size {
            let mut mix = ctx[0].wrapping_mul(self.multipliers[0]);
            for pos in 1..n {
                mix ^= ctx[pos].wrapping_mul(self.multipliers[pos]);
            }
            let first = (n - 2) * self.heads_per_ngram;
            for h in first..first + self.heads_per_ngram {
                out.push(mix % self.head_rows[h] + self.head_offsets[h]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_reference_value() {
        // splitmix64(0) from the reference algorithm.
        assert_eq!(splitmix64(0), 0xE220_A839_7B1D_CDAF);
    }

    #[test]
    fn primes_follow_the_base() {
        assert!(is_prime(211) && !is_prime(221) && is_prime(223));
    }
}

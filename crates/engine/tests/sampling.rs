//! Sampling: greedy, reproducibility, truncation, the drawn distribution, penalties, masked
//! logits, and the log-probability helpers.

use cherenkov_engine::backend::top_of;
use cherenkov_engine::sampling::{Sampler, SamplingParams, log_softmax, top_logprobs};

fn params(temperature: f32, top_p: f32, top_k: usize, seed: u64) -> SamplingParams {
    SamplingParams { temperature, top_p, top_k, seed: Some(seed), ..SamplingParams::default() }
}

/// A pseudo-random logit vector (deterministic, no generator needed).
fn logits(n: usize, salt: u32) -> Vec<f32> {
    (0..n as u32)
        .map(|i| {
            let x = i.wrapping_mul(2_654_435_761).wrapping_add(salt.wrapping_mul(40_503)) >> 8;
            (x % 10_000) as f32 / 1000.0 - 5.0
        })
        .collect()
}

fn argmax(l: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in l.iter().enumerate() {
        if v > l[best] {
            best = i;
        }
    }
    best as u32
}

fn softmax(l: &[f32], t: f32) -> Vec<f64> {
    let m = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f64> = l.iter().map(|&x| (f64::from(x - m) / f64::from(t)).exp()).collect();
    let s: f64 = e.iter().sum();
    e.into_iter().map(|x| x / s).collect()
}

#[test]
fn greedy_picks_the_argmax_lowest_id_on_ties() {
    let mut s = Sampler::new(SamplingParams::greedy());
    for salt in 0..20 {
        let l = logits(1000, salt);
        assert_eq!(s.sample(&l, &[]), argmax(&l));
    }
    assert_eq!(s.sample(&[0.5, 2.0, 2.0, -1.0], &[]), 1);
    assert_eq!(s.sample(&[f32::NEG_INFINITY, f32::NAN, -3.0, f32::NEG_INFINITY], &[]), 2);
}

#[test]
fn same_seed_same_sequence() {
    let run = |seed: u64| -> Vec<u32> {
        let mut s = Sampler::new(params(0.9, 0.95, 50, seed));
        (0..200).map(|i| s.sample(&logits(5000, i), &[])).collect()
    };
    let a = run(1234);
    assert_eq!(a, run(1234));
    assert_ne!(a, run(1235), "different seeds should give different draws");
    // Not degenerate: the draws vary.
    let distinct: std::collections::HashSet<_> = a.iter().collect();
    assert!(distinct.len() > 20, "{distinct:?}");
}

#[test]
fn entropy_seed_is_recorded_and_reproduces() {
    let mut first = Sampler::new(SamplingParams { seed: None, ..params(1.0, 1.0, 0, 0) });
    let seed = first.seed();
    let mut replay = Sampler::new(params(1.0, 1.0, 0, seed));
    assert_eq!(replay.seed(), seed);
    for i in 0..100 {
        let l = logits(300, i);
        assert_eq!(first.sample(&l, &[]), replay.sample(&l, &[]));
    }
}

#[test]
fn top_k_one_and_tiny_top_p_are_greedy() {
    let mut k1 = Sampler::new(params(1.5, 1.0, 1, 7));
    let mut p0 = Sampler::new(params(1.5, 1e-6, 0, 7));
    for salt in 0..100 {
        let l = logits(2000, salt);
        let best = argmax(&l);
        assert_eq!(k1.sample(&l, &[]), best);
        assert_eq!(p0.sample(&l, &[]), best);
    }
    // Ties: the lowest id, as greedy.
    assert_eq!(k1.sample(&[1.0, 4.0, 4.0], &[]), 1);
    assert_eq!(p0.sample(&[1.0, 4.0, 4.0], &[]), 1);
}

/// Pearson's chi-square statistic of `counts` against `probs`.
fn chi_square(counts: &[u64], probs: &[f64], draws: u64) -> f64 {
    counts
        .iter()
        .zip(probs)
        .map(|(&c, &p)| {
            let e = p * draws as f64;
            (c as f64 - e).powi(2) / e
        })
        .sum()
}

#[test]
fn draws_follow_softmax_of_scaled_logits() {
    let l = [1.0f32, 2.0, 0.5, -1.0, 3.0, 2.0];
    let draws = 200_000u64;
    // 5 degrees of freedom: the 0.999 quantile of chi-square(5) is 20.5.
    for (t, seed) in [(1.0f32, 11u64), (0.7, 12), (2.0, 13)] {
        let probs = softmax(&l, t);
        let mut s = Sampler::new(params(t, 1.0, 0, seed));
        let mut counts = vec![0u64; l.len()];
        for _ in 0..draws {
            counts[s.sample(&l, &[]) as usize] += 1;
        }
        let stat = chi_square(&counts, &probs, draws);
        assert!(stat < 20.5, "T={t}: chi-square {stat}, counts {counts:?}, probs {probs:?}");
    }
    // A wrong temperature must be detected by the same check (the test can fail).
    let mut s = Sampler::new(params(1.0, 1.0, 0, 14));
    let mut counts = vec![0u64; l.len()];
    for _ in 0..draws {
        counts[s.sample(&l, &[]) as usize] += 1;
    }
    assert!(chi_square(&counts, &softmax(&l, 0.8), draws) > 100.0);
}

#[test]
fn top_k_and_top_p_renormalize_over_the_kept_tokens() {
    let l = [3.0f32, 2.5, 2.0, 1.0, 0.0, -1.0];
    let draws = 100_000u64;
    let full = softmax(&l, 1.0);

    // top_k = 3: the three best, renormalized.
    let mut s = Sampler::new(params(1.0, 1.0, 3, 21));
    let mut counts = vec![0u64; 3];
    for _ in 0..draws {
        let id = s.sample(&l, &[]) as usize;
        assert!(id < 3, "top_k=3 drew {id}");
        counts[id] += 1;
    }
    let z: f64 = full[..3].iter().sum();
    let probs: Vec<f64> = full[..3].iter().map(|p| p / z).collect();
    assert!(chi_square(&counts, &probs, draws) < 13.8); // chi2(2) 0.999

    // top_p: keep tokens until the cumulative probability reaches top_p (including the token
    // that crosses it).
    let cum2 = full[0] + full[1];
    let top_p = (cum2 - 0.01) as f32;
    let mut s = Sampler::new(params(1.0, top_p, 0, 22));
    let mut counts = vec![0u64; 2];
    for _ in 0..draws {
        let id = s.sample(&l, &[]) as usize;
        assert!(id < 2, "top_p={top_p} drew {id}");
        counts[id] += 1;
    }
    let probs = [full[0] / cum2, full[1] / cum2];
    assert!(chi_square(&counts, &probs, draws) < 10.8); // chi2(1) 0.999
}

#[test]
fn masked_tokens_are_never_drawn() {
    let mut l = vec![f32::NEG_INFINITY; 1000];
    l[17] = -50.0;
    l[400] = -49.0;
    l[999] = f32::NAN;
    for (t, p, k) in [(1.0, 1.0, 0), (5.0, 0.5, 0), (100.0, 1.0, 500), (0.01, 0.99, 3)] {
        let mut s = Sampler::new(params(t, p, k, 3));
        for _ in 0..2000 {
            let id = s.sample(&l, &[]);
            assert!(id == 17 || id == 400, "T={t} top_p={p} top_k={k} drew {id}");
        }
    }
    // Extreme temperature ratio: exp underflows for all but the best; only it can be drawn.
    let mut s = Sampler::new(params(1e-3, 1.0, 0, 4));
    for _ in 0..1000 {
        assert_eq!(s.sample(&[0.0, 10.0, f32::NEG_INFINITY, 9.0], &[]), 1);
    }
    // +inf logits take all the probability.
    let mut s = Sampler::new(params(1.0, 1.0, 0, 5));
    for _ in 0..1000 {
        let id = s.sample(&[100.0, f32::INFINITY, 3.0, f32::INFINITY], &[]);
        assert!(id == 1 || id == 3, "{id}");
    }
}

#[test]
fn no_token_with_probability_is_an_error() {
    let mut s = Sampler::new(params(1.0, 1.0, 0, 1));
    let err = s.try_sample(&[f32::NEG_INFINITY, f32::NAN], &[]).unwrap_err().to_string();
    assert!(err.contains("-inf or NaN"), "{err}");
    let mut g = Sampler::new(SamplingParams::greedy());
    assert!(g.try_sample(&[f32::NEG_INFINITY; 4], &[]).is_err());
    assert!(g.try_sample(&[], &[]).is_err());
}

#[test]
fn penalties_change_the_choice() {
    let l = [2.0f32, 1.9, 1.0, -0.5];
    let greedy_with = |p: SamplingParams| Sampler::new(SamplingParams { temperature: 0.0, ..p });

    // Presence: a constant once a token has appeared, whatever the count.
    let mut s = greedy_with(SamplingParams { presence_penalty: 0.5, ..Default::default() });
    assert_eq!(s.sample(&l, &[]), 0);
    assert_eq!(s.sample(&l, &[0]), 1); // 1.5 < 1.9
    assert_eq!(s.sample(&l, &[0, 0, 0, 1]), 0); // 1.5 > 1.4: the count does not matter

    // Frequency: count * penalty.
    let mut s = greedy_with(SamplingParams { frequency_penalty: 0.3, ..Default::default() });
    assert_eq!(s.sample(&l, &[0]), 1); // 1.7 < 1.9
    assert_eq!(s.sample(&l, &[0, 1, 1]), 0); // 1.7 > 1.3
    assert_eq!(s.sample(&l, &[0, 0, 1]), 1); // 1.4 < 1.6
    // Ids outside the logits are ignored.
    assert_eq!(s.sample(&l, &[100, 200]), 0);

    // Repetition (transformers): positive logits divided, negative ones multiplied.
    let mut s = greedy_with(SamplingParams { repetition_penalty: 2.0, ..Default::default() });
    assert_eq!(s.sample(&l, &[0]), 1); // 1.0 < 1.9
    assert_eq!(s.sample(&[-1.0, -1.5], &[0]), 1); // -2.0 < -1.5

    // A negative presence penalty encourages repetition.
    let mut s = greedy_with(SamplingParams { presence_penalty: -0.5, ..Default::default() });
    assert_eq!(s.sample(&l, &[1]), 1); // 2.4 > 2.0

    // Penalties also apply when sampling: a heavily penalized token is (almost) never drawn.
    let mut s = Sampler::new(SamplingParams { frequency_penalty: 2.0, ..params(1.0, 1.0, 0, 8) });
    let previous = vec![0u32; 20]; // logit 2.0 - 40
    for _ in 0..2000 {
        assert_ne!(s.sample(&[2.0, 0.0, 0.0], &previous), 0);
    }
}

#[test]
fn validate_names_the_field() {
    let cases = [
        (SamplingParams { temperature: -0.1, ..Default::default() }, "temperature"),
        (SamplingParams { temperature: f32::NAN, ..Default::default() }, "temperature"),
        (SamplingParams { temperature: f32::INFINITY, ..Default::default() }, "temperature"),
        (SamplingParams { top_p: 0.0, ..Default::default() }, "top_p"),
        (SamplingParams { top_p: 1.01, ..Default::default() }, "top_p"),
        (SamplingParams { top_p: f32::NAN, ..Default::default() }, "top_p"),
        (SamplingParams { presence_penalty: 2.5, ..Default::default() }, "presence_penalty"),
        (SamplingParams { frequency_penalty: f32::NAN, ..Default::default() }, "frequency_penalty"),
        (SamplingParams { repetition_penalty: 0.0, ..Default::default() }, "repetition_penalty"),
        (SamplingParams { repetition_penalty: -1.0, ..Default::default() }, "repetition_penalty"),
    ];
    for (p, field) in cases {
        let err = p.validate().unwrap_err().to_string();
        assert!(err.contains(field), "{p:?}: {err}");
        assert!(Sampler::try_new(p).is_err());
    }
    SamplingParams::default().validate().unwrap();
    SamplingParams::greedy().validate().unwrap();
    let d = SamplingParams::default();
    assert_eq!((d.temperature, d.top_p, d.top_k, d.seed), (1.0, 1.0, 0, None));
    assert_eq!((d.presence_penalty, d.frequency_penalty, d.repetition_penalty), (0.0, 0.0, 1.0));
    // Missing JSON fields take the defaults.
    let p: SamplingParams = serde_json::from_str(r#"{"temperature": 0.2, "seed": 9}"#).unwrap();
    assert_eq!(p, SamplingParams { temperature: 0.2, seed: Some(9), ..Default::default() });
}

#[test]
fn log_softmax_and_top_logprobs() {
    let l = [1.0f32, 3.0, 2.0, f32::NEG_INFINITY, 3.0];
    let lp = log_softmax(&l);
    let probs = softmax(&l, 1.0);
    for (a, p) in lp.iter().zip(&probs) {
        if *p == 0.0 {
            assert_eq!(*a, f32::NEG_INFINITY);
        } else {
            assert!((f64::from(*a) - p.ln()).abs() < 1e-6, "{a} vs {}", p.ln());
        }
    }
    let total: f64 = lp.iter().map(|&x| f64::from(x).exp()).sum();
    assert!((total - 1.0).abs() < 1e-6);
    // Large logits do not overflow.
    let big = log_softmax(&[1000.0, 1000.0]);
    assert!((big[0] - (0.5f32).ln()).abs() < 1e-6, "{big:?}");
    assert!(log_softmax(&[f32::NEG_INFINITY; 3]).iter().all(|x| *x == f32::NEG_INFINITY));

    let top = top_logprobs(&l, 3);
    assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 4, 2]);
    assert_eq!(top[0].1, lp[1]);
    assert_eq!(top[2].1, lp[2]);
    // Zero-probability tokens are not listed; n beyond the vocabulary is fine.
    assert_eq!(top_logprobs(&l, 10).len(), 4);
    assert!(top_logprobs(&l, 0).is_empty());
}

#[test]
fn sampling_from_the_top_candidates_matches_sampling_from_all_logits() {
    let vocab = 500;
    for (t, k) in [(0.0, 0), (0.7, 1), (1.0, 5), (1.3, 40), (0.9, 64)] {
        for seed in 0..20 {
            let p = SamplingParams { top_p: if seed % 2 == 0 { 1.0 } else { 0.8 }, ..params(t, 1.0, k, seed) };
            let mut full = Sampler::new(p.clone());
            let mut top = Sampler::new(p);
            let need = top.candidates_needed().expect("greedy and small top-k need only candidates");
            for step in 0..30 {
                // Quantized logits make ties common, to check they break the same way.
                let logits: Vec<f32> =
                    logits(vocab, seed as u32 * 31 + step).iter().map(|l| (l * 2.0).round()).collect();
                let want = full.sample(&logits, &[]);
                let got = top.sample_candidates(&top_of(&logits, need)).unwrap();
                assert_eq!(got, want, "temperature {t}, top_k {k}, seed {seed}, step {step}");
            }
        }
    }
    let penalized = Sampler::new(SamplingParams { presence_penalty: 0.5, ..params(0.0, 1.0, 0, 1) });
    assert_eq!(penalized.candidates_needed(), None, "penalties need every logit");
    assert_eq!(Sampler::new(params(1.0, 1.0, 0, 1)).candidates_needed(), None, "no top-k needs every logit");
}

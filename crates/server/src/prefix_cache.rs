//! Snapshots of decode state keyed by the tokens that produced them.
//!
//! A snapshot is a clone of a backend session after some tokens (the attention KV, the Gated DeltaNet
//! recurrent and convolution states, the PLE convolution history, the n-gram context, the QSA index:
//! everything the next token depends on) plus the logits of its last position. A request whose prompt
//! starts with a snapshot's tokens restores a clone of it and runs only the rest of the prompt; a
//! prompt equal to a snapshot's tokens runs nothing and samples from the stored logits. A forward over
//! the suffix after a restored prefix gives the same logits as one over the whole prompt, so reusing a
//! prefix changes no output.
//!
//! Snapshots are taken at the end of a prompt, at points the request marks (the chat boundary), every
//! `block_tokens` tokens when configured, and at branch points: where a new prompt stops agreeing
//! with the longest earlier one, so that prompts with a common beginning and different endings (one
//! system prompt, many questions) share the beginning from the third request on.
//!
//! Entries are shared (any request may restore them) or owned by a retained session (only requests
//! with that `session_id` see them). Bounds: total bytes (both kinds), the number of shared entries,
//! the number of sessions, and idle expiry (separately for the two kinds). When over a bound the least
//! recently used entry goes first, shared entries before session entries. A session keeps only the
//! snapshots of its latest request.
//!
//! Lookup is a linear scan: the cache holds tens of entries, and comparing token ids costs nothing
//! next to one forward.

use std::time::{Duration, Instant};

use serde::Serialize;

/// The bounds, from the `[cache]` and `[sessions]` configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct CachePolicy {
    pub enabled: bool,
    pub max_bytes: u64,
    pub max_entries: usize,
    pub idle: Duration,
    pub max_sessions: usize,
    pub session_idle: Duration,
}

struct Entry<S> {
    tokens: Vec<u32>,
    state: S,
    /// Logits of the last position (`[vocab]`).
    logits: Vec<f32>,
    bytes: u64,
    /// The retained session that owns it, or `None` for a shared entry.
    owner: Option<String>,
    /// Which request of its session stored it (older requests' entries are dropped).
    request: u64,
    last_used: Instant,
}

/// A restored prefix.
pub struct Hit<'a, S> {
    /// Prompt tokens the state covers.
    pub len: usize,
    /// The snapshot (the caller copies it with `Backend::snapshot_session`; the entry stays).
    pub state: &'a S,
    /// The logits after those tokens, when they are the whole prompt.
    pub logits: Option<Vec<f32>>,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct CacheStats {
    /// Whether the cache is on (configured, and the backend reports session sizes).
    pub enabled: bool,
    pub entries: usize,
    pub session_entries: usize,
    pub sessions: usize,
    pub bytes: u64,
    pub lookups: u64,
    pub hits: u64,
    pub tokens_reused: u64,
    pub inserts: u64,
    pub evictions: u64,
    pub expirations: u64,
}

pub struct PrefixCache<S> {
    policy: CachePolicy,
    entries: Vec<Entry<S>>,
    stats: CacheStats,
}

impl<S> PrefixCache<S> {
    pub fn new(policy: CachePolicy) -> Self {
        Self { policy, entries: Vec::new(), stats: CacheStats::default() }
    }

    /// Applies new bounds (a configuration reload), evicting what no longer fits.
    pub fn set_policy(&mut self, policy: CachePolicy, now: Instant) {
        self.policy = policy;
        if !self.policy.enabled {
            self.entries.clear();
        }
        self.expire(now);
        self.enforce();
    }

    pub fn enabled(&self) -> bool {
        self.policy.enabled
    }

    /// The longest entry visible to `owner` whose tokens start `prompt`. An entry as long as the
    /// prompt is used only with its logits; one longer than the prompt never matches.
    pub fn lookup(&mut self, prompt: &[u32], owner: Option<&str>, now: Instant) -> Option<Hit<'_, S>> {
        if !self.policy.enabled {
            return None;
        }
        self.stats.lookups += 1;
        let best = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.owner.is_none() || e.owner.as_deref() == owner)
            .filter(|(_, e)| !e.tokens.is_empty() && prompt.starts_with(&e.tokens))
            // A whole-prompt match is sampled from its logits: an entry without them does not serve.
            .filter(|(_, e)| e.tokens.len() < prompt.len() || !e.logits.is_empty())
            .max_by_key(|(_, e)| (e.tokens.len(), e.owner.is_some()))
            .map(|(i, _)| i)?;
        let e = &mut self.entries[best];
        e.last_used = now;
        self.stats.hits += 1;
        self.stats.tokens_reused += e.tokens.len() as u64;
        let whole = e.tokens.len() == prompt.len();
        Some(Hit { len: e.tokens.len(), state: &e.state, logits: whole.then(|| e.logits.clone()) })
    }

    /// Takes back the hit of the last [`PrefixCache::lookup`] (of `len` tokens) when its snapshot
    /// could not be restored, so the statistics count only reuse that happened.
    pub fn restore_failed(&mut self, len: usize) {
        self.stats.hits = self.stats.hits.saturating_sub(1);
        self.stats.tokens_reused = self.stats.tokens_reused.saturating_sub(len as u64);
    }

    /// The longest run of leading tokens `prompt` shares with an entry visible to `owner` (its
    /// whole length or not). A prompt that shares more with an earlier prompt than any snapshot
    /// covers has found a branch point worth a snapshot of its own: the next prompt with the same
    /// beginning (a system prompt, a few-shot preamble) restores it.
    pub fn shared_prefix(&self, prompt: &[u32], owner: Option<&str>) -> usize {
        if !self.policy.enabled {
            return 0;
        }
        self.entries
            .iter()
            .filter(|e| e.owner.is_none() || e.owner.as_deref() == owner)
            .map(|e| e.tokens.iter().zip(prompt).take_while(|(a, b)| a == b).count())
            .max()
            .unwrap_or(0)
    }

    /// Whether `insert` would store something for these tokens (it is enabled, and no entry of the
    /// same owner holds them already): lets the caller skip cloning a session for nothing.
    pub fn wants(&self, tokens: &[u32], owner: Option<&str>) -> bool {
        self.policy.enabled
            && !tokens.is_empty()
            && !self.entries.iter().any(|e| e.owner.as_deref() == owner && e.tokens == tokens)
    }

    /// Stores a snapshot. `state_bytes` is the session's size as the backend reports it; the entry
    /// is refused when it alone exceeds the byte bound. For an owner, the entries of its earlier
    /// requests are dropped (a retained session keeps its latest request's snapshots).
    pub fn insert(
        &mut self,
        tokens: &[u32],
        state: S,
        logits: &[f32],
        state_bytes: usize,
        owner: Option<&str>,
        request: u64,
        now: Instant,
    ) {
        if !self.wants(tokens, owner) {
            if let Some(e) = self.entries.iter_mut().find(|e| e.owner.as_deref() == owner && e.tokens == tokens) {
                e.last_used = now;
                e.request = request;
            }
            return;
        }
        if let Some(o) = owner {
            self.entries.retain(|e| e.owner.as_deref() != Some(o) || e.request == request);
        }
        let bytes = (state_bytes + 4 * (logits.len() + tokens.len())) as u64;
        if bytes > self.policy.max_bytes {
            return;
        }
        self.entries.push(Entry {
            tokens: tokens.to_vec(),
            state,
            logits: logits.to_vec(),
            bytes,
            owner: owner.map(str::to_string),
            request,
            last_used: now,
        });
        self.stats.inserts += 1;
        self.enforce();
    }

    /// Forgets a retained session; whether it had any snapshot.
    pub fn drop_session(&mut self, owner: &str) -> bool {
        let before = self.entries.len();
        self.entries.retain(|e| e.owner.as_deref() != Some(owner));
        before != self.entries.len()
    }

    /// Drops entries idle for longer than their kind's expiry.
    pub fn expire(&mut self, now: Instant) {
        let (idle, session_idle) = (self.policy.idle, self.policy.session_idle);
        let before = self.entries.len();
        self.entries.retain(|e| {
            let limit = if e.owner.is_some() { session_idle } else { idle };
            now.saturating_duration_since(e.last_used) <= limit
        });
        self.stats.expirations += (before - self.entries.len()) as u64;
    }

    pub fn stats(&self) -> CacheStats {
        let mut s = self.stats.clone();
        s.entries = self.entries.iter().filter(|e| e.owner.is_none()).count();
        s.session_entries = self.entries.len() - s.entries;
        s.sessions = self.sessions().len();
        s.bytes = self.bytes();
        s.enabled = self.policy.enabled;
        s
    }

    fn bytes(&self) -> u64 {
        self.entries.iter().map(|e| e.bytes).sum()
    }

    /// Distinct owners, each with its most recent use.
    fn sessions(&self) -> Vec<(String, Instant)> {
        let mut out: Vec<(String, Instant)> = Vec::new();
        for e in &self.entries {
            let Some(o) = &e.owner else { continue };
            match out.iter_mut().find(|(n, _)| n == o) {
                Some((_, t)) => *t = (*t).max(e.last_used),
                None => out.push((o.clone(), e.last_used)),
            }
        }
        out
    }

    fn enforce(&mut self) {
        while self.entries.iter().filter(|e| e.owner.is_none()).count() > self.policy.max_entries {
            self.evict_lru(|e| e.owner.is_none());
        }
        loop {
            let sessions = self.sessions();
            if sessions.len() <= self.policy.max_sessions {
                break;
            }
            let oldest = sessions.into_iter().min_by_key(|s| s.1).map(|s| s.0).expect("over the bound");
            let before = self.entries.len();
            self.entries.retain(|e| e.owner.as_deref() != Some(oldest.as_str()));
            self.stats.evictions += (before - self.entries.len()) as u64;
        }
        while self.bytes() > self.policy.max_bytes {
            if !self.evict_lru(|e| e.owner.is_none()) {
                self.evict_lru(|_| true);
            }
        }
    }

    /// Removes the least recently used entry that `which` selects; false when none does.
    fn evict_lru(&mut self, which: impl Fn(&Entry<S>) -> bool) -> bool {
        let victim =
            self.entries.iter().enumerate().filter(|(_, e)| which(e)).min_by_key(|(_, e)| e.last_used).map(|(i, _)| i);
        match victim {
            Some(i) => {
                self.entries.swap_remove(i);
                self.stats.evictions += 1;
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> CachePolicy {
        CachePolicy {
            enabled: true,
            max_bytes: 1 << 20,
            max_entries: 3,
            idle: Duration::from_secs(10),
            max_sessions: 2,
            session_idle: Duration::from_secs(100),
        }
    }

    /// The "state" is the tokens themselves, so a hit can be checked against its key.
    fn put(c: &mut PrefixCache<Vec<u32>>, toks: &[u32], owner: Option<&str>, req: u64, t: Instant) {
        c.insert(toks, toks.to_vec(), &[0.5; 4], 100, owner, req, t);
    }

    #[test]
    fn longest_prefix_wins_and_whole_prompts_bring_logits() {
        let t = Instant::now();
        let mut c = PrefixCache::new(policy());
        put(&mut c, &[1, 2], None, 1, t);
        put(&mut c, &[1, 2, 3, 4], None, 1, t);
        put(&mut c, &[1, 9], None, 1, t);
        let h = c.lookup(&[1, 2, 3, 4, 5], None, t).unwrap();
        assert_eq!((h.len, h.state.as_slice(), h.logits.is_none()), (4, &[1, 2, 3, 4][..], true));
        let h = c.lookup(&[1, 2, 3, 4], None, t).unwrap();
        assert_eq!((h.len, h.logits), (4, Some(vec![0.5; 4])));
        assert_eq!(c.lookup(&[1, 2, 3], None, t).unwrap().len, 2);
        assert!(c.lookup(&[7], None, t).is_none());
        assert!(c.lookup(&[1], None, t).is_none(), "an entry longer than the prompt matched");
        let s = c.stats();
        assert_eq!((s.lookups, s.hits, s.tokens_reused), (5, 3, 10));
        // A hit whose snapshot could not be restored is taken back; the lookup still counts.
        c.restore_failed(2);
        let s = c.stats();
        assert_eq!((s.lookups, s.hits, s.tokens_reused), (5, 2, 8));
    }

    /// A snapshot kept without logits (its request decoded from candidates) serves longer prompts
    /// only: a prompt equal to it would have nothing to sample from.
    #[test]
    fn entries_without_logits_serve_only_longer_prompts() {
        let t = Instant::now();
        let mut c = PrefixCache::new(policy());
        c.insert(&[1, 2, 3], vec![1, 2, 3], &[], 100, None, 1, t);
        assert!(c.lookup(&[1, 2, 3], None, t).is_none());
        let h = c.lookup(&[1, 2, 3, 4], None, t).unwrap();
        assert_eq!((h.len, h.logits), (3, None));
    }

    #[test]
    fn bounded_by_entries_bytes_and_idle_time() {
        let t = Instant::now();
        let mut c = PrefixCache::new(policy());
        for i in 0..5u32 {
            put(&mut c, &[i], None, 1, t + Duration::from_secs(i as u64));
        }
        assert_eq!(c.stats().entries, 3);
        assert!(c.lookup(&[0], None, t).is_none() && c.lookup(&[4], None, t).is_some(), "not LRU");
        // 100 state bytes + 16 logits + 4 per token: two entries fit in 250 bytes.
        c.set_policy(CachePolicy { max_bytes: 250, ..policy() }, t + Duration::from_secs(4));
        assert_eq!(c.stats().entries, 2);
        assert!(c.stats().bytes <= 250);
        c.expire(t + Duration::from_secs(100));
        assert_eq!(c.stats().entries, 0);
        assert!(c.stats().expirations > 0 && c.stats().evictions > 0);
    }

    #[test]
    fn sessions_are_private_and_keep_their_latest_request() {
        let t = Instant::now();
        let mut c = PrefixCache::new(policy());
        put(&mut c, &[1, 2, 3], Some("a"), 1, t);
        assert!(c.lookup(&[1, 2, 3, 4], None, t).is_none(), "another request saw a session's snapshot");
        assert!(c.lookup(&[1, 2, 3, 4], Some("b"), t).is_none());
        assert_eq!(c.lookup(&[1, 2, 3, 4], Some("a"), t).unwrap().len, 3);
        put(&mut c, &[1, 2, 3, 4, 5], Some("a"), 2, t);
        put(&mut c, &[1, 2, 3, 4, 5, 6], Some("a"), 2, t);
        assert_eq!(c.stats().session_entries, 2, "the first request's snapshot was kept");
        // Sessions are bounded in number (oldest first) and expire on their own clock.
        put(&mut c, &[8], Some("b"), 3, t + Duration::from_secs(1));
        put(&mut c, &[9], Some("c"), 4, t + Duration::from_secs(2));
        assert_eq!(c.stats().sessions, 2);
        assert!(c.lookup(&[1, 2, 3, 4, 5], Some("a"), t).is_none());
        c.expire(t + Duration::from_secs(50));
        assert_eq!(c.stats().sessions, 2, "sessions expired on the shared clock");
        assert!(c.drop_session("b") && !c.drop_session("b"));
    }

    #[test]
    fn branch_points_are_found_in_earlier_prompts() {
        let t = Instant::now();
        let mut c = PrefixCache::new(policy());
        put(&mut c, &[1, 2, 3, 4, 5], None, 1, t);
        put(&mut c, &[9, 9], Some("s"), 2, t);
        assert_eq!(c.shared_prefix(&[1, 2, 3, 7, 7, 7], None), 3);
        assert_eq!(c.shared_prefix(&[9, 9, 9], None), 0, "a session's tokens leaked");
        assert_eq!(c.shared_prefix(&[9, 9, 9], Some("s")), 2);
    }

    #[test]
    fn disabled_cache_stores_nothing() {
        let t = Instant::now();
        let mut c = PrefixCache::new(CachePolicy { enabled: false, ..policy() });
        assert!(!c.wants(&[1], None));
        put(&mut c, &[1], None, 1, t);
        assert!(c.lookup(&[1, 2], None, t).is_none());
        assert_eq!(c.stats().entries, 0);
    }
}

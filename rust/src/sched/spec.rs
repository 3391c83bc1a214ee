//! Speculative decoding in the core: n-gram prompt lookup proposes tokens, the plan verifies
//! them as extra query rows of their sequence, `update` keeps the accepted run and rolls the
//! rest back.
//!
//! Everything per request happens here, in Rust: the proposal (a suffix match over the
//! sequence's own tokens), the adaptive proposal length and the counters.

use crate::error::{CoreError, CoreResult};

/// vLLM's `speculative_config` for `method: ngram`, plus the core's own "never slower" knob.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecConfig {
    /// Most tokens proposed per sequence per step.
    pub num_speculative_tokens: usize,
    /// Longest suffix matched; then shorter ones down to `prompt_lookup_min`.
    pub prompt_lookup_max: usize,
    pub prompt_lookup_min: usize,
    /// Speculate only while at most this many tokens would be in a step's decode batch
    /// (running sequences plus proposals): past that the batch is compute-bound on a CPU and
    /// a rejected row costs as much as a useful one.
    pub max_batch_tokens: usize,
    /// Proposals come from outside the core (a draft model): `schedule` reserves the rows
    /// and their lookahead blocks, `Scheduler::set_proposals` fills in the tokens.
    pub external: bool,
}

impl SpecConfig {
    pub fn validate(&self) -> CoreResult<()> {
        if self.num_speculative_tokens == 0 {
            return Err(CoreError::invalid("num_speculative_tokens", "must be >= 1"));
        }
        if self.prompt_lookup_min == 0 {
            return Err(CoreError::invalid("prompt_lookup_min", "must be >= 1"));
        }
        if self.prompt_lookup_max < self.prompt_lookup_min {
            return Err(CoreError::invalid(
                "prompt_lookup_max",
                format!(
                    "must be >= prompt_lookup_min ({}), got {}",
                    self.prompt_lookup_min, self.prompt_lookup_max
                ),
            ));
        }
        Ok(())
    }
}

/// A sequence's adaptive proposal state.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct SpecState {
    /// The request may speculate (the sampler can verify its rows exactly).
    pub allowed: bool,
    /// Proposal length for the next step.
    pub k: usize,
    /// Steps left before it proposes again (after proposals that were all rejected).
    pub cooldown: u32,
    /// Consecutive verifications that accepted nothing.
    pub misses: u32,
}

impl SpecState {
    pub fn reset(&mut self, allowed: bool, k: usize) {
        *self = Self {
            allowed,
            k,
            cooldown: 0,
            misses: 0,
        };
    }

    /// After a verification of `proposed` tokens of which `accepted` were right: grow the
    /// length on a full hit, shrink it to what was used otherwise, and back off
    /// exponentially (up to 64 steps) while nothing is accepted.
    pub fn record(&mut self, proposed: usize, accepted: usize, max_k: usize) {
        if accepted == proposed {
            self.k = (self.k + 2).min(max_k);
        } else {
            self.k = (accepted + 1).clamp(1, max_k);
        }
        if accepted == 0 {
            self.misses += 1;
            self.cooldown = (1u32 << self.misses.min(6)) - 1;
        } else {
            self.misses = 0;
        }
    }
}

/// Counters for `/metrics` (vLLM's spec_decode_* names).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecStats {
    /// Sequence-steps that verified at least one proposal.
    pub num_drafts: u64,
    pub num_draft_tokens: u64,
    pub num_accepted_tokens: u64,
    /// Accepted tokens by position in the proposal (0 = the first proposed token).
    pub accepted_per_pos: Vec<u64>,
    /// Proposed tokens a constrained sequence's grammar rejected (with those after them): cut
    /// before verification (n-gram), or verified and certain to fail (a draft model's).
    pub grammar_cut_tokens: u64,
}

impl SpecStats {
    pub fn record(&mut self, proposed: usize, accepted: usize) {
        self.num_drafts += 1;
        self.num_draft_tokens += proposed as u64;
        self.num_accepted_tokens += accepted as u64;
        if self.accepted_per_pos.len() < proposed {
            self.accepted_per_pos.resize(proposed, 0);
        }
        for c in &mut self.accepted_per_pos[..accepted] {
            *c += 1;
        }
    }
}

/// A suffix match shorter than this proposes at most as many tokens as it matched. On the
/// shipped copy-heavy prompts (bench/spec_prompts.json, default model) a proposal's first token
/// was right 23% of the time after a 1-token match, 46% after 2, 63% after 3, 79% after 4:
/// a short match's later tokens are mostly rejected rows.
pub const TRUSTED_MATCH: usize = 3;

/// A suffix match this long proposes even while the sequence backs off after misses: the
/// backoff is for text that does not repeat, and a 2-token match is the output copying again
/// (on those prompts, cooling down regardless sat out copy runs for up to 63 steps).
pub const BYPASS_MATCH: usize = 2;

/// Tokens back from a suffix match that [`ngram_propose`] compares to rank its occurrences.
pub const MATCH_CONTEXT: usize = 32;

/// Occurrences of the suffix that [`ngram_propose`] ranks, latest first: it stays O(len) per
/// step on text that repeats one n-gram everywhere.
pub const MATCH_CANDIDATES: usize = 16;

/// Prompt lookup: the tokens that followed an earlier occurrence of the longest suffix of
/// `tokens` (of `max_n` down to `min_n` tokens) that occurs earlier, at most `k`. Among the
/// (latest [`MATCH_CANDIDATES`]) occurrences, the one whose agreement with the text before
/// the suffix runs furthest back (up to [`MATCH_CONTEXT`] tokens), the latest among equals:
/// code repeats short n-grams (`self.`, `    return`), and the occurrence that shares the
/// longest context is the one a copy is following. On the shipped copy prompts' greedy outputs
/// (default model, k = 5) that raises the tokens a verification yields by 2.4% over the latest
/// occurrence alone. Written into `out` (cleared first). Returns the matched suffix's length
/// (0: none).
pub fn ngram_propose(
    tokens: &[u32],
    min_n: usize,
    max_n: usize,
    k: usize,
    out: &mut Vec<u32>,
) -> usize {
    out.clear();
    let len = tokens.len();
    if k == 0 {
        return 0;
    }
    for n in (min_n..=max_n.min(len.saturating_sub(1))).rev() {
        let suffix = &tokens[len - n..];
        let (mut best, mut best_ctx, mut seen) = (None, 0, 0);
        for start in (0..len - n).rev() {
            if &tokens[start..start + n] != suffix {
                continue;
            }
            // How far the text before this occurrence agrees with the text before the suffix.
            let ctx = tokens[..start]
                .iter()
                .rev()
                .zip(tokens[..len - n].iter().rev())
                .take(MATCH_CONTEXT)
                .take_while(|(a, b)| a == b)
                .count();
            if best.is_none() || ctx > best_ctx {
                (best, best_ctx) = (Some(start), ctx);
            }
            seen += 1;
            if seen == MATCH_CANDIDATES || best_ctx == MATCH_CONTEXT {
                break;
            }
        }
        if let Some(start) = best {
            let from = start + n;
            out.extend_from_slice(&tokens[from..(from + k).min(len)]);
            return n;
        }
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn propose(t: &[u32], min_n: usize, max_n: usize, k: usize) -> Vec<u32> {
        let mut out = Vec::new();
        let n = ngram_propose(t, min_n, max_n, k, &mut out);
        assert_eq!(n == 0, out.is_empty());
        out
    }

    #[test]
    fn proposes_what_followed_the_suffix() {
        // "1 2 3 4 5 ... 1 2" -> 3 4 5
        assert_eq!(propose(&[1, 2, 3, 4, 5, 9, 1, 2], 1, 3, 3), vec![3, 4, 5]);
        // Capped by the end of the sequence.
        assert_eq!(propose(&[7, 8, 7], 1, 2, 5), vec![8, 7]);
        assert_eq!(propose(&[1, 2, 3], 1, 3, 4), Vec::<u32>::new());
    }

    #[test]
    fn longer_suffix_wins_and_latest_match() {
        // suffix (5, 6) matches at 3 -> 7, though the 1-gram 6 also occurs later (-> 9).
        let t = [0, 0, 0, 5, 6, 7, 6, 9, 5, 6];
        assert_eq!(propose(&t, 1, 2, 1), vec![7]);
        // The 1-gram 6 alone: the occurrence after 5 (as the suffix is) beats the later one.
        assert_eq!(propose(&t, 1, 1, 1), vec![7]);
        let other = [0, 0, 0, 5, 6, 7, 6, 9, 4, 6];
        assert_eq!(propose(&other, 1, 1, 1), vec![9]);
        // min_n above any match: nothing.
        assert_eq!(propose(&[1, 2, 3, 1, 2], 3, 3, 2), Vec::<u32>::new());
        // The matched length comes back.
        let mut out = Vec::new();
        assert_eq!(ngram_propose(&t, 1, 2, 1, &mut out), 2);
        assert_eq!(ngram_propose(&[4, 1, 2, 3, 9, 2, 3], 1, 4, 2, &mut out), 2);
        assert_eq!(out, vec![9, 2]);
        assert_eq!(ngram_propose(&[1, 2, 3], 1, 4, 2, &mut out), 0);
    }

    #[test]
    fn the_occurrence_sharing_the_most_context_wins() {
        // Suffix (7) occurs at 1 (after 5) and at 4 (after 6); the text before the suffix is
        // "... 5": the earlier occurrence shares that context and proposes 8, the latest 9.
        let t = [5, 7, 8, 6, 7, 9, 0, 5, 7];
        assert_eq!(propose(&t, 1, 1, 1), vec![8]);
        // Equal context (none): the latest occurrence.
        let t = [1, 7, 8, 2, 7, 9, 3, 7];
        assert_eq!(propose(&t, 1, 1, 1), vec![9]);
        // A longer suffix still wins over more context for a shorter one.
        let t = [4, 5, 6, 1, 4, 5, 2, 9, 5, 6, 3, 9, 5, 6];
        assert_eq!(propose(&t, 1, 2, 1), vec![3]);
        // Only the latest MATCH_CANDIDATES occurrences are ranked: the one after "1 2" shares the
        // most context, and is found while it is among them.
        for (reps, want) in [(MATCH_CANDIDATES - 1, 50), (MATCH_CANDIDATES, 100)] {
            let mut t: Vec<u32> = vec![1, 2, 7, 50];
            for _ in 0..reps {
                t.extend([3, 7, 100]);
            }
            t.extend([1, 2, 7]);
            assert_eq!(propose(&t, 1, 1, 1), vec![want], "{reps}");
        }
    }

    #[test]
    fn adaptive_length_backs_off_and_recovers() {
        let mut s = SpecState::default();
        s.reset(true, 4);
        s.record(4, 4, 8);
        assert_eq!(s.k, 6);
        s.record(6, 1, 8);
        assert_eq!((s.k, s.cooldown), (2, 0));
        s.record(2, 0, 8);
        s.record(1, 0, 8);
        assert_eq!((s.k, s.misses, s.cooldown), (1, 2, 3));
        s.record(1, 1, 8);
        assert_eq!((s.k, s.misses), (3, 0));
    }

    #[test]
    fn config_errors_name_the_field() {
        let ok = SpecConfig {
            num_speculative_tokens: 3,
            prompt_lookup_max: 3,
            prompt_lookup_min: 1,
            max_batch_tokens: 32,
            external: false,
        };
        assert!(ok.validate().is_ok());
        let bad = SpecConfig {
            prompt_lookup_max: 0,
            ..ok.clone()
        };
        assert!(format!("{:?}", bad.validate()).contains("prompt_lookup_max"));
        let bad = SpecConfig {
            num_speculative_tokens: 0,
            ..ok
        };
        assert!(format!("{:?}", bad.validate()).contains("num_speculative_tokens"));
    }
}

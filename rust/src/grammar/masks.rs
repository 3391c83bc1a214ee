//! Per-sequence matchers and the step's mask computation on a worker thread.

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

use llguidance::Matcher;

/// One constrained sequence's grammar state. The scheduler and the mask worker share it; the
/// scheduler joins the worker before advancing it, so the lock is never contended in practice.
#[derive(Clone)]
pub struct SeqMatcher {
    inner: Arc<Mutex<Matcher>>,
    eos: Arc<[u32]>,
    mask_words: usize,
}

impl SeqMatcher {
    pub(crate) fn new(m: Matcher, eos: Arc<[u32]>, mask_words: usize) -> Self {
        Self {
            inner: Arc::new(Mutex::new(m)),
            eos,
            mask_words,
        }
    }

    /// 32-bit words in its mask row.
    pub fn mask_words(&self) -> usize {
        self.mask_words
    }

    fn lock(&self) -> MutexGuard<'_, Matcher> {
        // A panic inside llguidance is caught there; a poisoned lock still holds a matcher
        // whose own error state says what happened.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Advance with the sampled token. True when the sequence must finish: the grammar is
    /// complete (accepting, nothing more allowed, or EOS taken) or the token was not allowed.
    pub fn advance(&self, token: u32) -> bool {
        let mut m = self.lock();
        m.consume_token(token).is_err() || m.is_stopped()
    }

    /// Write the allowed tokens into `row` (`mask_words` words). A matcher that has failed or
    /// stopped allows only EOS, so the row is never empty and the next token ends it.
    pub fn fill_mask(&self, row: &mut [u32]) {
        let mut m = self.lock();
        let mask = if m.is_stopped() {
            None
        } else {
            m.compute_mask().ok()
        };
        match mask {
            Some(v) => {
                let src = v.as_slice();
                let n = src.len().min(row.len());
                row[..n].copy_from_slice(&src[..n]);
                row[n..].fill(0);
            }
            None => {
                row.fill(0);
                for &t in self.eos.iter() {
                    if let Some(w) = row.get_mut(t as usize / 32) {
                        *w |= 1 << (t % 32);
                    }
                }
            }
        }
    }

    /// Whether the grammar can end here (EOS would be allowed).
    pub fn is_accepting(&self) -> bool {
        self.lock().is_accepting().unwrap_or(false)
    }

    pub fn is_stopped(&self) -> bool {
        self.lock().is_stopped()
    }

    /// How many leading tokens of a proposal the grammar allows in turn from here, without
    /// advancing: the proposal is cut there. An id past the tokenizer's (LM-head padding, which
    /// llguidance would take for an internal error and fail the matcher on) cuts it too.
    pub fn allowed_prefix(&self, draft: &[u32]) -> usize {
        let mut m = self.lock();
        if draft.is_empty() || m.is_stopped() {
            return 0;
        }
        let Ok(env) = m.tok_env() else {
            return 0;
        };
        let n_vocab = env.tok_trie().vocab_size();
        let known = draft
            .iter()
            .position(|&t| t as usize >= n_vocab)
            .unwrap_or(draft.len());
        // An EOS ends the sequence: nothing after it is worth a row.
        let ok = m.validate_tokens(&draft[..known]).unwrap_or(0);
        match draft[..ok].iter().position(|t| self.eos.contains(t)) {
            Some(i) => i + 1,
            None => ok,
        }
    }

    /// Take `token` if the grammar allows it here (false: left as it was).
    pub(crate) fn try_advance(&self, token: u32) -> bool {
        self.allowed_prefix(&[token]) == 1 && self.lock().consume_token(token).is_ok()
    }

    /// Undo the last `n` tokens taken. A failure leaves the matcher in its error state: the next
    /// `advance` ends the sequence, as any grammar failure does.
    pub(crate) fn rollback(&self, n: usize) {
        if n > 0 {
            let _ = self.lock().rollback(n);
        }
    }

    /// Masks for a run of rows: row 0 at the current state, row `j` after `draft[..j]`
    /// (`out` holds `draft.len() + 1` rows). The matcher is rolled back to where it was; a
    /// proposal its previous row's mask rejects ends the walk, and the rows after it (never
    /// reached: verification stops at that proposal) repeat the last mask.
    fn fill_run(&self, out: &mut [u32], draft: &[u32]) {
        let words = self.mask_words;
        let (first, rest) = out.split_at_mut(words);
        self.fill_mask(first);
        if draft.is_empty() {
            return;
        }
        let mut prev: &mut [u32] = first;
        let mut rows = rest.chunks_exact_mut(words);
        let mut taken = 0;
        for &t in draft {
            let row = rows.next().expect("one row per proposal");
            let allowed = prev
                .get(t as usize / 32)
                .is_some_and(|w| w >> (t % 32) & 1 == 1);
            if !allowed || self.lock().consume_token(t).is_err() {
                row.copy_from_slice(prev);
                for r in rows.by_ref() {
                    r.copy_from_slice(prev);
                }
                break;
            }
            taken += 1;
            self.fill_mask(row);
            prev = row;
        }
        self.rollback(taken);
    }
}

impl fmt::Debug for SeqMatcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SeqMatcher")
    }
}

/// The masks of one step's constrained sample rows.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct TokenBitmask {
    /// The sample row (index into `plan.sample_slots`) of each mask row.
    pub rows: Vec<i64>,
    pub words_per_row: usize,
    /// `rows.len() × words_per_row`, row-major.
    pub bits: Vec<u32>,
    /// Wall-clock time the worker spent computing them.
    pub compute_ns: u64,
}

/// One constrained sequence's share of a step's masks: one row, plus one per proposed token it
/// verifies (the masks after each proposal in turn).
#[derive(Debug, Clone)]
pub struct MaskUnit {
    pub matcher: SeqMatcher,
    pub draft: Vec<u32>,
}

impl MaskUnit {
    pub fn rows(&self) -> usize {
        1 + self.draft.len()
    }
}

impl From<SeqMatcher> for MaskUnit {
    fn from(matcher: SeqMatcher) -> Self {
        Self {
            matcher,
            draft: Vec::new(),
        }
    }
}

/// A step's mask computation, running on its own thread from `start` until `join`.
pub struct MaskJob {
    handle: JoinHandle<TokenBitmask>,
}

impl MaskJob {
    /// Compute the units' masks, in order, one row each plus one per proposal, over `threads`
    /// threads at most.
    pub fn start(
        rows: Vec<i64>,
        units: Vec<MaskUnit>,
        words_per_row: usize,
        threads: usize,
    ) -> Self {
        let handle = std::thread::spawn(move || compute(rows, units, words_per_row, threads));
        Self { handle }
    }

    /// Wait for the masks.
    pub fn join(self) -> TokenBitmask {
        match self.handle.join() {
            Ok(m) => m,
            Err(p) => std::panic::resume_unwind(p),
        }
    }
}

/// Compute the masks now, on the calling thread and up to `threads - 1` helpers.
pub(crate) fn compute(
    rows: Vec<i64>,
    units: Vec<MaskUnit>,
    words_per_row: usize,
    threads: usize,
) -> TokenBitmask {
    let t0 = Instant::now();
    let n: usize = units.iter().map(MaskUnit::rows).sum();
    let mut bits = vec![0u32; n * words_per_row];
    if n > 0 && words_per_row > 0 {
        // Contiguous runs of units per thread (neighbouring rows often share a grammar), of
        // about the same number of rows; a unit's rows stay together (each follows the last).
        let per = n.div_ceil(threads.clamp(1, units.len()));
        let mut parts: Vec<(&mut [u32], &[MaskUnit])> = Vec::new();
        let (mut rest, mut from, mut taken) = (&mut bits[..], 0, 0);
        for (i, u) in units.iter().enumerate() {
            taken += u.rows();
            if taken >= per || i + 1 == units.len() {
                let (out, tail) = std::mem::take(&mut rest).split_at_mut(taken * words_per_row);
                parts.push((out, &units[from..=i]));
                (rest, from, taken) = (tail, i + 1, 0);
            }
        }
        std::thread::scope(|scope| {
            let mut parts = parts.into_iter();
            let first = parts.next();
            for (out, us) in parts {
                scope.spawn(move || fill(out, us, words_per_row));
            }
            if let Some((out, us)) = first {
                fill(out, us, words_per_row);
            }
        });
    }
    TokenBitmask {
        rows,
        words_per_row,
        bits,
        compute_ns: t0.elapsed().as_nanos() as u64,
    }
}

fn fill(mut out: &mut [u32], units: &[MaskUnit], words: usize) {
    for u in units {
        let (run, rest) = std::mem::take(&mut out).split_at_mut(u.rows() * words);
        u.matcher.fill_run(run, &u.draft);
        out = rest;
    }
}

/// On each row `rows[i]` of `logits` (row-major, `vocab` columns), set every token not allowed
/// by mask row `i` of `bits` (`words` words a row) to -inf. Panics on out-of-range rows: the
/// caller checks them.
pub fn apply_bitmask(logits: &mut [f32], vocab: usize, rows: &[i64], bits: &[u32], words: usize) {
    for (i, &r) in rows.iter().enumerate() {
        let row = &mut logits[r as usize * vocab..(r as usize + 1) * vocab];
        let mask = &bits[i * words..(i + 1) * words];
        for (chunk, &w) in row.chunks_mut(32).zip(mask) {
            match w {
                u32::MAX => {}
                0 => chunk.fill(f32::NEG_INFINITY),
                _ => {
                    // Branch-free, so it vectorises.
                    for (b, x) in chunk.iter_mut().enumerate() {
                        let keep = w >> b & 1 == 1;
                        *x = if keep { *x } else { f32::NEG_INFINITY };
                    }
                }
            }
        }
        // Columns past the mask's words (a narrower mask) are not allowed either.
        if words * 32 < vocab {
            row[words * 32..].fill(f32::NEG_INFINITY);
        }
    }
}

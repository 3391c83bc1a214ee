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

/// A step's mask computation, running on its own thread from `start` until `join`.
pub struct MaskJob {
    handle: JoinHandle<TokenBitmask>,
}

impl MaskJob {
    /// Compute `matchers[i]`'s mask as row `i`, over `threads` threads at most.
    pub fn start(
        rows: Vec<i64>,
        matchers: Vec<SeqMatcher>,
        words_per_row: usize,
        threads: usize,
    ) -> Self {
        let handle = std::thread::spawn(move || compute(rows, matchers, words_per_row, threads));
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
    matchers: Vec<SeqMatcher>,
    words_per_row: usize,
    threads: usize,
) -> TokenBitmask {
    let t0 = Instant::now();
    let n = matchers.len();
    let mut bits = vec![0u32; n * words_per_row];
    if n > 0 && words_per_row > 0 {
        let parts = threads.clamp(1, n);
        // Contiguous runs of rows per thread: neighbouring rows often share a grammar.
        let per = n.div_ceil(parts);
        std::thread::scope(|scope| {
            let mut chunks = bits
                .chunks_mut(per * words_per_row)
                .zip(matchers.chunks(per));
            let first = chunks.next();
            for (out, ms) in chunks {
                scope.spawn(move || fill(out, ms, words_per_row));
            }
            if let Some((out, ms)) = first {
                fill(out, ms, words_per_row);
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

fn fill(out: &mut [u32], matchers: &[SeqMatcher], words: usize) {
    for (row, m) in out.chunks_exact_mut(words).zip(matchers) {
        m.fill_mask(row);
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

//! Grammar text -> a compiled grammar, bounded in shape, size, work and wall-clock time.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::{CancellationHandle, Matcher, ParserFactory};

use super::shape::{self, ShapeLimits};
use super::vocab::Vocab;
use crate::error::{CoreError, CoreResult};

/// Longest error message kept: llguidance can quote large parts of a grammar.
const MAX_ERROR_LEN: usize = 600;

/// Stack of each compile thread. llguidance compiles by recursion, so the stack bounds the
/// deepest grammar; `shape` bounds the depth first. Measured by `shape_tests` (the resident
/// size of the thread's stack after compiling the deepest accepted input of each shape), release
/// / debug: a 998-rule Lark chain 3.0 / 13.8 MiB, 5000 properties 2.3 / 5.2 MiB, a 253-long
/// `$ref` chain 1.0 / 5.6 MiB (the default 2 MiB overflowed on all three). 64 MiB leaves 4.6x
/// over the worst debug case, 21x in release; untouched stack pages cost only address space,
/// and `max_threads` bounds how many such stacks exist.
pub(crate) const STACK_SIZE: usize = 64 << 20;

/// A compiled grammar this large is shared by its sequences rather than copied to each one
/// (their masks then take turns on its lexer cache).
const COPY_BELOW_BYTES: usize = 16 << 20;

/// What one compilation may cost. The fuel limits are llguidance's own (they bound the work
/// deterministically); `timeout` bounds the wall clock on top, for a busy or slow machine.
#[derive(Debug, Clone, PartialEq)]
pub struct GrammarLimits {
    pub timeout: Duration,
    /// Symbols in the grammar's productions.
    pub max_grammar_size: usize,
    /// Work to build the lexer's regex nodes.
    pub initial_lexer_fuel: u64,
    /// Lexer work for one token mask.
    pub step_lexer_fuel: u64,
    /// Lexer states kept (memory: ~1-2 kB each).
    pub max_lexer_states: usize,
    /// Compile threads alive at once, counting those whose caller gave up (timed out): an
    /// abandoned compilation runs on until llguidance stops it, and a storm of slow grammars
    /// must not pile up threads. A compile waits for a free one within its `timeout`.
    pub max_threads: usize,
    /// Estimated memory of one compiled grammar (`CompiledGrammar::size_bytes`).
    pub max_bytes: usize,
    pub shape: ShapeLimits,
}

impl Default for GrammarLimits {
    fn default() -> Self {
        let d = ParserLimits::default();
        Self {
            timeout: Duration::from_secs(10),
            max_grammar_size: d.max_grammar_size,
            initial_lexer_fuel: d.initial_lexer_fuel,
            step_lexer_fuel: d.step_lexer_fuel,
            max_lexer_states: d.max_lexer_states,
            max_threads: 4,
            max_bytes: 128 << 20,
            shape: ShapeLimits::default(),
        }
    }
}

/// Why a compilation failed.
#[derive(Debug, Clone, PartialEq)]
pub enum CompileError {
    /// The grammar is invalid or over a limit: the same text fails again.
    Grammar(String),
    /// Every compile thread stayed busy for the whole timeout: worth retrying later.
    Busy(String),
}

impl From<CompileError> for CoreError {
    fn from(e: CompileError) -> Self {
        match e {
            CompileError::Grammar(m) | CompileError::Busy(m) => CoreError::Grammar(m),
        }
    }
}

/// The compile threads alive, bounded.
struct Threads {
    live: Mutex<usize>,
    freed: Condvar,
    max: usize,
}

/// One live compile thread; dropping it (when the thread ends) frees its place.
struct ThreadSlot(Arc<Threads>);

impl Threads {
    fn acquire(self: &Arc<Self>, deadline: Instant) -> Option<ThreadSlot> {
        let mut live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        while *live >= self.max {
            let left = deadline.checked_duration_since(Instant::now())?;
            live = self
                .freed
                .wait_timeout(live, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        *live += 1;
        Some(ThreadSlot(self.clone()))
    }

    fn live(&self) -> usize {
        *self.live.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for ThreadSlot {
    fn drop(&mut self) {
        *self.0.live.lock().unwrap_or_else(|e| e.into_inner()) -= 1;
        self.0.freed.notify_one();
    }
}

/// The caller's request to stop an abandoned compilation: a flag checked between llguidance's
/// steps, and llguidance's own cancellation of the first mask once the parser exists.
#[derive(Default)]
struct Stop {
    flag: AtomicBool,
    handle: Mutex<Option<CancellationHandle>>,
}

impl Stop {
    fn stop(&self) {
        self.flag.store(true, Ordering::Relaxed);
        if let Some(h) = &*self.handle.lock().unwrap_or_else(|e| e.into_inner()) {
            h.cancel();
        }
    }

    fn stopped(&self) -> bool {
        self.flag.load(Ordering::Relaxed)
    }

    fn watch(&self, h: CancellationHandle) {
        *self.handle.lock().unwrap_or_else(|e| e.into_inner()) = Some(h.clone());
        // A stop that came before the handle was published.
        if self.stopped() {
            h.cancel();
        }
    }
}

/// Compiles grammars for one tokenizer. Cheap to share: clones share the token trie.
#[derive(Clone)]
pub struct GrammarCompiler {
    factory: Arc<ParserFactory>,
    vocab: Vocab,
    timeout: Duration,
    max_bytes: usize,
    shape: ShapeLimits,
    threads: Arc<Threads>,
}

impl GrammarCompiler {
    /// Builds llguidance's per-tokenizer tables (the token trie and its slices): once per
    /// tokenizer, it takes a while on large vocabularies.
    pub fn new(vocab: Vocab, limits: GrammarLimits) -> CoreResult<Self> {
        if limits.timeout.is_zero() {
            return Err(CoreError::invalid("timeout", "must be > 0"));
        }
        if limits.max_threads == 0 {
            return Err(CoreError::invalid("max_threads", "must be > 0"));
        }
        let mut factory = ParserFactory::new_simple(&vocab.env)
            .map_err(|e| CoreError::invalid("vocab", e.to_string()))?;
        factory.quiet();
        let l = factory.limits_mut();
        l.max_grammar_size = limits.max_grammar_size;
        l.initial_lexer_fuel = limits.initial_lexer_fuel;
        l.step_lexer_fuel = limits.step_lexer_fuel;
        l.max_lexer_states = limits.max_lexer_states;
        // Errors go back to API clients: the grammar dump would make them unreadable.
        l.verbose_errors = false;
        Ok(Self {
            factory: Arc::new(factory),
            vocab,
            timeout: limits.timeout,
            max_bytes: limits.max_bytes,
            shape: limits.shape,
            threads: Arc::new(Threads {
                live: Mutex::new(0),
                freed: Condvar::new(),
                max: limits.max_threads,
            }),
        })
    }

    pub fn vocab(&self) -> &Vocab {
        &self.vocab
    }

    /// Compile threads alive now, abandoned ones included.
    pub fn live_threads(&self) -> usize {
        self.threads.live()
    }

    /// `compile_checked`, with both failures as `CoreError::Grammar`.
    pub fn compile(&self, text: &str) -> CoreResult<CompiledGrammar> {
        Ok(self.compile_checked(text)?)
    }

    /// Compile llguidance's grammar text: a TopLevelGrammar JSON object (`{"grammars":
    /// [{"json_schema": ...}]}`, `{"lark_grammar": ...}`, ...) or a bare Lark grammar.
    ///
    /// The shape is checked first (`ShapeLimits`). The work runs on its own thread so that the
    /// wall-clock bound holds whatever the grammar: past it the call fails and asks the thread
    /// to stop, which it does between steps and inside the first mask; llguidance's fuel
    /// limits bound the steps themselves. The first token mask is computed here too, so a
    /// grammar that allows nothing fails now rather than mid-generation.
    pub fn compile_checked(&self, text: &str) -> Result<CompiledGrammar, CompileError> {
        let deadline = Instant::now() + self.timeout;
        let grammar = TopLevelGrammar::from_lark_or_grammar_list(text).map_err(grammar_error)?;
        shape::check(&grammar, &self.shape)
            .map_err(|e| CompileError::Grammar(format!("grammar too complex: {e}")))?;
        let slot = self.threads.acquire(deadline).ok_or_else(|| {
            CompileError::Busy(format!(
                "the grammar compiler is busy: {} compilations running for {:.1} s",
                self.threads.max,
                self.timeout.as_secs_f64()
            ))
        })?;
        let factory = self.factory.clone();
        let text_len = text.len();
        let stop = Arc::new(Stop::default());
        let stop_in = stop.clone();
        let (tx, rx) = mpsc::sync_channel(1);
        std::thread::Builder::new()
            .name("ironlm-grammar".into())
            .stack_size(STACK_SIZE)
            .spawn(move || {
                let _slot = slot;
                yield_cpu();
                let built = build(&factory, grammar, &stop_in);
                let size = built.as_ref().map_or(0, |b| size_estimate(b.1, text_len));
                let _ = tx.send(built.map(|(m, _)| (m, size)));
                release_scratch(size.max(text_len * 32));
            })
            .map_err(|e| CompileError::Busy(format!("cannot start a compile thread: {e}")))?;
        let left = deadline.saturating_duration_since(Instant::now());
        let (matcher, size_bytes) = match rx.recv_timeout(left) {
            Ok(r) => r.map_err(grammar_error)?,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                stop.stop();
                return Err(CompileError::Grammar(format!(
                    "the grammar took longer than {:.1} s to compile",
                    self.timeout.as_secs_f64()
                )));
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return Err(CompileError::Grammar("the grammar compiler failed".into()))
            }
        };
        if size_bytes > self.max_bytes {
            return Err(CompileError::Grammar(format!(
                "the compiled grammar would take about {} MB of memory (limit {} MB)",
                size_bytes >> 20,
                self.max_bytes >> 20
            )));
        }
        Ok(CompiledGrammar(Arc::new(Compiled {
            matcher,
            eos: self.vocab.eos.clone(),
            mask_words: self.vocab.mask_words(),
            size_bytes,
        })))
    }
}

/// The compile thread's work: the parser, its first mask, and its lexer's size.
fn build(
    factory: &ParserFactory,
    grammar: TopLevelGrammar,
    stop: &Stop,
) -> Result<(Matcher, usize), String> {
    let mut parser = factory.create_parser(grammar).map_err(|e| e.to_string())?;
    if stop.stopped() {
        return Err("compilation abandoned".into());
    }
    stop.watch(parser.enable_cancellation());
    parser.start_without_prompt();
    parser.compute_mask().map_err(|e| e.to_string())?;
    let lexer_bytes = parser.parser.lexer_stats().num_bytes;
    Ok((Matcher::new(Ok(parser)), lexer_bytes))
}

/// Memory a compiled grammar holds, after its first mask. llguidance estimates its lexer
/// tables (regex nodes, derivatives, DFA states); the grammar's rules are not counted there and
/// grow with the text. Fitted to the RSS each compiled grammar kept (SmolLM2's 49k-token vocab,
/// malloc trimmed): 100k-alternative regex (800 KB) 14.5 MB held, lexer 2.9 MB; 10k-choice
/// (160 KB) 11.2 MB, lexer 1.7 MB; 20k-alternative regex (160 KB) 2.0 MB, lexer 0.6 MB; a
/// 300-property schema (17 KB) ~0.1 MB, lexer 0.2 MB. 4x the lexer plus 32 bytes per byte of
/// text is at or above each.
fn size_estimate(lexer_bytes: usize, text_len: usize) -> usize {
    lexer_bytes
        .saturating_mul(4)
        .saturating_add(text_len.saturating_mul(32))
}

/// Give the compile's scratch memory back to the system. Each compile thread gets a glibc arena
/// of its own, which keeps its peak (~100 MB for a 100k-alternative regex) after the thread is
/// gone; without this, a stream of large grammars holds many such peaks.
fn release_scratch(size: usize) {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if size >= TRIM_ABOVE_BYTES {
        // SAFETY: malloc_trim only returns free heap pages to the kernel.
        unsafe {
            libc::malloc_trim(0);
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    let _ = size;
}

/// Lower this thread's priority (Linux nice values are per thread): a storm of slow grammars
/// must not take the CPU from the engine's steps and from tokenizing other requests. Nice 5
/// gives a compile about a quarter of a core that a nice-0 thread also wants (CFS weights 335
/// vs 1024): it still finishes within its timeout on a busy server, behind the engine.
fn yield_cpu() {
    #[cfg(target_os = "linux")]
    // SAFETY: setpriority on the calling thread (who = 0) changes only its nice value.
    unsafe {
        libc::setpriority(libc::PRIO_PROCESS, 0, COMPILE_NICE);
    }
}

#[cfg(target_os = "linux")]
const COMPILE_NICE: libc::c_int = 5;

/// Small compiles leave little scratch: not worth a trim (it walks every arena).
const TRIM_ABOVE_BYTES: usize = 4 << 20;

fn grammar_error(e: impl fmt::Display) -> CompileError {
    let mut msg = e.to_string();
    if msg.len() > MAX_ERROR_LEN {
        let mut cut = MAX_ERROR_LEN;
        while !msg.is_char_boundary(cut) {
            cut -= 1;
        }
        msg.truncate(cut);
        msg.push_str("...");
    }
    CompileError::Grammar(format!("invalid grammar: {msg}"))
}

struct Compiled {
    /// In its start state, first mask computed: each sequence starts from a copy (or a
    /// shared clone, over `COPY_BELOW_BYTES`).
    matcher: Matcher,
    eos: Arc<[u32]>,
    mask_words: usize,
    size_bytes: usize,
}

/// A compiled grammar, shared by every request that uses it.
#[derive(Clone)]
pub struct CompiledGrammar(Arc<Compiled>);

impl CompiledGrammar {
    /// A fresh matcher for one sequence. A deep copy: sequences sharing the lexer cache would
    /// serialise on its lock when their masks are computed in parallel.
    pub fn new_matcher(&self) -> super::SeqMatcher {
        let m = &self.0.matcher;
        super::SeqMatcher::new(
            if self.0.size_bytes < COPY_BELOW_BYTES {
                m.deep_clone()
            } else {
                m.clone()
            },
            self.0.eos.clone(),
            self.0.mask_words,
        )
    }

    pub fn mask_words(&self) -> usize {
        self.0.mask_words
    }

    /// Estimated memory it holds (bytes): what a cache of compiled grammars should count.
    pub fn size_bytes(&self) -> usize {
        self.0.size_bytes
    }
}

impl fmt::Debug for CompiledGrammar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CompiledGrammar({:p})", Arc::as_ptr(&self.0))
    }
}

/// The same compiled grammar (not merely an equal one).
impl PartialEq for CompiledGrammar {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

#[cfg(test)]
impl GrammarCompiler {
    /// `compile_checked`'s work on the calling thread (to measure the stack it needs); the
    /// size estimate on success.
    pub(crate) fn build_here(&self, text: &str) -> Result<usize, CompileError> {
        let grammar = TopLevelGrammar::from_lark_or_grammar_list(text).map_err(grammar_error)?;
        shape::check(&grammar, &self.shape).map_err(CompileError::Grammar)?;
        build(&self.factory, grammar, &Stop::default())
            .map(|(_, lexer)| size_estimate(lexer, text.len()))
            .map_err(grammar_error)
    }
}

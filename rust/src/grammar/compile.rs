//! Grammar text -> a compiled grammar, bounded in size, work and wall-clock time.

use std::fmt;
use std::sync::{mpsc, Arc};
use std::time::Duration;

use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::{Matcher, ParserFactory};

use super::vocab::Vocab;
use crate::error::{CoreError, CoreResult};

/// Longest error message kept: llguidance can quote large parts of a grammar.
const MAX_ERROR_LEN: usize = 600;

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
        }
    }
}

/// Compiles grammars for one tokenizer. Cheap to share: clones share the token trie.
#[derive(Clone)]
pub struct GrammarCompiler {
    factory: Arc<ParserFactory>,
    vocab: Vocab,
    timeout: Duration,
}

impl GrammarCompiler {
    /// Builds llguidance's per-tokenizer tables (the token trie and its slices): once per
    /// tokenizer, it takes a while on large vocabularies.
    pub fn new(vocab: Vocab, limits: GrammarLimits) -> CoreResult<Self> {
        if limits.timeout.is_zero() {
            return Err(CoreError::invalid("timeout", "must be > 0"));
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
        })
    }

    pub fn vocab(&self) -> &Vocab {
        &self.vocab
    }

    /// Compile llguidance's grammar text: a TopLevelGrammar JSON object (`{"grammars":
    /// [{"json_schema": ...}]}`, `{"lark_grammar": ...}`, ...) or a bare Lark grammar.
    ///
    /// The work runs on its own thread so that the wall-clock bound holds whatever the
    /// grammar: past it the call fails, and the abandoned compilation still ends within
    /// llguidance's fuel limits. The first token mask is computed here too, so a grammar
    /// that allows nothing fails now rather than mid-generation.
    pub fn compile(&self, text: &str) -> CoreResult<CompiledGrammar> {
        let grammar = TopLevelGrammar::from_lark_or_grammar_list(text).map_err(grammar_error)?;
        let factory = self.factory.clone();
        let (tx, rx) = mpsc::sync_channel(1);
        std::thread::Builder::new()
            .name("ironlm-grammar".into())
            .spawn(move || {
                let built = factory.create_parser(grammar).and_then(|parser| {
                    let mut m = Matcher::new(Ok(parser));
                    m.compute_mask()?;
                    Ok(m)
                });
                let _ = tx.send(built);
            })
            .map_err(|e| CoreError::InvalidState(format!("cannot start a thread: {e}")))?;
        let matcher = match rx.recv_timeout(self.timeout) {
            Ok(r) => r.map_err(grammar_error)?,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                return Err(CoreError::Grammar(format!(
                    "the grammar took longer than {:.1} s to compile",
                    self.timeout.as_secs_f64()
                )))
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return Err(CoreError::Grammar("the grammar compiler failed".into()))
            }
        };
        Ok(CompiledGrammar(Arc::new(Compiled {
            matcher,
            eos: self.vocab.eos.clone(),
            mask_words: self.vocab.mask_words(),
        })))
    }
}

fn grammar_error(e: impl fmt::Display) -> CoreError {
    let mut msg = e.to_string();
    if msg.len() > MAX_ERROR_LEN {
        let mut cut = MAX_ERROR_LEN;
        while !msg.is_char_boundary(cut) {
            cut -= 1;
        }
        msg.truncate(cut);
        msg.push_str("...");
    }
    CoreError::Grammar(format!("invalid grammar: {msg}"))
}

struct Compiled {
    /// In its start state, first mask computed: each sequence starts from a copy.
    matcher: Matcher,
    eos: Arc<[u32]>,
    mask_words: usize,
}

/// A compiled grammar, shared by every request that uses it.
#[derive(Clone)]
pub struct CompiledGrammar(Arc<Compiled>);

impl CompiledGrammar {
    /// A fresh matcher for one sequence. A deep copy: sequences sharing the lexer cache would
    /// serialise on its lock when their masks are computed in parallel.
    pub fn new_matcher(&self) -> super::SeqMatcher {
        super::SeqMatcher::new(
            self.0.matcher.deep_clone(),
            self.0.eos.clone(),
            self.0.mask_words,
        )
    }

    pub fn mask_words(&self) -> usize {
        self.0.mask_words
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

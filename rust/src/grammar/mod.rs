//! Structured outputs: grammar-constrained decoding on llguidance.
//!
//! One `GrammarCompiler` per tokenizer holds the token trie (built once from the vocabulary's
//! bytes); it compiles grammar text into a `CompiledGrammar` shared by every request that uses
//! it. Each constrained sequence owns a `SeqMatcher`; the scheduler starts the step's mask
//! computation when it plans the step and the sampler's `take_bitmask` joins it, so the work
//! overlaps the model forward.
//!
//! Bitmask layout (the xgrammar / vLLM convention): one row per *constrained* sample row,
//! `ceil(vocab_size / 32)` 32-bit words, bit `t % 32` of word `t / 32` set when token `t` is
//! allowed. Unconstrained rows get no row at all: `mask_rows` says which sample row each mask
//! row belongs to, so a batch without constraints costs nothing.
//!
//! Speculation: a constrained sequence's proposal is cut where the grammar rejects it
//! (`SeqMatcher::allowed_prefix`), and each of its verification rows gets the mask of the state
//! after the proposals before it (`MaskUnit`: the worker advances the matcher through the
//! proposal and rolls it back); `update` then advances it by the tokens actually accepted.

mod compile;
mod masks;
mod shape;
mod vocab;

pub use compile::{CompileError, CompiledGrammar, GrammarCompiler, GrammarLimits};
pub(crate) use masks::compute;
pub use masks::{apply_bitmask, MaskJob, MaskUnit, SeqMatcher, TokenBitmask};
pub use shape::ShapeLimits;
pub use vocab::Vocab;

#[cfg(test)]
mod tests;

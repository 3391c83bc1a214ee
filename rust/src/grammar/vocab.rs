//! The tokenizer bridge: llguidance's token trie from the vocabulary bytes Python hands over.

use std::sync::Arc;

use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};

use crate::error::{CoreError, CoreResult};

/// A tokenizer as the grammar engine sees it: token id -> bytes over the model's whole vocab
/// (the logits width), special tokens marked, the EOS ids.
#[derive(Clone)]
pub struct Vocab {
    pub(crate) env: TokEnv,
    pub(crate) eos: Arc<[u32]>,
}

impl Vocab {
    /// `tokens[id]` is the token's bytes, `None` for ids with no text. Ids from `tokens.len()`
    /// up to `vocab_size` (padding rows of the LM head) have none either: tokens without bytes
    /// are never allowed by a mask, except the EOS ids once a grammar accepts.
    pub fn new(
        tokens: &[Option<Vec<u8>>],
        special_token_ids: &[u32],
        eos_token_ids: &[u32],
        vocab_size: usize,
    ) -> CoreResult<Self> {
        if vocab_size == 0 || vocab_size >= u32::MAX as usize {
            return Err(CoreError::invalid("vocab_size", "must be in 1..2^32-1"));
        }
        if tokens.len() > vocab_size {
            return Err(CoreError::invalid(
                "vocab_size",
                format!(
                    "the tokenizer has {} tokens, more than vocab_size ({vocab_size})",
                    tokens.len()
                ),
            ));
        }
        if eos_token_ids.is_empty() {
            return Err(CoreError::invalid("eos_token_ids", "must not be empty"));
        }
        let in_range =
            |name: &'static str, ids: &[u32]| match ids.iter().find(|&&t| t as usize >= vocab_size)
            {
                Some(t) => Err(CoreError::invalid(
                    name,
                    format!("token id {t} out of range (vocab_size {vocab_size})"),
                )),
                None => Ok(()),
            };
        in_range("eos_token_ids", eos_token_ids)?;
        in_range("special_token_ids", special_token_ids)?;
        let mut special = vec![false; vocab_size];
        for &t in special_token_ids {
            special[t as usize] = true;
        }
        let words: Vec<Vec<u8>> = (0..vocab_size)
            .map(|id| match tokens.get(id).and_then(Option::as_deref) {
                // llguidance's convention: a leading 0xFF marks a special token, which only
                // a grammar naming it (`<|...|>` in Lark) can produce, never free text.
                Some(b) if special[id] && !b.is_empty() => {
                    let mut w = Vec::with_capacity(b.len() + 1);
                    w.push(TokTrie::SPECIAL_TOKEN_MARKER);
                    w.extend_from_slice(b);
                    w
                }
                Some(b) if !special[id] => b.to_vec(),
                _ => Vec::new(),
            })
            .collect();
        let info = TokRxInfo::new(vocab_size as u32, eos_token_ids[0]);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(eos_token_ids);
        Ok(Self {
            env: Arc::new(ApproximateTokEnv::new(trie)),
            eos: eos_token_ids.into(),
        })
    }

    /// The logits width the masks cover.
    pub fn vocab_size(&self) -> usize {
        self.env.tok_trie().vocab_size()
    }

    /// 32-bit words per mask row.
    pub fn mask_words(&self) -> usize {
        self.vocab_size().div_ceil(32)
    }
}

//! Incremental detokenization: text deltas as tokens arrive, never splitting a UTF-8
//! character (a byte-level BPE token can end in the middle of one, which decodes to U+FFFD
//! until the rest arrives).
//!
//! The delta of a new token is the decoded text of a window of recent tokens minus the decoded
//! text of the same window without it. The window starts a few tokens back (`prefix`), so
//! tokenizers whose decoding of a token depends on its neighbour (leading-space rules) render
//! it as in the whole text; text ending in U+FFFD is held back until it completes.

use crate::tokenizer::{Tokenizer, TokenizerError};

/// Most tokens a character can be split over (4 bytes, one byte per token at worst).
const MAX_CHAR_TOKENS: usize = 4;

/// Turns a stream of token ids into text deltas.
#[derive(Debug, Clone, Default)]
pub struct IncrementalDecoder {
    ids: Vec<u32>,
    /// Start of the decoding window.
    prefix: usize,
    /// Tokens whose text has been emitted.
    read: usize,
    skip_special: bool,
}

impl IncrementalDecoder {
    /// A decoder; `skip_special` drops special tokens from the text.
    pub fn new(skip_special: bool) -> IncrementalDecoder {
        IncrementalDecoder {
            skip_special,
            ..IncrementalDecoder::default()
        }
    }

    /// Adds `id`; returns the text it completes (empty while a character is incomplete).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String, TokenizerError> {
        self.ids.push(id);
        let before = tok.decode(&self.ids[self.prefix..self.read], self.skip_special)?;
        let after = tok.decode(&self.ids[self.prefix..], self.skip_special)?;
        // A UTF-8 character spans at most 4 bytes, so at most 4 byte tokens; text that still
        // ends in U+FFFD after more is invalid, not incomplete: emit it (the replacement
        // character included) rather than hold back, and re-decode, a growing window.
        let pending = self.ids.len() - self.read;
        if (after.ends_with('\u{FFFD}') && pending < MAX_CHAR_TOKENS) || after.len() < before.len()
        {
            return Ok(String::new());
        }
        // `before` is a prefix of `after` for byte-level BPE; fall back to a char-boundary
        // safe split if a tokenizer ever rewrites earlier text.
        let delta = match after.strip_prefix(before.as_str()) {
            Some(d) => d.to_string(),
            None => after
                .char_indices()
                .find(|&(i, _)| i >= before.len())
                .map_or(String::new(), |(i, _)| after[i..].to_string()),
        };
        self.prefix = self.read;
        self.read = self.ids.len();
        Ok(delta)
    }

    /// Text held back at the end (an incomplete character), decoded as is.
    pub fn finish(&mut self, tok: &Tokenizer) -> Result<String, TokenizerError> {
        if self.read == self.ids.len() {
            return Ok(String::new());
        }
        let before = tok.decode(&self.ids[self.prefix..self.read], self.skip_special)?;
        let after = tok.decode(&self.ids[self.prefix..], self.skip_special)?;
        self.read = self.ids.len();
        Ok(after
            .get(before.len()..)
            .map(str::to_string)
            .unwrap_or_default())
    }
}

//! Incremental detokenization: text deltas as tokens arrive, never splitting a UTF-8
//! character (a byte-level BPE token can end in the middle of one, which decodes to U+FFFD
//! until the rest arrives).
//!
//! The delta of a new token is the decoded text of a window of recent tokens minus the decoded
//! text of the same window without it. The window starts a few tokens back (`prefix`), so
//! tokenizers whose decoding of a token depends on its neighbour (leading-space rules) render
//! it as in the whole text; text ending in U+FFFD is held back until it completes, and where
//! it does not after a character's worth of tokens, the text before that last U+FFFD is
//! emitted and the tokens from its start stay pending, so the emitted text is always a prefix
//! of the whole text's.

use crate::tokenizer::{Tokenizer, TokenizerError};

/// Most tokens a character can be split over (4 bytes, one byte per token at worst).
const MAX_CHAR_TOKENS: usize = 4;

/// Most tokens held back behind a final U+FFFD that no token boundary separates from the text
/// before it; past this the text is emitted as it decodes.
const HOLD_LIMIT: usize = 4 * MAX_CHAR_TOKENS;

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
        // Text ending in U+FFFD after that many tokens: what precedes its last character is
        // final (bytes that are invalid stay invalid whatever follows), but the last U+FFFD may
        // be a character whose first bytes came with the last tokens and whose rest is still
        // to come. Emit up to the latest token boundary before it and keep the tokens after
        // pending; emitting the U+FFFD would make the emitted text differ from the whole
        // text's once the character completes (and lose what follows it).
        let end = if after.ends_with('\u{FFFD}') {
            self.stable_end(tok, &before, &after)?
        } else {
            None
        };
        let (upto, text) = match end {
            Some((r, text)) => (r, text),
            // No boundary there (a token holding the end of one character and the start of
            // the next): hold a while longer, then emit all, bounding the window's growth.
            None if after.ends_with('\u{FFFD}') && pending < HOLD_LIMIT => {
                return Ok(String::new());
            }
            None => (self.ids.len(), after),
        };
        // `before` is a prefix of `text` for byte-level BPE; fall back to a char-boundary
        // safe split if a tokenizer ever rewrites earlier text.
        let delta = match text.strip_prefix(before.as_str()) {
            Some(d) => d.to_string(),
            None => text
                .char_indices()
                .find(|&(i, _)| i >= before.len())
                .map_or(String::new(), |(i, _)| text[i..].to_string()),
        };
        self.prefix = self.read;
        self.read = upto;
        Ok(delta)
    }

    /// The latest token boundary `r` (a pending token before it, at least one after it) whose
    /// window text is a prefix of `after` stopping before its last character, and that text;
    /// `None` when no boundary gives one (a token holding the end of one character and the
    /// start of the next).
    /// At most `MAX_CHAR_TOKENS - 1` boundaries are tried: a character's incomplete start is
    /// at most 3 bytes, so it begins within the last 3 tokens.
    fn stable_end(
        &self,
        tok: &Tokenizer,
        before: &str,
        after: &str,
    ) -> Result<Option<(usize, String)>, TokenizerError> {
        let len = self.ids.len();
        let lowest = (self.read + 1).max(len.saturating_sub(MAX_CHAR_TOKENS - 1));
        for r in (lowest..len).rev() {
            let text = tok.decode(&self.ids[self.prefix..r], self.skip_special)?;
            if text.len() >= before.len() && text.len() < after.len() && after.starts_with(&text) {
                return Ok(Some((r, text)));
            }
        }
        Ok(None)
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

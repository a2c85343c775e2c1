//! Incremental detokenization: text deltas as tokens arrive, never splitting a UTF-8
//! character (a byte-level BPE token can end in the middle of one, which decodes to U+FFFD
//! until the rest arrives).
//!
//! The text of a new token is the decoded text of a window of recent tokens past what was
//! already emitted of it. The window starts a few tokens back (`prefix`), so tokenizers whose
//! decoding of a token depends on its neighbour (leading-space rules) render it as in the
//! whole text. Text ending in U+FFFD is held back while a character's worth of tokens could
//! still complete it; after that, everything before the last character is final (bytes that
//! are invalid stay invalid whatever follows) and is emitted, while the last U+FFFD, which may
//! be the start of a character still arriving, waits. So for byte-level tokenizers the emitted
//! text is a prefix of the whole text's decoding — unless more than `WINDOW_LIMIT` tokens
//! that each end one character and start the next pass while one stays unfinished.

use crate::tokenizer::{Tokenizer, TokenizerError};

/// Most tokens a character can be split over (4 bytes, one byte per token at worst).
const MAX_CHAR_TOKENS: usize = 4;

/// Most tokens the window holds past its last token boundary where everything was emitted,
/// before the window moves anyway, its held-back text emitted as it decodes: a bound on the
/// decoding work per token. Reached only where a character stays unfinished that long, which
/// takes over a thousand tokens that each end one character and start the next (tokens that
/// add no text are kept out of the window). Then the unfinished character goes out as U+FFFD,
/// and if it completes later its rest is lost.
const WINDOW_LIMIT: usize = 1024;

/// The UTF-8 length of U+FFFD.
const REPLACEMENT_LEN: usize = '\u{FFFD}'.len_utf8();

/// Turns a stream of token ids into text deltas.
#[derive(Debug, Clone, Default)]
pub struct IncrementalDecoder {
    ids: Vec<u32>,
    /// Start of the decoding window.
    prefix: usize,
    /// Tokens whose whole text has been emitted.
    read: usize,
    /// Bytes emitted past the text of `ids[prefix..read]`: the final part of text whose
    /// tokens are still pending (they end in the middle of a character).
    extra: usize,
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
        // A token the decoding leaves out changes no text: kept out of the window, so a run of
        // them cannot hold a character open.
        if tok.decodes_to_nothing(id, self.skip_special) {
            return Ok(String::new());
        }
        self.ids.push(id);
        let before = tok.decode(&self.ids[self.prefix..self.read], self.skip_special)?;
        let after = tok.decode(&self.ids[self.prefix..], self.skip_special)?;
        let shown = before.len() + self.extra;
        let pending = self.ids.len() - self.read;
        let unfinished = after.ends_with('\u{FFFD}');
        if (unfinished && pending < MAX_CHAR_TOKENS) || after.len() < shown {
            return Ok(String::new());
        }
        if !unfinished {
            let delta = tail(&after, shown);
            self.advance(self.ids.len());
            return Ok(delta);
        }
        // A final U+FFFD after a character's worth of tokens: emit up to the latest token
        // boundary before it if there is one (the window moves on), else up to the last
        // character, counting the bytes shown past the boundary.
        if let Some((r, text)) = self.stable_end(tok, shown, &after)? {
            let delta = tail(&text, shown);
            self.advance(r);
            return Ok(delta);
        }
        if pending > WINDOW_LIMIT {
            let delta = tail(&after, shown);
            self.advance(self.ids.len());
            return Ok(delta);
        }
        let end = after.len() - REPLACEMENT_LEN;
        if end <= shown || !after.is_char_boundary(shown) {
            return Ok(String::new());
        }
        self.extra += end - shown;
        Ok(after[shown..end].to_string())
    }

    /// Moves the window on once the text of every token before `read` is emitted: the window
    /// keeps the last emitted group as context for the next.
    fn advance(&mut self, read: usize) {
        self.prefix = self.read;
        self.read = read;
        self.extra = 0;
    }

    /// The latest token boundary `r` (a pending token before it, at least one after it) whose
    /// window text is a prefix of `after` at least `shown` long that leaves out `after`'s last
    /// character (every character before it is final), and that text; `None` when no boundary
    /// gives one (a token holding the end of one character and the start of the next). At
    /// most `MAX_CHAR_TOKENS - 1` boundaries are tried: a character's incomplete start is at
    /// most 3 bytes, so it begins within the last 3 tokens.
    fn stable_end(
        &self,
        tok: &Tokenizer,
        shown: usize,
        after: &str,
    ) -> Result<Option<(usize, String)>, TokenizerError> {
        let len = self.ids.len();
        let lowest = (self.read + 1).max(len.saturating_sub(MAX_CHAR_TOKENS - 1));
        for r in (lowest..len).rev() {
            let text = tok.decode(&self.ids[self.prefix..r], self.skip_special)?;
            if text.len() >= shown && text.len() < after.len() && after.starts_with(&text) {
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
        let delta = tail(&after, before.len() + self.extra);
        self.advance(self.ids.len());
        Ok(delta)
    }
}

/// `text` past its first `shown` bytes. `shown` falls on a character boundary where the text
/// shown so far is a prefix of `text` (byte-level BPE); should a tokenizer ever rewrite
/// earlier text, from the next character boundary on.
fn tail(text: &str, shown: usize) -> String {
    text.char_indices()
        .find(|&(i, _)| i >= shown)
        .map_or(String::new(), |(i, _)| text[i..].to_string())
}

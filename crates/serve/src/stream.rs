//! A request's text as its tokens arrive: incremental detokenization plus stop strings, applied
//! while the request runs so that it ends at the token that completes one.
//!
//! Text is emitted as soon as it cannot be part of a stop string: the longest suffix of the
//! pending text that is a proper prefix of some stop string is held back until the next token
//! settles it. A stop string that starts in text already emitted would have been held back when
//! its first character arrived, so every match lies inside the pending text. The text never
//! includes the stop string (OpenAI's semantics); the ids end with the token that completed it.

use crate::detok::IncrementalDecoder;
use crate::tokenizer::{Tokenizer, TokenizerError};

/// What one token added.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TextDelta {
    /// Text safe to show now (may be empty while a character or a possible stop string is
    /// incomplete).
    pub text: String,
    /// A stop string was completed: the request must end here.
    pub stopped: bool,
}

/// The text of one request, token by token.
#[derive(Clone, Debug)]
pub struct TextStream {
    decoder: IncrementalDecoder,
    stop: Vec<String>,
    /// Decoded text not yet emitted (a possible start of a stop string).
    pending: String,
    ids: Vec<u32>,
    text: String,
    stopped: bool,
}

impl TextStream {
    /// A stream ending at any of `stop` (empty strings are refused by the callers).
    pub fn new(stop: Vec<String>) -> TextStream {
        TextStream {
            decoder: IncrementalDecoder::new(true),
            stop,
            pending: String::new(),
            ids: Vec::new(),
            text: String::new(),
            stopped: false,
        }
    }

    /// Adds token `id`. After a delta with `stopped`, further tokens are ignored.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<TextDelta, TokenizerError> {
        if self.stopped {
            return Ok(TextDelta::default());
        }
        self.ids.push(id);
        let piece = self.decoder.push(tok, id)?;
        self.pending.push_str(&piece);
        if let Some(d) = self.cut_at_stop() {
            return Ok(d);
        }
        let hold = self.held_back();
        let cut = self.pending.len() - hold;
        let text: String = self.pending.drain(..cut).collect();
        self.text.push_str(&text);
        Ok(TextDelta {
            text,
            stopped: false,
        })
    }

    /// Where `pending` holds a stop string: the text before the earliest one, emitted, and the
    /// stream stopped.
    fn cut_at_stop(&mut self) -> Option<TextDelta> {
        let at = self
            .stop
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min()?;
        let text = self.pending[..at].to_string();
        self.pending.clear();
        self.text.push_str(&text);
        self.stopped = true;
        Some(TextDelta {
            text,
            stopped: true,
        })
    }

    /// Bytes at the end of `pending` that could begin a stop string (on a char boundary).
    fn held_back(&self) -> usize {
        let p = &self.pending;
        let mut most = 0;
        for s in &self.stop {
            // Longest proper prefix of `s` that `p` ends with.
            let mut n = s.len().saturating_sub(1).min(p.len());
            while n > most {
                if s.is_char_boundary(n) && p.is_char_boundary(p.len() - n) && p.ends_with(&s[..n])
                {
                    most = n;
                    break;
                }
                n -= 1;
            }
        }
        most
    }

    /// Ends the stream (EOS or length): the text held back. The decoder's own held-back tail
    /// (the text of tokens ending in an unfinished character, decoded lossily now) can complete
    /// a stop string: then the text ends before it and the delta says `stopped`, as if a
    /// further token had completed it.
    pub fn finish(&mut self, tok: &Tokenizer) -> Result<TextDelta, TokenizerError> {
        if self.stopped {
            return Ok(TextDelta::default());
        }
        let tail = self.decoder.finish(tok)?;
        self.pending.push_str(&tail);
        if let Some(d) = self.cut_at_stop() {
            return Ok(d);
        }
        let text = std::mem::take(&mut self.pending);
        self.text.push_str(&text);
        Ok(TextDelta {
            text,
            stopped: false,
        })
    }

    /// Whether a stop string ended the stream.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// The ids pushed (through the one that completed a stop string).
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// The text emitted so far.
    pub fn text(&self) -> &str {
        &self.text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(text: &str, stop: &[&str]) -> (String, Vec<String>, bool, usize, usize) {
        let tok = Tokenizer::qwen3().unwrap();
        let ids = tok.encode(text).unwrap();
        let mut s = TextStream::new(stop.iter().map(|s| s.to_string()).collect());
        let mut deltas = Vec::new();
        for &id in &ids {
            let d = s.push(&tok, id).unwrap();
            deltas.push(d.text);
            if d.stopped {
                break;
            }
        }
        deltas.push(s.finish(&tok).unwrap().text);
        (
            s.text().to_string(),
            deltas,
            s.stopped(),
            s.ids().len(),
            ids.len(),
        )
    }

    #[test]
    fn without_stop_strings_the_text_is_the_decoded_ids() {
        let text = "Hello, world — café 北京 🎉 done.";
        let (out, deltas, stopped, _, _) = run(text, &[]);
        assert_eq!(out, text);
        assert_eq!(deltas.concat(), text);
        assert!(!stopped);
    }

    #[test]
    fn a_stop_string_ends_the_text_before_it_and_the_ids_at_the_token_completing_it() {
        let text = "one two three STOP four five";
        let (out, deltas, stopped, used, all) = run(text, &["STOP"]);
        assert_eq!(out, "one two three ");
        assert_eq!(deltas.concat(), out);
        assert!(stopped);
        assert!(
            used < all,
            "the tokens after the stop string were not pushed"
        );
        // The ids pushed decode to text that contains the stop string, one id fewer does not.
        let tok = Tokenizer::qwen3().unwrap();
        let ids = tok.encode(text).unwrap();
        assert!(tok.decode(&ids[..used], true).unwrap().contains("STOP"));
        assert!(!tok.decode(&ids[..used - 1], true).unwrap().contains("STOP"));
    }

    #[test]
    fn a_possible_stop_string_is_held_back_until_settled() {
        let tok = Tokenizer::qwen3().unwrap();
        // "ab" then "c": with stop "abd", "ab" is held back, then released with "c".
        let mut s = TextStream::new(vec!["xyz".into(), "abd".into()]);
        let mut shown = String::new();
        for id in tok.encode("hello ab").unwrap() {
            shown.push_str(&s.push(&tok, id).unwrap().text);
        }
        assert_eq!(
            shown, "hello ",
            "the possible start of a stop string is held back"
        );
        for id in tok.encode("c").unwrap() {
            shown.push_str(&s.push(&tok, id).unwrap().text);
        }
        assert_eq!(shown, "hello abc");
        assert!(!s.stopped());
    }

    #[test]
    fn the_earliest_of_several_stop_strings_wins_and_multibyte_stops_work() {
        let (out, _, stopped, _, _) = run("alpha 北京 beta gamma", &["gamma", "京"]);
        assert_eq!(out, "alpha 北");
        assert!(stopped);
        let (out, _, _, _, _) = run("xx END yy", &["yy", "END"]);
        assert_eq!(out, "xx ");
    }

    /// The decoder holds back the text of tokens that end inside a character; at the end it
    /// decodes them lossily (U+FFFD), and that text can complete a stop string: the text then
    /// ends before it, stopped, as when a further token completes one (it used to be emitted
    /// whole, stop string included).
    #[test]
    fn a_stop_string_completed_by_the_decoders_tail_ends_the_text() {
        let tok = Tokenizer::qwen3().unwrap();
        // A character the tokenizer splits over several tokens: its first token alone ends
        // inside the character.
        let split = ["🎉", "𝔘", "🦀", "龘"]
            .into_iter()
            .map(|c| tok.encode(c).unwrap())
            .find(|ids| ids.len() > 1)
            .expect("a character split over tokens");
        let mut ids = tok.encode("ok then").unwrap();
        ids.push(split[0]);
        for (stop, text, stopped) in [
            ("\u{FFFD}", "ok then", true),
            ("n\u{FFFD}", "ok the", true),
            ("then!", "ok then\u{FFFD}", false),
        ] {
            let mut s = TextStream::new(vec![stop.to_string()]);
            let mut shown = String::new();
            for &id in &ids {
                let d = s.push(&tok, id).unwrap();
                assert!(!d.stopped);
                shown.push_str(&d.text);
            }
            let end = s.finish(&tok).unwrap();
            shown.push_str(&end.text);
            assert_eq!((shown.as_str(), end.stopped), (text, stopped), "{stop:?}");
            assert_eq!((s.text(), s.stopped()), (text, stopped));
            assert_eq!(s.ids(), &ids[..]);
            if stopped {
                // Stopped: a further token adds nothing.
                assert_eq!(s.push(&tok, ids[0]).unwrap(), TextDelta::default());
            }
        }
    }

    #[test]
    fn text_held_back_at_the_end_is_flushed_by_finish() {
        let (out, deltas, stopped, _, _) = run("the end is ST", &["STOP"]);
        assert_eq!(out, "the end is ST");
        assert_eq!(deltas.last().map(String::as_str), Some("ST"));
        assert!(!stopped);
    }
}

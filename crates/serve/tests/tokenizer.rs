//! The embedded Qwen3 tokenizer against the Python `tokenizers` package and `transformers`'
//! chat template rendering (recorded once by `tools/qwen3_tokenizer_reference.py`), and the
//! incremental decoder against whole-text decoding.

use proptest::prelude::*;
use serde_json::Value;
use simpler_serve::{ChatMessage, IncrementalDecoder, TextStream, Tokenizer};

fn reference() -> Value {
    let p = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/qwen3_tokenizer_reference.json"
    );
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn ids_match_the_python_tokenizers_package() {
    let tok = Tokenizer::qwen3().unwrap();
    let r = reference();
    assert_eq!(tok.vocab_size() as u64, r["vocab_size"].as_u64().unwrap());
    for case in r["texts"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let want = ids(&case["ids"]);
        assert_eq!(tok.encode(text).unwrap(), want, "{text:?}");
        assert_eq!(
            tok.decode(&want, false).unwrap(),
            case["decoded"].as_str().unwrap(),
            "{text:?}"
        );
        // Round trip.
        assert_eq!(tok.decode(&want, false).unwrap(), text, "{text:?}");
    }
    assert_eq!(tok.eos_token_id(), Some(151_645));
    assert_eq!(tok.token_id("<|endoftext|>"), Some(151_643));
}

#[test]
fn chat_prompts_match_transformers() {
    let tok = Tokenizer::qwen3().unwrap();
    for case in reference()["chats"].as_array().unwrap() {
        let messages: Vec<ChatMessage> = serde_json::from_value(case["messages"].clone()).unwrap();
        let got = tok
            .apply_chat_template(
                &messages,
                case["add_generation_prompt"].as_bool().unwrap(),
                case["enable_thinking"].as_bool(),
            )
            .unwrap();
        assert_eq!(got, case["prompt"].as_str().unwrap(), "{messages:?}");
    }
}

/// Streamed deltas concatenate to the whole text, and no delta holds a broken character, even
/// where a character's bytes are split across tokens (emoji, CJK).
#[test]
fn incremental_decoding_never_splits_a_character() {
    let tok = Tokenizer::qwen3().unwrap();
    for case in reference()["texts"].as_array().unwrap() {
        let want = ids(&case["ids"]);
        let mut d = IncrementalDecoder::new(false);
        let mut text = String::new();
        for &id in &want {
            let delta = d.push(&tok, id).unwrap();
            assert!(!delta.contains('\u{FFFD}'), "{delta:?}");
            text.push_str(&delta);
        }
        text.push_str(&d.finish(&tok).unwrap());
        assert_eq!(text, tok.decode(&want, false).unwrap());
    }
    // A character split over tokens yields nothing until it completes: byte-level tokens of a
    // 4-byte emoji.
    let emoji = tok.encode("🚀").unwrap();
    let mut d = IncrementalDecoder::new(false);
    let deltas: Vec<String> = emoji.iter().map(|&i| d.push(&tok, i).unwrap()).collect();
    assert_eq!(deltas.concat(), "🚀");
    if emoji.len() > 1 {
        assert!(
            deltas[..emoji.len() - 1].iter().all(String::is_empty),
            "{deltas:?}"
        );
    }
}

#[test]
fn ids_past_the_tokenizer_decode_to_nothing_and_missing_files_are_named() {
    let tok = Tokenizer::qwen3().unwrap();
    // The model's vocabulary (151936) pads past the tokenizer's (151669).
    assert_eq!(tok.decode(&[9707, 151_900], false).unwrap(), "Hello");
    let dir = std::env::temp_dir().join(format!("simpler-serve-tok-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let e = Tokenizer::from_dir(&dir).unwrap_err().to_string();
    assert!(e.contains("no tokenizer.json"), "{e}");
    std::fs::write(dir.join("tokenizer.json"), "{not json").unwrap();
    let e = Tokenizer::from_dir(&dir).unwrap_err().to_string();
    assert!(e.contains("tokenizer.json"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A checkpoint's `tokenizer.json` with `truncation` and `padding` blocks: neither cuts nor
/// pads a prompt (they used to cut every prompt, chat templates included, to `max_length`).
#[test]
fn a_files_truncation_and_padding_are_not_applied() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/assets/qwen3");
    let mut json: Value =
        serde_json::from_slice(&std::fs::read(format!("{dir}/tokenizer.json")).unwrap()).unwrap();
    json["truncation"] = serde_json::json!({
        "direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0
    });
    json["padding"] = serde_json::json!({
        "strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": null,
        "pad_id": 151643, "pad_type_id": 0, "pad_token": "<|endoftext|>"
    });
    let cfg = std::fs::read(format!("{dir}/tokenizer_config.json")).unwrap();
    let tok =
        Tokenizer::from_bytes(&serde_json::to_vec(&json).unwrap(), Some(&cfg), "test").unwrap();
    let text = "The quick brown fox jumps over the lazy dog, twice.";
    let plain = Tokenizer::qwen3().unwrap().encode(text).unwrap();
    assert!(plain.len() > 4 && plain.len() < 64, "{}", plain.len());
    assert_eq!(tok.encode(text).unwrap(), plain);
}

/// A plain prompt gets the special tokens `tokenizer.json`'s post-processor adds (here a BOS,
/// as `transformers`' `tokenizer(text)` and vLLM's completions add it); a rendered chat does
/// not (its template wrote its own). Qwen3's files add none: both encodings agree there.
#[test]
fn a_plain_prompt_gets_the_post_processors_bos_and_a_rendered_chat_does_not() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/assets/qwen3");
    let text = "The quick brown fox";
    let qwen3 = Tokenizer::qwen3().unwrap();
    assert_eq!(
        qwen3.encode_prompt(text).unwrap(),
        qwen3.encode(text).unwrap()
    );
    let mut json: Value =
        serde_json::from_slice(&std::fs::read(format!("{dir}/tokenizer.json")).unwrap()).unwrap();
    let bos = serde_json::json!({"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}});
    let seq = |id: &str| serde_json::json!({"Sequence": {"id": id, "type_id": 0}});
    json["post_processor"] = serde_json::json!({
        "type": "TemplateProcessing",
        "single": [bos, seq("A")],
        "pair": [bos, seq("A"), seq("B")],
        "special_tokens": {"<|endoftext|>": {
            "id": "<|endoftext|>", "ids": [151643], "tokens": ["<|endoftext|>"]
        }}
    });
    let cfg = std::fs::read(format!("{dir}/tokenizer_config.json")).unwrap();
    let tok =
        Tokenizer::from_bytes(&serde_json::to_vec(&json).unwrap(), Some(&cfg), "test").unwrap();
    let plain = qwen3.encode(text).unwrap();
    let mut with_bos = vec![151643];
    with_bos.extend_from_slice(&plain);
    assert_eq!(tok.encode_prompt(text).unwrap(), with_bos);
    assert_eq!(tok.encode(text).unwrap(), plain);
    let chat = tok
        .apply_chat_template(&[ChatMessage::new("user", text)], true, None)
        .unwrap();
    assert_eq!(tok.encode(&chat).unwrap(), qwen3.encode(&chat).unwrap());
}

#[test]
fn invalid_bytes_are_emitted_not_held_back_forever() {
    let tok = Tokenizer::qwen3().unwrap();
    // Byte-level BPE writes byte 0x80 (a lone continuation byte, never valid on its own) as
    // the character U+0122.
    let id = tok.token_id("\u{122}").expect("the byte token of 0x80");
    assert_eq!(tok.decode(&[id], false).unwrap(), "\u{FFFD}");
    let mut d = IncrementalDecoder::new(true);
    let mut out = String::new();
    let mut silent = 0;
    for _ in 0..40 {
        let piece = d.push(&tok, id).unwrap();
        if piece.is_empty() {
            silent += 1;
        } else {
            silent = 0;
        }
        assert!(
            silent < 4,
            "held back more than a character's worth of tokens"
        );
        out.push_str(&piece);
    }
    out.push_str(&d.finish(&tok).unwrap());
    assert!(
        out.chars().all(|c| c == '\u{FFFD}') && !out.is_empty(),
        "{out:?}"
    );
}

/// Where a checkpoint keeps its chat template, as `transformers` writes and reads it: a
/// `chat_template.jinja` beside the config wins over the config's string; named templates
/// give the one named `default`; named templates without one load and refuse a chat naming
/// them (as `transformers` fails only when a chat is rendered); malformed entries, or a
/// template of another type, are refused at load naming `chat_template`; no template at all
/// leaves chat refused with the files named.
#[test]
fn the_chat_template_is_found_where_transformers_keeps_it() {
    let assets = concat!(env!("CARGO_MANIFEST_DIR"), "/assets/qwen3");
    let tokenizer_json = std::fs::read(format!("{assets}/tokenizer.json")).unwrap();
    let hi = [ChatMessage::new("user", "hi")];
    let render = |t: &Tokenizer| t.apply_chat_template(&hi, true, None);
    let config = |template: Value| {
        serde_json::json!({"eos_token": "<|im_end|>", "chat_template": template}).to_string()
    };
    let a = "{% for m in messages %}A:{{ m.content }}{% endfor %}";
    let b = "{% for m in messages %}B:{{ m.content }}{% endfor %}";

    let named = config(serde_json::json!([
        {"name": "tool_use", "template": b},
        {"name": "default", "template": a}
    ]));
    let t = Tokenizer::from_bytes(&tokenizer_json, Some(named.as_bytes()), "named").unwrap();
    assert_eq!(render(&t).unwrap(), "A:hi");
    // Named templates without a `default`: the files load (a completion needs no template,
    // and its ids are the same), a chat is refused naming the list.
    let no_default = config(serde_json::json!([
        {"name": "tool_use", "template": b},
        {"name": "rag", "template": a}
    ]));
    let t = Tokenizer::from_bytes(&tokenizer_json, Some(no_default.as_bytes()), "nd").unwrap();
    assert_eq!(
        t.encode("hi").unwrap(),
        Tokenizer::qwen3().unwrap().encode("hi").unwrap()
    );
    let e = render(&t).unwrap_err().to_string();
    assert!(
        e.contains("chat_template") && e.contains("tool_use, rag") && e.contains("`default`"),
        "{e}"
    );
    // After the refusal the tokenizer serves as before, and refuses the same way again.
    assert_eq!(t.decode(&t.encode("hi").unwrap(), false).unwrap(), "hi");
    assert_eq!(render(&t).unwrap_err().to_string(), e);
    for bad in [
        serde_json::json!([{"name": "tool_use", "template": b}, {"name": "x"}]),
        serde_json::json!([{"name": "default", "template": 5}]),
        serde_json::json!([{"name": "default", "template": "{% for m in messages %}"}]),
        serde_json::json!(["a"]),
        serde_json::json!("{% for m in messages %}"),
        serde_json::json!(7),
    ] {
        let cfg = config(bad.clone());
        let e = Tokenizer::from_bytes(&tokenizer_json, Some(cfg.as_bytes()), "bad")
            .unwrap_err()
            .to_string();
        assert!(e.contains("chat_template"), "{bad}: {e}");
    }
    let none = serde_json::json!({"eos_token": "<|im_end|>"}).to_string();
    let t = Tokenizer::from_bytes(&tokenizer_json, Some(none.as_bytes()), "none").unwrap();
    let e = render(&t).unwrap_err().to_string();
    assert!(e.contains("chat_template.jinja"), "{e}");

    let dir = std::env::temp_dir().join(format!("simpler-serve-jinja-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("tokenizer.json"), &tokenizer_json).unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), config(Value::from(a))).unwrap();
    assert_eq!(render(&Tokenizer::from_dir(&dir).unwrap()).unwrap(), "A:hi");
    std::fs::write(dir.join("chat_template.jinja"), b).unwrap();
    assert_eq!(render(&Tokenizer::from_dir(&dir).unwrap()).unwrap(), "B:hi");
    // Only the file: the config without a template.
    std::fs::write(dir.join("tokenizer_config.json"), &none).unwrap();
    assert_eq!(render(&Tokenizer::from_dir(&dir).unwrap()).unwrap(), "B:hi");
    std::fs::write(dir.join("chat_template.jinja"), "{% for m in messages %}").unwrap();
    let e = Tokenizer::from_dir(&dir).unwrap_err().to_string();
    assert!(e.contains("chat_template.jinja"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A template that fails only on some conversations (here: a role it does not know, on its
/// third line) fails long after it loaded; the error names the template's file (and the
/// config's key) and the line, wherever the template came from, and the tokenizer renders the
/// next conversation as before.
#[test]
fn a_render_error_names_the_templates_file_and_line() {
    let assets = concat!(env!("CARGO_MANIFEST_DIR"), "/assets/qwen3");
    let tokenizer_json = std::fs::read(format!("{assets}/tokenizer.json")).unwrap();
    let template = "{% for m in messages %}\n{% if m.role == 'user' %}U:{{ m.content }}\n\
                    {% else %}{{ raise_exception('unknown role ' + m.role) }}{% endif %}\n\
                    {% endfor %}";
    let config =
        |t: Value| serde_json::json!({"eos_token": "<|im_end|>", "chat_template": t}).to_string();
    let good = [ChatMessage::new("user", "hi")];
    let bad = [
        ChatMessage::new("user", "hi"),
        ChatMessage::new("robot", "x"),
    ];
    let check = |t: &Tokenizer, origin: &str| {
        let e = t
            .apply_chat_template(&bad, true, None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("unknown role robot") && e.contains(&format!("(in {origin}:3)")),
            "{e}"
        );
        assert_eq!(
            t.apply_chat_template(&good, true, None).unwrap(),
            "\nU:hi\n\n"
        );
    };
    let cfg = config(Value::from(template));
    let t = Tokenizer::from_bytes(&tokenizer_json, Some(cfg.as_bytes()), "s").unwrap();
    check(&t, "tokenizer_config.json `chat_template`");
    let cfg = config(serde_json::json!([{"name": "default", "template": template}]));
    let t = Tokenizer::from_bytes(&tokenizer_json, Some(cfg.as_bytes()), "s").unwrap();
    check(&t, "tokenizer_config.json `chat_template` `default`");

    let dir = std::env::temp_dir().join(format!("simpler-serve-render-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("tokenizer.json"), &tokenizer_json).unwrap();
    std::fs::write(dir.join("chat_template.jinja"), template).unwrap();
    check(&Tokenizer::from_dir(&dir).unwrap(), "chat_template.jinja");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The character byte-level BPE writes byte `b` as: GPT-2's byte-to-character map (printable
/// Latin-1 bytes stand for themselves, the others for 256, 257, ... in byte order).
fn byte_char(b: u8) -> char {
    let printable = |x: u32| (0x21..=0x7E).contains(&x) || (0xA1..=0xAC).contains(&x) || x >= 0xAE;
    let c = if printable(u32::from(b)) {
        u32::from(b)
    } else {
        256 + (0..u32::from(b)).filter(|&x| !printable(x)).count() as u32
    };
    char::from_u32(c).unwrap()
}

/// The token of exactly the bytes `bs`.
fn bytes_token(tok: &Tokenizer, bs: &[u8]) -> u32 {
    let s: String = bs.iter().map(|&b| byte_char(b)).collect();
    tok.token_id(&s)
        .unwrap_or_else(|| panic!("no token for the bytes {bs:x?}"))
}

/// The byte-level BPE token of one byte.
fn byte_token(tok: &Tokenizer, b: u8) -> u32 {
    bytes_token(tok, &[b])
}

/// `ids` streamed through an `IncrementalDecoder` and through a `TextStream`: both
/// concatenations, and whether each emitted text was a prefix of the whole text all along.
fn streamed(tok: &Tokenizer, ids: &[u32]) -> (String, String, bool) {
    let whole = tok.decode(ids, true).unwrap();
    let mut d = IncrementalDecoder::new(true);
    let mut s = TextStream::new(vec![]);
    let (mut a, mut b, mut prefix) = (String::new(), String::new(), true);
    for &id in ids {
        a.push_str(&d.push(tok, id).unwrap());
        b.push_str(&s.push(tok, id).unwrap().text);
        prefix &= whole.starts_with(&a) && whole.starts_with(&b);
    }
    a.push_str(&d.finish(tok).unwrap());
    b.push_str(&s.finish(tok).unwrap().text);
    (a, b, prefix)
}

/// Invalid bytes held back for a character's worth of tokens and then emitted do not take the
/// start of a real character with them: lone continuation bytes before "é" split over two
/// byte tokens, and an invalid 3-byte start (F0 9F 8E) before "中" split over three. Before,
/// the decoder emitted the character's first byte as U+FFFD and lost the rest (and the "a"
/// after "é", so a stop string there was never seen).
#[test]
fn a_character_arriving_after_invalid_bytes_is_not_lost() {
    let tok = Tokenizer::qwen3().unwrap();
    let bytes = |bs: &[u8]| -> Vec<u32> { bs.iter().map(|&b| byte_token(&tok, b)).collect() };
    let mut e_acute = bytes(&[0x80, 0x80, 0x80, 0xC3, 0xA9]);
    e_acute.extend([tok.token_id("a").unwrap(), tok.token_id("b").unwrap()]);
    let cjk = bytes(&[0xF0, 0x9F, 0x8E, 0xE4, 0xB8, 0xAD]);
    for (ids, want) in [
        (&e_acute, "\u{FFFD}\u{FFFD}\u{FFFD}éab"),
        (&cjk, "\u{FFFD}中"),
    ] {
        assert_eq!(tok.decode(ids, true).unwrap(), want);
        let (a, b, prefix) = streamed(&tok, ids);
        assert_eq!((a.as_str(), b.as_str(), prefix), (want, want, true));
    }
    let mut s = TextStream::new(vec!["a".into()]);
    let stopped = e_acute.iter().any(|&id| s.push(&tok, id).unwrap().stopped);
    assert!(stopped, "stop \"a\" not seen in {:?}", s.text());
    assert_eq!(s.text(), "\u{FFFD}\u{FFFD}\u{FFFD}é");
}

/// Tokens that each end one character and start the next (`[A4 ED]` after `[ED 95]`: "핤"
/// is ED 95 A4), so no token boundary falls between characters: every character still
/// streams as it completes, none lost or held to the end.
#[test]
fn tokens_straddling_every_character_boundary_stream_each_character() {
    let tok = Tokenizer::qwen3().unwrap();
    let (ed, b95, a4) = (
        byte_token(&tok, 0xED),
        byte_token(&tok, 0x95),
        byte_token(&tok, 0xA4),
    );
    let straddle = bytes_token(&tok, &[0xA4, 0xED]);
    let mut ids = vec![ed, b95];
    for _ in 0..20 {
        ids.extend([straddle, b95]);
    }
    ids.push(a4);
    let whole = tok.decode(&ids, true).unwrap();
    assert_eq!(whole, "핤".repeat(21));
    let (a, b, prefix) = streamed(&tok, &ids);
    assert_eq!(
        (a.as_str(), b.as_str(), prefix),
        (whole.as_str(), whole.as_str(), true)
    );
    // Each character is emitted within a character's worth of tokens of completing.
    let mut d = IncrementalDecoder::new(true);
    let shown: Vec<usize> = ids
        .iter()
        .map(|&id| d.push(&tok, id).unwrap().chars().count())
        .collect();
    assert!(
        shown[..ids.len() - 1].iter().sum::<usize>() >= 19,
        "{shown:?}"
    );
}

/// Tokens that add no text — special tokens skipped, ids past the vocabulary — do not hold a
/// character open however many come between its bytes (past a thousand of them the decoder
/// used to emit the character as U+FFFD and lose it when it completed).
#[test]
fn tokens_that_add_no_text_do_not_hold_a_character_open() {
    let tok = Tokenizer::qwen3().unwrap();
    let end = tok.token_id("<|im_end|>").unwrap();
    let past = tok.vocab_size() as u32 + 5;
    for (filler, skip) in [(end, true), (past, true), (past, false)] {
        let mut ids = vec![byte_token(&tok, 0xF0)];
        ids.extend(std::iter::repeat_n(filler, 1030));
        ids.extend([0x9F, 0x98, 0x80].map(|b| byte_token(&tok, b)));
        ids.push(tok.token_id("a").unwrap());
        let whole = tok.decode(&ids, skip).unwrap();
        assert_eq!(whole, "😀a");
        let mut d = IncrementalDecoder::new(skip);
        let mut text = String::new();
        for &id in &ids {
            text.push_str(&d.push(&tok, id).unwrap());
            assert!(whole.starts_with(&text), "{text:?}");
        }
        text.push_str(&d.finish(&tok).unwrap());
        assert_eq!(text, whole, "filler {filler}, skip {skip}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    /// Any mix of byte tokens (lead, continuation and never-valid bytes), ASCII and whole
    /// multi-byte tokens streams to exactly the whole text, every emitted text a prefix of it.
    #[test]
    fn streamed_text_is_the_whole_text(picks in prop::collection::vec(0usize..18, 0..40)) {
        static TOK: std::sync::OnceLock<Tokenizer> = std::sync::OnceLock::new();
        let tok = TOK.get_or_init(|| Tokenizer::qwen3().unwrap());
        let words = ["a", " the", "中", "é", "!"];
        // Single bytes (leads, continuations, never-valid), and a token that ends one
        // character and starts the next.
        let bytes: [&[u8]; 13] = [
            &[0x80], &[0xBF], &[0xC3], &[0xA9], &[0xE4], &[0xB8], &[0xAD], &[0xF0], &[0x9F],
            &[0x9A], &[0xFF], &[0xED], &[0xA4, 0xED],
        ];
        let ids: Vec<u32> = picks
            .iter()
            .flat_map(|&p| match bytes.get(p) {
                Some(&bs) => vec![bytes_token(tok, bs)],
                None => tok.encode(words[p - bytes.len()]).unwrap(),
            })
            .collect();
        let whole = tok.decode(&ids, true).unwrap();
        let (a, b, prefix) = streamed(tok, &ids);
        prop_assert_eq!(&a, &whole);
        prop_assert_eq!(&b, &whole);
        prop_assert!(prefix);
    }

    /// The same for any tokens of the vocabulary (its 151,643 BPE tokens: whole words, word
    /// pieces, and pieces of characters that other pieces end), specials among them.
    #[test]
    fn any_tokens_stream_to_the_whole_text(
        ids in prop::collection::vec(prop_oneof![9 => 0u32..151_643, 1 => 151_643u32..151_669], 0..30),
    ) {
        static TOK: std::sync::OnceLock<Tokenizer> = std::sync::OnceLock::new();
        let tok = TOK.get_or_init(|| Tokenizer::qwen3().unwrap());
        let whole = tok.decode(&ids, true).unwrap();
        let (a, b, prefix) = streamed(tok, &ids);
        prop_assert_eq!(&a, &whole);
        prop_assert_eq!(&b, &whole);
        prop_assert!(prefix);
    }
}

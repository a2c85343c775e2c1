"""Records the Python reference for the tokenizer tests: the ids the `tokenizers` package gives
for a fixed list of strings with the Qwen3 tokenizer embedded in crates/serve/assets/qwen3/, and
the prompts `transformers`' apply_chat_template renders for a few conversations.

Usage: python3 tools/qwen3_tokenizer_reference.py   (needs tokenizers, transformers, jinja2)
Writes crates/serve/tests/fixtures/qwen3_tokenizer_reference.json (committed).
"""
import json
import os

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
ASSETS = os.path.join(ROOT, "crates", "serve", "assets", "qwen3")
OUT = os.path.join(ROOT, "crates", "serve", "tests", "fixtures", "qwen3_tokenizer_reference.json")

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n\n\nmany",
    "数字 12345 和中文混合，还有标点。",
    "日本語のテキストとカタカナ、ひらがな",
    "Ünïcödé àccents — em dash – en dash … ellipsis",
    "emoji 🙂🚀👩‍👩‍👧‍👦 flags 🇫🇷",
    "def f(x):\n    return x ** 2  # comment\n",
    "<|im_start|>user\nhi<|im_end|>",
    "<think>\nreasoning\n</think>\n\nanswer",
    "URLs: https://example.invalid/a?b=c&d=e#f",
    "",
    " ",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "Ελληνικά и русский текст",
]

CONVERSATIONS = [
    ([{"role": "user", "content": "What is 2+2?"}], True, None),
    ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}], True, None),
    ([{"role": "user", "content": "Hi"}], True, False),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nHello!"},
      {"role": "user", "content": "And now?"}], True, None),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}], False, None),
]


def main():
    tok = Tokenizer.from_file(os.path.join(ASSETS, "tokenizer.json"))
    texts = [{"text": t, "ids": tok.encode(t, add_special_tokens=False).ids} for t in TEXTS]
    for t in texts:
        t["decoded"] = tok.decode(t["ids"], skip_special_tokens=False)
    hf = PreTrainedTokenizerFast.from_pretrained(ASSETS)
    chats = []
    for messages, add_gen, thinking in CONVERSATIONS:
        kw = {} if thinking is None else {"enable_thinking": thinking}
        prompt = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_gen, **kw)
        chats.append({"messages": messages, "add_generation_prompt": add_gen, "enable_thinking": thinking,
                      "prompt": prompt})
    json.dump({"texts": texts, "chats": chats, "vocab_size": tok.get_vocab_size(with_added_tokens=True)},
              open(OUT, "w"), ensure_ascii=False, indent=1)
    print("wrote", OUT, len(texts), "texts", len(chats), "chats")


if __name__ == "__main__":
    main()

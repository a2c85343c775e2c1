"""Builds the small random Qwen3 checkpoints under crates/models/tests/fixtures/hf/ and records
`transformers`' fp32 logits for a fixed token sequence, as the external reference of the Rust
tests (which run without Python).

Usage: python3 tools/qwen3_hf_reference.py [OUT_DIR]   (needs torch, transformers, safetensors)

Each case is a random Qwen3ForCausalLM whose weights are rounded to bf16 once and saved as the
checkpoint; the reference runs `transformers` in fp32 (eager attention) on exactly those
weights. Norm weights are drawn around 1 (not left at 1), and every case has
`heads * head_dim != hidden`. The cases cover tied and untied embeddings, the config layout
`transformers` 5 writes (`rope_parameters`, `dtype`) and the older one (top-level
`rope_theta` / `rope_scaling`, `torch_dtype`), YaRN and linear RoPE scaling, bf16 and f32
storage, and a sharded checkpoint.

reference.safetensors holds `tokens` (I32 [T]: the prompt, then the greedy continuation
`transformers` chose) and `logits` (F32 [T, vocab]: one causal forward over all T tokens);
`prompt_len` is in its metadata.
"""
import json
import os
import shutil
import sys

import torch
from safetensors.torch import save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "crates", "models", "tests", "fixtures", "hf")
PROMPT_LEN, NEW_TOKENS = 24, 12

SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
             hidden_act="silu", attention_bias=False, use_sliding_window=False, initializer_range=0.1,
             bos_token_id=None, eos_token_id=255)

CASES = {
    # name: (config overrides, layout, storage dtype, shard)
    "tied_v5": (dict(tie_word_embeddings=True, max_position_embeddings=128,
                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
                "v5", torch.bfloat16, False),
    "untied_v4_f32": (dict(tie_word_embeddings=False, max_position_embeddings=128,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
                      "v4", torch.float32, False),
    "yarn_v4_sharded": (dict(tie_word_embeddings=True, max_position_embeddings=64,
                             rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                              "original_max_position_embeddings": 16}),
                        "v4", torch.bfloat16, True),
    "linear_v5": (dict(tie_word_embeddings=False, max_position_embeddings=128,
                       rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
                  "v5", torch.bfloat16, False),
}


def build(name, overrides, layout, dtype, shard, seed):
    torch.manual_seed(seed)
    cfg = Qwen3Config(**SHAPE, **overrides)
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            # Round every weight to bf16 once: the checkpoint and the fp32 reference then hold
            # the same values.
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    d = os.path.join(OUT, name)
    shutil.rmtree(d, ignore_errors=True)
    model.to(dtype).save_pretrained(d, safe_serialization=True, max_shard_size="100KB" if shard else "1GB")
    model.to(torch.float32)
    path = os.path.join(d, "config.json")
    c = json.load(open(path))
    if layout == "v4":
        # The layout transformers 4.x wrote: top-level rope_theta, rope_scaling, torch_dtype.
        rp = c.pop("rope_parameters")
        c["rope_theta"] = rp.pop("rope_theta")
        if rp.get("rope_type", "default") != "default":
            rp["type"] = rp.pop("rope_type")
            c["rope_scaling"] = rp
        c["torch_dtype"] = c.pop("dtype", "bfloat16")
    json.dump(c, open(path, "w"), indent=2, sort_keys=True)
    # Only the generation config's EOS matters to the tests; keep it small and stable.
    json.dump({"eos_token_id": [255, 254]}, open(os.path.join(d, "generation_config.json"), "w"), indent=2)

    g = torch.Generator().manual_seed(seed + 1)
    # Ids below 250 so no EOS appears in the prompt.
    tokens = torch.randint(0, 250, (PROMPT_LEN,), generator=g).tolist()
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(torch.tensor([tokens])).logits[0, -1]
            tokens.append(int(torch.argmax(logits)))
        logits = model(torch.tensor([tokens])).logits[0].contiguous()
    save_file({"tokens": torch.tensor(tokens, dtype=torch.int32), "logits": logits.to(torch.float32)},
              os.path.join(d, "reference.safetensors"),
              metadata={"prompt_len": str(PROMPT_LEN), "transformers": __import__("transformers").__version__,
                        "torch": torch.__version__})
    print(name, "tokens", tokens[PROMPT_LEN:], "files", sorted(os.listdir(d)))


if __name__ == "__main__":
    torch.set_num_threads(1)
    os.makedirs(OUT, exist_ok=True)
    for i, (name, (overrides, layout, dtype, shard)) in enumerate(CASES.items()):
        build(name, overrides, layout, dtype, shard, seed=100 + i)

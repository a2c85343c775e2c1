#!/usr/bin/env python3
"""PyTorch + transformers beside `simpler bench qwen3-decode --platform cuda`.

The same Qwen3 shape (default: Qwen3-14B) with random bf16 weights made on the GPU, the same
(batch, context) shapes, one decode step timed two ways:
  - eager: `model(token, past_key_values=DynamicCache)` after a prefill of context-1 tokens,
    the cache cropped back after every step so each step sees the same context;
  - graph: a StaticCache of exactly `context` slots, the decode step captured once with
    torch.cuda.CUDAGraph and replayed (transformers' static-cache CUDA-graph path).
Each is timed with CUDA events (GPU time) and with the host clock around a synchronised step
(wall time). Every (shape, variant) runs in its own process, so one that fails (an API this
transformers version lacks, a capture that hits a host sync, a device-side assert that
poisons the CUDA context) prints its error and the others still run.

transformers 5.x's StaticCache ignores `cache_position` and appends at a per-layer device
counter (`cumulative_length`) that every update advances, also inside a replayed graph; each
step here first sets that counter back to `context - 1`, so every step (and every replay)
writes the same slot, as a decode step at a fixed context does.

Usage (on the GPU machine): python3 tools/hf_qwen3_decode.py --shapes 1x512,16x3500
"""

import argparse
import inspect
import statistics
import subprocess
import sys
import time

import torch
import transformers
from transformers import Qwen3Config, Qwen3ForCausalLM

PRESETS = {
    # hidden, intermediate, layers, heads, kv heads, head_dim, vocab
    "qwen3-14b": (5120, 17408, 40, 40, 8, 128, 151936),
    "qwen3-0.6b": (1024, 3072, 28, 16, 8, 128, 151936),
}


def make_model(preset):
    h, inter, layers, heads, kv, d, vocab = PRESETS[preset]
    cfg = Qwen3Config(
        hidden_size=h,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=d,
        vocab_size=vocab,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    return cfg, model.eval()


class _Skip(Exception):
    """The variant this process does not run."""


def timed(fn, warmup, rounds):
    """GPU ms (events) and wall ms (synchronised host clock) of each round."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    gpu, wall = [], []
    for _ in range(rounds):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        s.record()
        fn()
        e.record()
        e.synchronize()
        wall.append((time.perf_counter() - t0) * 1e3)
        gpu.append(s.elapsed_time(e))
    return statistics.median(gpu), statistics.median(wall)


def static_cache(cfg, batch, ctx):
    sig = inspect.signature(transformers.StaticCache.__init__).parameters
    kw = {"config": cfg, "max_cache_len": ctx}
    if "max_batch_size" in sig:
        kw["max_batch_size"] = batch
    if "device" in sig:
        kw["device"] = "cuda"
    if "dtype" in sig:
        kw["dtype"] = torch.bfloat16
    return transformers.StaticCache(**kw)


@torch.no_grad()
def bench_shape(cfg, model, batch, ctx, warmup, rounds, variant):
    ids = torch.randint(0, cfg.vocab_size, (batch, ctx), device="cuda")
    prompt, tok = ids[:, : ctx - 1], ids[:, ctx - 1 :]
    results = {}
    # Eager, dynamic cache.
    try:
        if variant != "eager":
            raise _Skip
        out = model(prompt, use_cache=True, logits_to_keep=1)
        cache = out.past_key_values

        def eager():
            model(tok, past_key_values=cache, use_cache=True)
            cache.crop(ctx - 1)

        results["eager"] = timed(eager, warmup, rounds)
        del cache, out
    except _Skip:
        pass
    except Exception as e:  # noqa: BLE001 - report and go on
        results["eager"] = f"failed: {type(e).__name__}: {e}"
    torch.cuda.empty_cache()
    # Static cache, the step captured as a CUDA graph.
    try:
        if variant != "graph":
            raise _Skip
        cache = static_cache(cfg, batch, ctx)
        model(prompt, past_key_values=cache, cache_position=torch.arange(ctx - 1, device="cuda"),
              use_cache=True, logits_to_keep=1)
        pos = torch.tensor([ctx - 1], device="cuda")
        counters = [
            layer.cumulative_length
            for layer in getattr(cache, "layers", [])
            if torch.is_tensor(getattr(layer, "cumulative_length", None))
        ]

        def step():
            for c in counters:
                c.fill_(ctx - 1)
            return model(tok, past_key_values=cache, cache_position=pos, use_cache=True).logits

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        results["graph"] = timed(graph.replay, warmup, rounds)
        del graph, cache
    except _Skip:
        pass
    except Exception as e:  # noqa: BLE001 - report and go on
        results["graph"] = f"failed: {type(e).__name__}: {e}"
    return results[variant]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-14b", choices=sorted(PRESETS))
    ap.add_argument("--shapes", default="1x512,16x3500")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--one", help="internal: run one SHAPE:VARIANT in this process")
    a = ap.parse_args()
    if a.one is None:
        # The driver: each (shape, variant) in a child process.
        failed = 0
        for shape in a.shapes.split(","):
            for variant in ("eager", "graph"):
                cmd = [sys.executable, __file__, "--preset", a.preset, "--warmup", str(a.warmup),
                       "--rounds", str(a.rounds), "--one", f"{shape}:{variant}"]
                rc = subprocess.run(cmd).returncode
                if rc != 0:
                    print(f"hf {shape} {variant}: failed: the process exited with {rc}")
                    failed = 1
        sys.exit(failed)
    if not torch.cuda.is_available():
        sys.exit("hf: no CUDA device visible to PyTorch")
    shape, variant = a.one.split(":")
    print(f"hf: torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.cuda.get_device_name()}")
    t0 = time.perf_counter()
    cfg, model = make_model(a.preset)
    torch.cuda.synchronize()
    print(f"hf: {a.preset} random bf16 weights on the GPU in {time.perf_counter() - t0:.1f} s")
    batch, ctx = (int(x) for x in shape.lower().split("x"))
    r = bench_shape(cfg, model, batch, ctx, a.warmup, a.rounds, variant)
    if isinstance(r, str):
        print(f"hf {batch}x{ctx} {variant}: {r}")
        sys.exit(1)
    print(f"hf {batch}x{ctx} {variant}: {r[0]:.3f} ms/step on the GPU, {r[1]:.3f} ms wall")


if __name__ == "__main__":
    main()

"""Streaming decoding: HKT against multi-head attention with a KV cache, same width.

For each context length T: both causal LMs (same width, layers and heads; HKT with its default
3 levels, stride 2, hybrid head) run a prompt of T tokens with a cache (the prefill), then
decode ``--new-tokens`` tokens one at a time. Reported, as medians with HKT/MHA ratios measured
in the same run (the two models alternate call by call):

* per-token decoding time and tokens/s; HKT twice: its default step (one compiled call per
  layer on the CPU) and the PyTorch step (``use_compiled_step(False)``, the readable
  reference), both against the same MHA model, whose step is PyTorch operations (a key/value
  cache written in place, softmax and two GEMVs: what a PyTorch decoder does);
* cache bytes in use after the prefill (HKT keys at every level + V, against MHA's K + V);
* prefill time against a plain forward pass over the same T tokens (the price of filling it).

Usage::

    python benchmarks/decode.py                      # T = 1k, 4k, 16k (about 5 min on 2 cores)
    python benchmarks/decode.py --seq-lens 256 512 --new-tokens 8 --repeats 1 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time

import torch
from tqdm import tqdm

from structattn.hkt import CausalLM, ModelConfig, use_compiled_step


def build(attention: str, args, max_len: int) -> CausalLM:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=260,
        max_len=max_len,
        d_model=args.d_model,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        attention=attention,
        dropout=0.0,
        hkt=dict(n_levels=args.n_levels, stride=args.stride),
    )
    return CausalLM(cfg).eval()


def timed(fn, *args, **kwargs) -> float:
    t0 = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - t0


@contextlib.contextmanager
def hkt_step(name: str):
    """The HKT decoding step that ``name`` measures: the PyTorch one for ``hkt_torch``, else
    the default (compiled where available)."""
    with use_compiled_step(name != "hkt_torch"):
        yield


@torch.inference_mode()
def measure(models: dict[str, CausalLM], T: int, args) -> dict:
    g = torch.Generator().manual_seed(T)
    prompt = torch.randint(1, 260, (args.batch, T), generator=g)
    steps = torch.randint(1, 260, (args.batch, args.new_tokens), generator=g)
    res = {name: {"step_s": [], "prefill_s": [], "forward_s": []} for name in models}
    for model in models.values():  # warm-up: first calls pay one-time costs
        model(prompt[:, :64], cache=model.new_cache())
    cache_bytes = {}
    for _ in range(args.repeats):
        for name, model in models.items():  # alternate the models, repeat by repeat
            if name != "hkt_torch":  # the same model as "hkt": its forward is timed there
                res[name]["forward_s"].append(timed(model, prompt))
            cache = model.new_cache()
            res[name]["prefill_s"].append(timed(model, prompt, cache=cache))
            cache_bytes[name] = cache.nbytes()
            with hkt_step(name):
                for t in range(args.new_tokens):
                    tok = steps[:, t : t + 1]
                    res[name]["step_s"].append(timed(model, tok, cache=cache))
    row = {"seq_len": T}
    for name, r in res.items():
        step = statistics.median(r["step_s"])
        if name == "hkt_torch":
            row[name] = {"step_ms": 1e3 * step, "tokens_per_s": args.batch / step}
            continue
        row[name] = {
            "step_ms": 1e3 * step,
            "tokens_per_s": args.batch / step,
            "prefill_ms": 1e3 * statistics.median(r["prefill_s"]),
            "forward_ms": 1e3 * statistics.median(r["forward_s"]),
            "cache_bytes": cache_bytes[name],
        }
        row[name]["prefill_over_forward"] = row[name]["prefill_ms"] / row[name]["forward_ms"]
    row["step_ratio"] = row["hkt"]["step_ms"] / row["mha"]["step_ms"]
    row["torch_step_ratio"] = row["hkt_torch"]["step_ms"] / row["mha"]["step_ms"]
    row["cache_ratio"] = row["hkt"]["cache_bytes"] / row["mha"]["cache_bytes"]
    return row


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--new-tokens", type=int, default=32, help="decoded tokens per repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--n-levels", type=int, default=3)
    p.add_argument("--stride", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    max_len = max(args.seq_lens) + args.new_tokens
    hkt = build("hkt", args, max_len)
    models = {"hkt": hkt, "hkt_torch": hkt, "mha": build("mha", args, max_len)}
    rows = [measure(models, T, args) for T in tqdm(args.seq_lens, desc="context", file=sys.stderr)]

    print(
        f"Decoding, batch {args.batch}, width {args.d_model}, {args.n_heads} heads, "
        f"{args.n_layers} layers, HKT L={args.n_levels} s={args.stride}; "
        f"{torch.get_num_threads()} threads; medians of {args.repeats} x {args.new_tokens} steps"
    )
    print()
    print(
        "| T | HKT ms/token | MHA ms/token | HKT/MHA | HKT tokens/s | MHA tokens/s | "
        "HKT PyTorch step ms/token | its /MHA | cache HKT/MHA | prefill/forward HKT | "
        "prefill/forward MHA |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        h, m = r["hkt"], r["mha"]
        print(
            f"| {r['seq_len']} | {h['step_ms']:.2f} | {m['step_ms']:.2f} | "
            f"{r['step_ratio']:.2f}x | {h['tokens_per_s']:.0f} | {m['tokens_per_s']:.0f} | "
            f"{r['hkt_torch']['step_ms']:.2f} | {r['torch_step_ratio']:.2f}x | "
            f"{r['cache_ratio']:.2f}x | {h['prefill_over_forward']:.2f} | "
            f"{m['prefill_over_forward']:.2f} |"
        )
    result = {
        "config": vars(args),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "rows": rows,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()

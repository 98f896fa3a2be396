"""The ``layer`` and ``step`` sections of ``benchmarks/attention.py``: what a user runs.

* ``layer``: :class:`HKTAttention` (``impl="auto"``) against the SDPA multi-head-attention block
  of the same width (:class:`MultiHeadAttention`), forward + backward, alternating call by call.
* ``step``: a full training step (forward, backward, AdamW update) of the paper's ListOps model
  (4 layers, width 128, 4 heads) with HKT attention against its MHA twin.

Each reports medians, the HKT/MHA ratio measured in the same run, peak tensor memory, and where
the time goes: operator self-times grouped into buckets (the attention kernel, GEMMs,
convolutions, copies, norms and activations, other elementwise work, the optimiser, the rest),
the mean of a few profiled calls per model, alternating.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from structattn.hkt import HKTAttention, HKTConfig, ModelConfig, MultiHeadAttention
from structattn.hkt.model import SequenceClassifier
from structattn.utils import TensorMemoryTracker

#: Profile buckets: the first whose substrings match an operator's name takes its self time.
BUCKETS = [
    ("attention kernel", ("_BlockwiseHKT", "scaled_dot_product", "flash_attention")),
    ("optimizer", ("Optimizer.step", "_foreach", "adam")),
    ("GEMM (projections, MLP)", ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear")),
    ("convolutions", ("convolution", "conv2d", "conv1d", "CompiledCausalConv")),
    (
        "copies and layout",
        (
            "aten::copy_",
            "aten::clone",
            "aten::contiguous",
            "aten::cat",
            "aten::stack",
            "aten::constant_pad",
        ),
    ),  # fmt: skip
    ("norms and activations", ("layer_norm", "gelu", "softmax", "log_softmax", "nll_loss")),
    (
        "elementwise and reductions",
        (
            "aten::mul",
            "aten::add",
            "aten::sub",
            "aten::div",
            "aten::lerp",
            "aten::sum",
            "aten::mean",
            "aten::fill_",
            "aten::zero_",
            "aten::masked_fill",
            "aten::where",
            "aten::embedding",
            "aten::sigmoid",
            "aten::exp",
            "aten::repeat_interleave",
            "aten::isfinite",
            "aten::dropout",
            "aten::native_dropout",
            "aten::bernoulli",
            "aten::ones",
            "aten::empty",
            "aten::zeros",
        ),
    ),  # fmt: skip
]


#: Profiled calls per model, averaged for the "where the time goes" tables.
PROFILE_CALLS = 3


def bucket_of(name: str) -> str:
    for bucket, keys in BUCKETS:
        if any(k in name for k in keys):
            return bucket
    return "other"


def profile_buckets(fn: Callable[[], None]) -> dict[str, float]:
    """Self CPU milliseconds per bucket for one call of ``fn``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    out: dict[str, float] = {}
    for evt in prof.key_averages():
        key = bucket_of(evt.key)
        out[key] = out.get(key, 0.0) + evt.self_cpu_time_total / 1e3
    out["total"] = sum(out.values())
    return out


def mean_profiles(
    fns: dict[str, Callable[[], None]], calls: int = PROFILE_CALLS
) -> dict[str, dict[str, float]]:
    """:func:`profile_buckets` of each function averaged over ``calls`` calls, alternating
    between the functions (one call's buckets move by a fifth or more between calls here)."""
    sums: dict[str, dict[str, float]] = {name: {} for name in fns}
    for _ in range(calls):
        for name, fn in fns.items():
            for key, ms in profile_buckets(fn).items():
                sums[name][key] = sums[name].get(key, 0.0) + ms
    return {name: {k: v / calls for k, v in s.items()} for name, s in sums.items()}


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _peak_mib(fn: Callable[[], None]) -> float:
    with TensorMemoryTracker() as mem:
        fn()
    return mem.peak_bytes / 2**20


def _compare(
    make: Callable[[str], Callable[[], None]], repeats: int, desc: str
) -> dict[str, object]:
    """Medians (alternating HKT and MHA call by call), peak memory and profiles of both."""
    fns = {name: make(name) for name in ("hkt", "mha")}
    for fn in fns.values():  # warm-up (builds the kernel, allocator caches)
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in tqdm(range(repeats), desc=desc, unit="round", file=sys.stderr, leave=False):
        for name, fn in fns.items():
            times[name].append(_timed(fn))
    row: dict[str, object] = {}
    profiles = mean_profiles(fns)
    for name, fn in fns.items():
        row[f"{name}_ms"] = 1e3 * statistics.median(times[name])
        row[f"{name}_ms_all"] = [1e3 * t for t in times[name]]
        row[f"{name}_peak_mib"] = _peak_mib(fn)
        row[f"{name}_profile_ms"] = profiles[name]
    row["time_ratio"] = row["hkt_ms"] / row["mha_ms"]
    row["mem_ratio"] = row["hkt_peak_mib"] / row["mha_peak_mib"]
    return row


def _layer_case(T, d_model, heads, levels, batch, repeats, seed) -> dict:
    torch.manual_seed(seed)
    x = torch.randn(batch, T, d_model, requires_grad=True)
    hkt = HKTConfig(d_model=d_model, n_heads=heads, n_levels=levels, causal=True)
    layers = {"hkt": HKTAttention(hkt), "mha": MultiHeadAttention(d_model, heads, causal=True)}

    def make(name):
        layer = layers[name]

        def call():
            x.grad = None
            layer.zero_grad(set_to_none=True)
            layer(x).sum().backward()

        return call

    row = {"T": T, "d_model": d_model, "heads": heads, "head_dim": d_model // heads,
           "levels": levels, "batch": batch}  # fmt: skip
    row.update(_compare(make, repeats, f"layer T={T}"))
    return row


def layer_section(
    seq_lens, d_model: int, heads: int, levels: int, batch: int, repeats: int, seed: int = 0
) -> list[dict]:
    return [_layer_case(T, d_model, heads, levels, batch, repeats, seed) for T in seq_lens]


def listops_model(attention: str, T: int) -> SequenceClassifier:
    """The paper preset's ListOps classifier (configs listops-*.yaml, `paper`)."""
    cfg = ModelConfig(
        vocab_size=16,
        num_classes=10,
        max_len=T,
        d_model=128,
        n_layers=4,
        n_heads=4,
        mlp_ratio=2,
        attention=attention,
        causal=False,
        pooling="mean",
        dropout=0.1,
    )
    return SequenceClassifier(cfg)


def _step_case(T, batch, repeats, seed) -> dict:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 16, (batch, T), generator=g)
    mask = torch.ones(batch, T, dtype=torch.bool)
    labels = torch.randint(0, 10, (batch,), generator=g)
    models, optims = {}, {}
    for name in ("hkt", "mha"):
        torch.manual_seed(seed)
        models[name] = listops_model(name, T).train()
        optims[name] = torch.optim.AdamW(models[name].parameters(), lr=1e-4)

    def make(name):
        model, opt = models[name], optims[name]

        def call():
            opt.zero_grad(set_to_none=True)
            model(tokens, mask, labels=labels).loss.backward()
            opt.step()

        return call

    row = {"T": T, "batch": batch, "model": "ListOps paper preset: 4 layers, width 128"}
    for name, model in models.items():
        row[f"{name}_parameters"] = sum(p.numel() for p in model.parameters())
    row.update(_compare(make, repeats, f"step T={T}"))
    return row


def step_section(seq_lens, batch: int, repeats: int, seed: int = 0) -> list[dict]:
    return [_step_case(T, batch, repeats, seed) for T in seq_lens]


def to_markdown(section: str, rows: list[dict], target: float, mem_target: float | None) -> str:
    what = (
        "HKTAttention (impl='auto') vs the SDPA multi-head-attention block, forward+backward"
        if section == "layer"
        else "training step (forward, backward, AdamW) of the ListOps paper model, HKT vs MHA"
    )
    lines = [
        f"{what}; medians of alternating calls; ratios measured in the same run. Target: time "
        f"<= {target}x" + (f", peak memory <= {mem_target}x." if mem_target else "."),
        "",
        "| T | HKT ms | MHA ms | time HKT/MHA | HKT MiB | MHA MiB | memory HKT/MHA |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['T']} | {r['hkt_ms']:.1f} | {r['mha_ms']:.1f} | **{r['time_ratio']:.2f}x** "
            f"| {r['hkt_peak_mib']:.1f} | {r['mha_peak_mib']:.1f} | {r['mem_ratio']:.2f}x |"
        )
    for r in rows:
        lines += [
            "",
            f"Where the time goes at T = {r['T']} (operator self time, ms, mean of "
            f"{PROFILE_CALLS} profiled calls per model):",
            "",
            "| bucket | HKT | MHA | HKT - MHA |",
            "|---|---:|---:|---:|",
        ]
        hp, mp = r["hkt_profile_ms"], r["mha_profile_ms"]
        names = [b for b, _ in BUCKETS] + ["other", "total"]
        for b in names:
            h, m = hp.get(b, 0.0), mp.get(b, 0.0)
            if h or m:
                lines.append(f"| {b} | {h:.1f} | {m:.1f} | {h - m:+.1f} |")
    return "\n".join(lines)

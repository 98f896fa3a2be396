"""The ``kernel``, ``layer`` and ``step`` sections of ``benchmarks/attention.py``: what a user
runs.

* ``kernel``: HKT attention (``impl="fused_cpp"``) against PyTorch's SDPA, forward + backward,
  in float32 and bfloat16, with the bfloat16 and float32 matmul rates measured in the same run
  (the attention's rate is quoted as a fraction of them).
* ``layer``: :class:`HKTAttention` (``impl="auto"``) against the SDPA multi-head-attention block
  of the same width (:class:`MultiHeadAttention`), forward + backward, alternating call by call.
* ``step``: a full training step (forward, backward, AdamW update) of the paper's ListOps model
  (4 layers, width 128, 4 heads) with HKT attention against its MHA twin.

The layer and step sections run in float32 or under bfloat16 autocast (``precision``), as
``--train.bf16`` trains.

Each reports medians, the HKT/MHA ratio measured in the same run, peak tensor memory, and where
the time goes: operator self-times grouped into buckets (the attention kernel, GEMMs,
convolutions, copies, norms and activations, other elementwise work, the optimiser, the rest),
the mean of a few profiled calls per model, alternating.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from structattn.hkt import HKTAttention, HKTConfig, ModelConfig, MultiHeadAttention, hkt_attention
from structattn.hkt.levels import level_lengths
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


def _autocast(precision: str):
    """bfloat16 autocast (what ``--train.bf16`` trains under) or nothing (float32)."""
    if precision == "bfloat16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    if precision != "float32":
        raise ValueError(f"precision must be float32 or bfloat16, got {precision!r}")
    return contextlib.nullcontext()


def _layer_case(T, d_model, heads, levels, batch, repeats, seed, precision="float32") -> dict:
    torch.manual_seed(seed)
    x = torch.randn(batch, T, d_model, requires_grad=True)
    hkt = HKTConfig(d_model=d_model, n_heads=heads, n_levels=levels, causal=True)
    layers = {"hkt": HKTAttention(hkt), "mha": MultiHeadAttention(d_model, heads, causal=True)}

    def make(name):
        layer = layers[name]

        def call():
            x.grad = None
            layer.zero_grad(set_to_none=True)
            with _autocast(precision):
                y = layer(x)
            y.float().sum().backward()

        return call

    row = {"T": T, "d_model": d_model, "heads": heads, "head_dim": d_model // heads,
           "levels": levels, "batch": batch, "precision": precision}  # fmt: skip
    row.update(_compare(make, repeats, f"layer T={T} B={batch} {precision}"))
    return row


def layer_section(
    seq_lens, d_model: int, heads: int, levels: int, batch: int, repeats: int, seed: int = 0,
    precisions=("float32",),
) -> list[dict]:  # fmt: skip
    return [
        _layer_case(T, d_model, heads, levels, batch, repeats, seed, p)
        for p in precisions
        for T in seq_lens
    ]


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


def _step_case(T, batch, repeats, seed, precision="float32") -> dict:
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
            with _autocast(precision):
                loss = model(tokens, mask, labels=labels).loss
            loss.backward()
            opt.step()

        return call

    row = {"T": T, "batch": batch, "precision": precision,
           "model": "ListOps paper preset: 4 layers, width 128"}  # fmt: skip
    for name, model in models.items():
        row[f"{name}_parameters"] = sum(p.numel() for p in model.parameters())
    row.update(_compare(make, repeats, f"step T={T} B={batch} {precision}"))
    return row


def step_section(
    seq_lens, batch: int, repeats: int, seed: int = 0, precisions=("float32",), extra=()
) -> list[dict]:
    """The step at every ``seq_lens`` with ``batch``, and at each ``(T, batch)`` of ``extra``
    (the small batches), in every precision."""
    cases = [(T, batch) for T in seq_lens] + [c for c in extra if c not in
                                                [(T, batch) for T in seq_lens]]  # fmt: skip
    return [_step_case(T, b, repeats, seed, p) for p in precisions for T, b in cases]


def matmul_rate(dtype: torch.dtype, n: int = 2048, repeats: int = 3) -> float:
    """GFLOP/s of an ``n x n x n`` matmul in ``dtype`` (median of ``repeats``)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    times = [_timed(lambda: a @ b) for _ in range(repeats)]
    return 2 * n**3 / statistics.median(times) / 1e9


def attention_flops(B: int, H: int, T: int, d: int, causal: bool) -> float:
    """FLOPs of flat attention's forward + backward GEMMs (QK^T, PV; recomputed QK^T, dV, dP,
    dQ, dK): 7 products of ``2 T^2 d`` per head, halved when causal -- the work HKT's fine level
    shares with SDPA (its coarse levels add 1 / s^2 + 1 / s^4 + ... of the score products)."""
    return 7 * 2 * B * H * T * T * d * (0.5 if causal else 1.0)


def _kernel_case(B, H, T, d, levels, causal, dtype, repeats, seed) -> dict:
    g = torch.Generator().manual_seed(seed)
    lengths = level_lengths(T, levels, 2)
    q = [torch.randn(B, H, t, d, generator=g).to(dtype).requires_grad_() for t in lengths]
    k = [torch.randn(B, H, t, d, generator=g).to(dtype).requires_grad_() for t in lengths]
    v = torch.randn(B, H, T, d, generator=g).to(dtype).requires_grad_()
    lam = torch.full((H, levels), 1.0 / levels).to(dtype)
    upstream = torch.randn(B, H, T, d, generator=g).to(dtype)

    def hkt():
        out = hkt_attention(q, k, v, lam, stride=2, causal=causal, impl="fused_cpp")
        torch.autograd.grad(out, [*q, *k, v], upstream)

    def sdpa():
        out = torch.nn.functional.scaled_dot_product_attention(q[0], k[0], v, is_causal=causal)
        torch.autograd.grad(out, [q[0], k[0], v], upstream)

    fns = {"hkt": hkt, "sdpa": sdpa}
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(_timed(fn))
    flops = attention_flops(B, H, T, d, causal)
    row = {"B": B, "H": H, "T": T, "d": d, "levels": levels, "causal": causal,
           "dtype": str(dtype).removeprefix("torch."),
           "flat_attention_gflop": flops / 1e9}  # fmt: skip
    for name in fns:
        ms = 1e3 * statistics.median(times[name])
        row[f"{name}_ms"] = ms
        row[f"{name}_ms_all"] = [1e3 * t for t in times[name]]
        row[f"{name}_gflops"] = flops / (ms / 1e3) / 1e9
    row["time_ratio"] = row["hkt_ms"] / row["sdpa_ms"]
    return row


def kernel_section(cases, levels: int, repeats: int, seed: int = 0) -> dict:
    """HKT attention vs SDPA at each ``(B, H, T, d)`` of ``cases`` (causal), float32 and
    bfloat16, and the matmul rates measured in the same run."""
    from structattn.hkt.kernels.fused_cpp import lowp_route

    rates = {"bfloat16": matmul_rate(torch.bfloat16), "float32": matmul_rate(torch.float32)}
    rows = []
    for B, H, T, d in cases:
        for dtype in (torch.float32, torch.bfloat16):
            row = _kernel_case(B, H, T, d, levels, True, dtype, repeats, seed)
            rate = rates[row["dtype"]]
            row["hkt_fraction_of_matmul"] = row["hkt_gflops"] / rate
            row["sdpa_fraction_of_matmul"] = row["sdpa_gflops"] / rate
            rows.append(row)
    return {"rows": rows, "matmul_gflops": rates, "bf16_route": lowp_route(torch.bfloat16)}


def kernel_markdown(section: dict, target: float) -> str:
    rates = section["matmul_gflops"]
    lines = [
        "HKT attention (impl='fused_cpp', L levels, stride 2) vs PyTorch SDPA, forward+backward, "
        f"causal; medians of alternating calls. bfloat16 kernel: {section['bf16_route']}. "
        f"Matmul rate in this run (2048^3): bfloat16 {rates['bfloat16']:.0f} GFLOP/s, float32 "
        f"{rates['float32']:.0f} GFLOP/s. GFLOP/s count flat attention's GEMMs only. Target: "
        f"bfloat16 HKT/SDPA <= {target}x.",
        "",
        "| B | H | T | d | L | dtype | HKT ms | SDPA ms | HKT/SDPA | HKT GFLOP/s (of matmul) "
        "| SDPA GFLOP/s (of matmul) |",
        "|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in section["rows"]:
        lines.append(
            f"| {r['B']} | {r['H']} | {r['T']} | {r['d']} | {r['levels']} | {r['dtype']} "
            f"| {r['hkt_ms']:.1f} | {r['sdpa_ms']:.1f} | **{r['time_ratio']:.2f}x** "
            f"| {r['hkt_gflops']:.0f} ({100 * r['hkt_fraction_of_matmul']:.0f}%) "
            f"| {r['sdpa_gflops']:.0f} ({100 * r['sdpa_fraction_of_matmul']:.0f}%) |"
        )
    by_case: dict[tuple, dict[str, float]] = {}
    for r in section["rows"]:
        by_case.setdefault((r["B"], r["H"], r["T"], r["d"]), {})[r["dtype"]] = r["hkt_ms"]
    lines.append("")
    for case, ms in by_case.items():
        if "float32" in ms and "bfloat16" in ms:
            lines.append(f"- {case}: HKT bfloat16 is {ms['float32'] / ms['bfloat16']:.2f}x "
                         "faster than HKT float32.")  # fmt: skip
    return "\n".join(lines)


def _bf16_speedups(rows: list[dict]) -> list[str]:
    """Per (T, batch) run in both precisions: how much faster bfloat16 autocast is."""
    ms: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        ms.setdefault((r["T"], r["batch"]), {})[r.get("precision", "float32")] = r
    out = []
    for (T, batch), by in ms.items():
        if "float32" in by and "bfloat16" in by:
            f, b = by["float32"], by["bfloat16"]
            out.append(
                f"- T = {T}, batch {batch}: bfloat16 is {f['hkt_ms'] / b['hkt_ms']:.2f}x faster "
                f"than float32 for HKT, {f['mha_ms'] / b['mha_ms']:.2f}x for MHA."
            )
    return out


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
        "| T | batch | precision | HKT ms | MHA ms | time HKT/MHA | HKT MiB | MHA MiB "
        "| memory HKT/MHA |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['T']} | {r['batch']} | {r.get('precision', 'float32')} | {r['hkt_ms']:.1f} "
            f"| {r['mha_ms']:.1f} | **{r['time_ratio']:.2f}x** | {r['hkt_peak_mib']:.1f} "
            f"| {r['mha_peak_mib']:.1f} | {r['mem_ratio']:.2f}x |"
        )
    speedups = _bf16_speedups(rows)
    if speedups:
        lines += ["", *speedups]
    for r in rows:
        lines += [
            "",
            f"Where the time goes at T = {r['T']}, batch {r['batch']}, "
            f"{r.get('precision', 'float32')} (operator self time, ms, mean of "
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

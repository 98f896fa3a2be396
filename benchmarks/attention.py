"""Attention benchmark: HKT attention against SDPA multi-head attention, forward + backward.

    python benchmarks/attention.py --preset quick        # make bench-quick (about 5 minutes)
    python benchmarks/attention.py --preset full         # make bench: T up to 16k (about 25 min)
    python benchmarks/attention.py --seq-lens 4096 --head-dims 64 --levels 3 --repeats 9

For every (T, d, L) it times, in one process and alternating call by call so that machine noise
hits every path alike:

* ``sdpa``       standard causal multi-head attention, ``scaled_dot_product_attention``;
* ``hkt_fast``   :func:`structattn.hkt.hkt_attention` with ``impl="fast"`` (exact, O(T) memory);
* ``hkt_fused``  ``impl="fused"``: blockwise online softmax, coarse scores once per block (exact);
* ``hkt_ref``    the materialised reference (only up to ``--reference-max-len``);

and reports medians, the ratio of each to SDPA, and the peak bytes of tensors that operators
allocate during forward + backward (:class:`structattn.utils.TensorMemoryTracker`; inputs
excluded, private scratch of a fused kernel not seen). Output: a markdown table on stdout, plus
``attention.json``, ``attention.md`` and ``attention.png`` (ratio to SDPA vs T) in ``--out-dir``.
Inputs are float32, causal, B x H heads; level weights are learnable (their gradient is timed).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
import tyro
from tqdm import tqdm

from structattn.hkt import hkt_attention, hkt_cost, level_lengths
from structattn.utils import TensorMemoryTracker

PRESETS = {
    "quick": dict(seq_lens=(1024, 4096), head_dims=(32, 64), levels=(1, 2, 3), repeats=5),
    "full": dict(
        seq_lens=(1024, 2048, 4096, 8192, 16384), head_dims=(32, 64), levels=(1, 2, 3), repeats=5
    ),
}
TARGET_RATIO = 1.31  # the paper's cost (1.3125x for L = 3): the goal at T = 4096


@dataclass
class Args:
    """Forward + backward time and peak memory of HKT attention vs SDPA multi-head attention."""

    preset: Literal["quick", "full"] = "quick"  # grid of T, d, L and repeats (flags override)
    seq_lens: tuple[int, ...] | None = None  # sequence lengths T (default: from the preset)
    head_dims: tuple[int, ...] | None = None  # head dims d (default: from the preset)
    levels: tuple[int, ...] | None = None  # level counts L (default: from the preset)
    repeats: int | None = None  # timed calls per path; the median is reported
    batch: int = 1  # batch size B
    heads: int = 4  # heads H
    stride: int = 2  # level stride s
    reference_max_len: int = 4096  # run the materialised reference only up to this T
    memory: bool = True  # also measure peak tensor memory (one extra call per path)
    threads: int | None = None  # torch threads (default: torch's choice)
    out_dir: Path = Path("results/bench")  # where attention.json / .md / .png go
    seed: int = 0  # input seed
    extra: dict[str, str] = field(default_factory=dict)  # free-form notes copied to the JSON

    def resolve(self) -> Args:
        preset = PRESETS[self.preset]
        for key in ("seq_lens", "head_dims", "levels", "repeats"):
            if getattr(self, key) is None:
                setattr(self, key, preset[key])
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        return self


def _make_case(B, H, T, d, n_levels, stride, seed):
    """Inputs (leaf tensors requiring grad) and a closure per path returning the output."""
    g = torch.Generator().manual_seed(seed)

    def leaf(*shape):
        return torch.randn(*shape, generator=g).requires_grad_(True)

    q0, k0, v = leaf(B, H, T, d), leaf(B, H, T, d), leaf(B, H, T, d)
    lengths = level_lengths(T, n_levels, stride)
    qs = [q0] + [leaf(B, H, t, d) for t in lengths[1:]]
    ks = [k0] + [leaf(B, H, t, d) for t in lengths[1:]]
    theta = leaf(H, n_levels)
    leaves = [*qs, *ks[1:], k0, v, theta]

    def sdpa():
        return F.scaled_dot_product_attention(q0, k0, v, is_causal=True)

    def hkt(impl):
        def run():
            lam = torch.softmax(theta, -1)
            return hkt_attention(qs, ks, v, lam, stride=stride, causal=True, impl=impl)

        return run

    paths = {
        "sdpa": sdpa,
        "hkt_fast": hkt("fast"),
        "hkt_fused": hkt("fused"),
        "hkt_ref": hkt("reference"),
    }
    return leaves, paths


def _fwd_bwd(fn: Callable[[], torch.Tensor], leaves) -> float:
    for t in leaves:
        t.grad = None
    start = time.perf_counter()
    out = fn()
    out.backward(torch.ones_like(out))
    return time.perf_counter() - start


def _peak_bytes(fn, leaves) -> int:
    for t in leaves:
        t.grad = None
    with TensorMemoryTracker() as mem:
        out = fn()
        out.backward(torch.ones_like(out))
        del out
    return mem.peak_bytes


def run(args: Args) -> dict:
    args.resolve()
    if args.threads:
        torch.set_num_threads(args.threads)
    grid = [(T, d, L) for T in args.seq_lens for d in args.head_dims for L in args.levels]
    rows = []
    for T, d, L in tqdm(grid, desc="attention benchmark", unit="case", file=sys.stderr):
        leaves, paths = _make_case(args.batch, args.heads, T, d, L, args.stride, args.seed)
        names = ["sdpa", "hkt_fast", "hkt_fused"]
        names += ["hkt_ref"] if T <= args.reference_max_len else []
        times = {name: [] for name in names}
        for name in names:  # warm-up, untimed
            _fwd_bwd(paths[name], leaves)
        for _ in range(args.repeats):  # alternate paths call by call
            for name in names:
                times[name].append(_fwd_bwd(paths[name], leaves))
        row = {"T": T, "d": d, "L": L}
        for name in names:
            row[f"{name}_ms"] = 1e3 * statistics.median(times[name])
            row[f"{name}_ms_all"] = [1e3 * t for t in times[name]]
            row[f"{name}_ratio"] = row[f"{name}_ms"] / row["sdpa_ms"]
            if args.memory:
                row[f"{name}_peak_mib"] = _peak_bytes(paths[name], leaves) / 2**20
                row[f"{name}_mem_ratio"] = row[f"{name}_peak_mib"] / row["sdpa_peak_mib"]
        cost = hkt_cost(L, args.stride, seq_len=T)
        row["paper_flop_ratio"] = cost.paper_score_ratio
        row["fast_flop_ratio"] = cost.fast_total_ratio
        rows.append(row)
        del leaves, paths
    return {
        "benchmark": "attention forward+backward, float32, causal",
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(args).items()},
        "environment": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "processor": platform.processor(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
        },
        "target_ratio_at_4096": TARGET_RATIO,
        "rows": rows,
    }


def _fmt(row, key, spec):
    return format(row[key], spec) if key in row else "-"


def _mem(row, name):
    if f"{name}_peak_mib" not in row:
        return "-"
    return f"{row[f'{name}_peak_mib']:.1f} ({row[f'{name}_mem_ratio']:.1f}x)"


def to_markdown(result: dict) -> str:
    a = result["args"]
    lines = [
        f"Attention forward+backward, float32, causal, B={a['batch']}, H={a['heads']}, "
        f"s={a['stride']}, medians of {a['repeats']} alternating calls "
        f"(torch {result['environment']['torch']}, {result['environment']['torch_threads']} "
        "threads). Ratios are to SDPA multi-head attention in the same run. MiB: peak bytes "
        "of tensors allocated by operators during forward+backward, inputs excluded.",
        "",
        "| T | d | L | SDPA ms | HKT fast ms | fast / SDPA | fused / SDPA | HKT ref ms "
        "| ref / SDPA "
        "| SDPA MiB | fast MiB (/ SDPA) | fused MiB (/ SDPA) | ref MiB (/ SDPA) "
        "| paper FLOP ratio | fast FLOP ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['T']} | {r['d']} | {r['L']} | {r['sdpa_ms']:.1f} | {r['hkt_fast_ms']:.1f} "
            f"| **{r['hkt_fast_ratio']:.2f}x** | {r['hkt_fused_ratio']:.2f}x "
            f"| {_fmt(r, 'hkt_ref_ms', '.1f')} "
            f"| {_fmt(r, 'hkt_ref_ratio', '.2f')} | {_fmt(r, 'sdpa_peak_mib', '.1f')} "
            f"| {_mem(r, 'hkt_fast')} | {_mem(r, 'hkt_fused')} | {_mem(r, 'hkt_ref')} "
            f"| {r['paper_flop_ratio']:.3f} | {r['fast_flop_ratio']:.1f} |"
        )
    target = [r for r in result["rows"] if r["T"] == 4096 and r["L"] == 3]
    if target:
        lines.append("")
        for r in target:
            best = min(("fast", "fused"), key=lambda n: r[f"hkt_{n}_ratio"])
            ratio = r[f"hkt_{best}_ratio"]
            verdict = "meets" if ratio <= TARGET_RATIO else "misses"
            lines.append(
                f"Target HKT <= {TARGET_RATIO}x SDPA at T=4096, L=3, d={r['d']}: best path "
                f"({best}) {ratio:.2f}x ({verdict} it)."
            )
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    dims = sorted({r["d"] for r in rows})
    fig, axes = plt.subplots(1, len(dims), figsize=(5 * len(dims), 4), squeeze=False)
    for ax, d in zip(axes[0], dims):
        for L in sorted({r["L"] for r in rows}):
            sel = sorted((r for r in rows if r["d"] == d and r["L"] == L), key=lambda r: r["T"])
            ax.plot(
                [r["T"] for r in sel],
                [r["hkt_fast_ratio"] for r in sel],
                "o-",
                label=f"HKT fast, L={L}",
            )
            ref = [r for r in sel if "hkt_ref_ratio" in r]
            if ref and L > 1:
                ax.plot(
                    [r["T"] for r in ref],
                    [r["hkt_ref_ratio"] for r in ref],
                    "x:",
                    label=f"HKT reference, L={L}",
                )
        ax.axhline(1.0, color="k", lw=0.8, label="SDPA MHA")
        ax.axhline(TARGET_RATIO, color="r", ls="--", lw=0.8, label=f"target {TARGET_RATIO}x")
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="sequence length T",
            ylabel="time / SDPA (fwd+bwd)",
            title=f"head dim d={d}",
        )
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    args = tyro.cli(Args, args=argv)
    try:
        result = run(args)
    except ValueError as err:
        raise SystemExit(f"attention benchmark: error: {err}") from None
    table = to_markdown(result)
    print(table)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "attention.json").write_text(json.dumps(result, indent=2))
    (args.out_dir / "attention.md").write_text(table + "\n")
    plot(result, args.out_dir / "attention.png")
    print(f"\nwrote {args.out_dir}/attention.json, attention.md, attention.png", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()

"""Attention benchmark: HKT attention against SDPA multi-head attention, forward + backward.

    python benchmarks/attention.py --preset quick        # make bench-quick (about 2 minutes)
    python benchmarks/attention.py --preset full         # make bench: T 1k/4k/16k (about 15 min)
    python benchmarks/attention.py --seq-lens 4096 --head-dims 64 --levels 3 --repeats 9
    python benchmarks/attention.py --preset gpu          # CUDA, bfloat16, T 4k/16k/64k
    python benchmarks/attention.py --sections layer step # the layer and the training step

For every (T, d, L) it times, in one process and alternating call by call so that machine noise
hits every path alike:

* ``sdpa``              standard causal multi-head attention, ``scaled_dot_product_attention``
                        (FlashAttention on CUDA, PyTorch's flash kernel on the CPU);
* ``hkt_sdpa``          :func:`structattn.hkt.hkt_attention` with ``impl="sdpa"`` (one SDPA call
                        on the concatenated levels);
* ``hkt_fused_cpp``     the C++/OpenMP blockwise kernel (CPU, when it builds);
* ``hkt_fused_triton``  the Triton blockwise kernel (CUDA, when Triton is installed);
* ``hkt_fused_torch``   the PyTorch tile loop (only up to ``--tile-loop-max-len``);
* ``hkt_ref``           the materialised reference (only up to ``--reference-max-len``);

and reports medians, the ratio of each to SDPA, and peak memory during forward + backward: on
the CPU the bytes of tensors that operators allocate (:class:`structattn.utils.TensorMemoryTracker`;
inputs excluded, the C++ kernel's private per-thread tile scratch not seen), on CUDA
``torch.cuda.max_memory_allocated`` above the inputs. Output: a markdown table on stdout, plus
``attention.json``, ``attention.md`` and ``attention.png`` (ratio to SDPA vs T) in ``--out-dir``.
Inputs are causal, B x H heads; level weights are learnable (their gradient is timed). The
JSON records which path ``impl="auto"`` picks on the device.

``--sections layer step`` (see ``benchmarks/layer_step.py``) measure what a user runs: the
``HKTAttention`` layer against an SDPA multi-head-attention block (B=2, D=256, H=4, L=3), and a
full training step of the paper's ListOps model against its MHA twin (T = 512 and 1024), with
a profile of where the time goes; ``layer.json`` / ``step.json`` and ``.md`` in ``--out-dir``.
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
    "full": dict(seq_lens=(1024, 4096, 16384), head_dims=(32, 64), levels=(2, 3), repeats=5),
    "gpu": dict(
        seq_lens=(4096, 16384, 65536),
        head_dims=(64,),
        levels=(2, 3),
        repeats=10,
        device="cuda",
        dtype="bfloat16",
        batch=2,
        heads=16,
    ),
}
TARGET_RATIO = 1.31  # the paper's cost (1.3125x for L = 3): the goal at T = 4096


@dataclass
class Args:
    """Forward + backward time and peak memory of HKT attention vs SDPA multi-head attention."""

    preset: Literal["quick", "full", "gpu"] = "quick"  # grid, repeats (flags override)
    seq_lens: tuple[int, ...] | None = None  # sequence lengths T (default: from the preset)
    head_dims: tuple[int, ...] | None = None  # head dims d (default: from the preset)
    levels: tuple[int, ...] | None = None  # level counts L (default: from the preset)
    repeats: int | None = None  # timed calls per path; the median is reported
    batch: int | None = None  # batch size B (default 1; gpu preset 2)
    heads: int | None = None  # heads H (default 4; gpu preset 16)
    device: str | None = None  # cpu or cuda (default: cpu; gpu preset: cuda)
    dtype: Literal["float32", "bfloat16", None] = None  # default float32 (gpu preset: bfloat16)
    stride: int = 2  # level stride s
    reference_max_len: int = 4096  # run the materialised reference only up to this T
    tile_loop_max_len: int = 4096  # run the PyTorch tile loop (impl="fused_torch") up to this T
    memory: bool = True  # also measure peak tensor memory (one extra call per path)
    threads: int | None = None  # torch threads (default: torch's choice)
    out_dir: Path = Path("results/bench")  # where attention.json / .md / .png go
    seed: int = 0  # input seed
    extra: dict[str, str] = field(default_factory=dict)  # free-form notes copied to the JSON
    # what to run
    sections: tuple[Literal["attention", "kernel", "layer", "step"], ...] = ("attention",)
    kernel_cases: tuple[str, ...] = ("8x4x1024x32", "2x4x4096x64")  # kernel section: BxHxTxd
    precisions: tuple[Literal["float32", "bfloat16"], ...] = ("float32",)  # layer / step sections
    layer_seq_lens: tuple[int, ...] = (4096,)  # layer section: T
    layer_d_model: int = 256  # layer section: width D (head dim D / heads)
    layer_batch: int = 2  # layer section: B
    step_seq_lens: tuple[int, ...] = (512, 1024)  # step section: T
    step_batch: int = 32  # step section: B (the paper's batch)
    step_extra: tuple[str, ...] = ()  # step section: more TxB cases (small batches: 512x8 1024x4)
    section_repeats: int = 7  # layer / step sections: timed rounds (medians reported)

    def resolve(self) -> Args:
        preset = {"batch": 1, "heads": 4, "device": "cpu", "dtype": "float32"}
        preset.update(PRESETS[self.preset])
        for key in ("seq_lens", "head_dims", "levels", "repeats", "batch", "heads", "device",
                    "dtype"):  # fmt: skip
            if getattr(self, key) is None:
                setattr(self, key, preset[key])
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device cuda requested but torch sees no CUDA device")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        return self


def _fused_paths(device: str) -> list[str]:
    """The blockwise kernels that can run here (building the C++ kernel if needed)."""
    if device == "cpu":
        from structattn.hkt.kernels.extension import cpu_kernel

        return ["fused_cpp"] if cpu_kernel() is not None else []
    from structattn.hkt.kernels.fused_triton import triton_available

    return ["fused_triton"] if triton_available() else []


def _auto_choice(device: str) -> str:
    """Which implementation ``impl="auto"`` resolves to on this device (no dropout)."""
    from structattn.hkt import resolve_impl

    return resolve_impl("auto", device)


def _make_case(B, H, T, d, n_levels, stride, seed, device="cpu", dtype=torch.float32):
    """Inputs (leaf tensors requiring grad) and a closure per path returning the output."""
    g = torch.Generator().manual_seed(seed)

    def leaf(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype).requires_grad_(True)

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

    paths = {"sdpa": sdpa}
    for impl in ("sdpa", "fused_cpp", "fused_triton", "fused_torch", "reference"):
        paths["hkt_ref" if impl == "reference" else f"hkt_{impl}"] = hkt(impl)
    return leaves, paths


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _fwd_bwd(fn: Callable[[], torch.Tensor], leaves, device: str = "cpu") -> float:
    for t in leaves:
        t.grad = None
    _sync(device)
    start = time.perf_counter()
    out = fn()
    out.backward(torch.ones_like(out))
    _sync(device)
    return time.perf_counter() - start


def _peak_bytes(fn, leaves, device: str = "cpu") -> int:
    for t in leaves:
        t.grad = None
    if device == "cuda":
        _sync(device)
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn()
        out.backward(torch.ones_like(out))
        del out
        _sync(device)
        return torch.cuda.max_memory_allocated() - base
    with TensorMemoryTracker() as mem:
        out = fn()
        out.backward(torch.ones_like(out))
        del out
    return mem.peak_bytes


PATH_LABELS = {
    "sdpa": "SDPA",
    "hkt_sdpa": "HKT sdpa path",
    "hkt_fused_cpp": "fused C++",
    "hkt_fused_triton": "fused Triton",
    "hkt_fused_torch": "fused tile loop",
    "hkt_ref": "reference",
}


def run(args: Args) -> dict:
    args.resolve()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    fused = _fused_paths(args.device)
    grid = [(T, d, L) for T in args.seq_lens for d in args.head_dims for L in args.levels]
    rows = []
    for T, d, L in tqdm(grid, desc="attention benchmark", unit="case", file=sys.stderr):
        leaves, paths = _make_case(
            args.batch, args.heads, T, d, L, args.stride, args.seed, args.device, dtype
        )
        names = ["sdpa", "hkt_sdpa"] + [f"hkt_{impl}" for impl in fused]
        names += ["hkt_fused_torch"] if T <= args.tile_loop_max_len else []
        names += ["hkt_ref"] if T <= args.reference_max_len else []
        times = {name: [] for name in names}
        for name in names:  # warm-up, untimed
            _fwd_bwd(paths[name], leaves, args.device)
        for _ in range(args.repeats):  # alternate paths call by call
            for name in names:
                times[name].append(_fwd_bwd(paths[name], leaves, args.device))
        row = {"T": T, "d": d, "L": L}
        for name in names:
            row[f"{name}_ms"] = 1e3 * statistics.median(times[name])
            row[f"{name}_ms_all"] = [1e3 * t for t in times[name]]
            row[f"{name}_ratio"] = row[f"{name}_ms"] / row["sdpa_ms"]
            if args.memory:
                row[f"{name}_peak_mib"] = _peak_bytes(paths[name], leaves, args.device) / 2**20
                row[f"{name}_mem_ratio"] = row[f"{name}_peak_mib"] / row["sdpa_peak_mib"]
        cost = hkt_cost(L, args.stride, seq_len=T)
        row["paper_flop_ratio"] = cost.paper_score_ratio
        row["fast_flop_ratio"] = cost.fast_total_ratio
        row["fused_flop_ratio"] = cost.fused_total_ratio
        rows.append(row)
        del leaves, paths
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": args.device,
    }
    if args.device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
    return {
        "benchmark": f"attention forward+backward, {args.dtype}, causal, {args.device}",
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(args).items()},
        "environment": env,
        "auto_picks": _auto_choice(args.device),
        "target_ratio_at_4096": TARGET_RATIO,
        "rows": rows,
    }


def _fmt(row, key, spec):
    return format(row[key], spec) if key in row else "-"


def _mem(row, name):
    if f"{name}_peak_mib" not in row:
        return "-"
    return f"{row[f'{name}_peak_mib']:.1f} ({row[f'{name}_mem_ratio']:.1f}x)"


def _present(rows: list[dict]) -> list[str]:
    """Paths measured in at least one row, in the order of :data:`PATH_LABELS`."""
    return [n for n in PATH_LABELS if any(f"{n}_ms" in r for r in rows)]


def to_markdown(result: dict) -> str:
    a, env = result["args"], result["environment"]
    names = _present(result["rows"])
    hkt = [n for n in names if n != "sdpa"]
    where = env.get("gpu", f"{env['processor'] or env['machine']}, {env['torch_threads']} threads")
    lines = [
        f"Attention forward+backward, {a['dtype']}, causal, {a['device']} ({where}), "
        f"B={a['batch']}, H={a['heads']}, s={a['stride']}, medians of {a['repeats']} alternating "
        f"calls (torch {env['torch']}). Time ratios are to SDPA multi-head attention in the same "
        "run; MiB is peak memory during forward+backward, inputs excluded, with its ratio to "
        f"SDPA. impl='auto' picks {result['auto_picks']} here.",
        "",
        "| T | d | L | SDPA ms | "
        + " | ".join(f"{PATH_LABELS[n]} / SDPA" for n in hkt)
        + " | SDPA MiB | "
        + " | ".join(f"{PATH_LABELS[n]} MiB" for n in hkt)
        + " | paper FLOP ratio | fused FLOP floor | sdpa-path FLOP ratio |",
        "|" + "---:|" * (5 + 2 * len(hkt) + 3),
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['T']} | {r['d']} | {r['L']} | {r['sdpa_ms']:.1f} | "
            + " | ".join(
                _fmt(r, f"{n}_ratio", ".2f") + ("x" if f"{n}_ratio" in r else "") for n in hkt
            )  # fmt: skip
            + f" | {_fmt(r, 'sdpa_peak_mib', '.1f')} | "
            + " | ".join(_mem(r, n) for n in hkt)
            + f" | {r['paper_flop_ratio']:.3f} | {r['fused_flop_ratio']:.3f} "
            f"| {r['fast_flop_ratio']:.1f} |"
        )
    target = [r for r in result["rows"] if r["T"] == 4096 and r["L"] == 3]
    if target:
        lines.append("")
        for r in target:
            exact = [n for n in hkt if n != "hkt_ref" and f"{n}_ratio" in r]
            best = min(exact, key=lambda n: r[f"{n}_ratio"])
            ratio = r[f"{best}_ratio"]
            verdict = "meets" if ratio <= TARGET_RATIO else "misses"
            lines.append(
                f"Target HKT <= {TARGET_RATIO}x SDPA at T=4096, L=3, d={r['d']}: best path "
                f"({PATH_LABELS[best]}) {ratio:.2f}x ({verdict} it)."
            )
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    dims = sorted({r["d"] for r in rows})
    fig, axes = plt.subplots(1, len(dims), figsize=(5 * len(dims), 4), squeeze=False)
    styles = {"hkt_sdpa": "o-", "hkt_fused_cpp": "s-", "hkt_fused_triton": "s-",
              "hkt_fused_torch": "^:", "hkt_ref": "x:"}  # fmt: skip
    for ax, d in zip(axes[0], dims):
        for L in sorted({r["L"] for r in rows}):
            sel = sorted((r for r in rows if r["d"] == d and r["L"] == L), key=lambda r: r["T"])
            for name, style in styles.items():
                pts = [r for r in sel if f"{name}_ratio" in r]
                if pts and not (name == "hkt_ref" and L == 1):
                    ax.plot(
                        [r["T"] for r in pts],
                        [r[f"{name}_ratio"] for r in pts],
                        style,
                        label=f"HKT {PATH_LABELS[name]}, L={L}",
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


LAYER_TARGET, STEP_TARGET, STEP_MEM_TARGET, KERNEL_TARGET = 1.25, 1.3, 1.5, 1.0


def _dims(text: str, n: int, flag: str) -> list[int]:
    """``"8x4x1024x32"`` -> ``[8, 4, 1024, 32]`` (``n`` positive integers), or a one-line
    error naming ``flag``."""
    parts = text.lower().split("x")
    if len(parts) != n or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise SystemExit(f"attention benchmark: error: {flag} takes {n} positive integers "
                         f"joined by 'x', got {text!r}")  # fmt: skip
    return [int(p) for p in parts]


def run_sections(args: Args) -> dict[str, dict]:
    """The ``kernel``, ``layer`` and ``step`` sections named in ``args.sections`` (CPU)."""
    sys.path.insert(0, str(Path(__file__).parent))
    import layer_step as ls

    if args.threads:
        torch.set_num_threads(args.threads)
    out = {}
    env = {"torch": torch.__version__, "torch_threads": torch.get_num_threads(),
           "processor": platform.processor() or platform.machine()}  # fmt: skip
    if "kernel" in args.sections:
        cases = [_dims(c, 4, "--kernel-cases") for c in args.kernel_cases]
        section = ls.kernel_section(cases, (args.levels or (3,))[-1], args.section_repeats,
                                    args.seed)  # fmt: skip
        section.update(target_ratio=KERNEL_TARGET, environment=env,
                       markdown=ls.kernel_markdown(section, KERNEL_TARGET))  # fmt: skip
        out["kernel"] = section
    if "layer" in args.sections:
        rows = ls.layer_section(
            args.layer_seq_lens,
            args.layer_d_model,
            args.heads or 4,
            (args.levels or (3,))[-1],
            args.layer_batch,
            args.section_repeats,
            args.seed,
            args.precisions,
        )
        out["layer"] = {"rows": rows, "target_ratio": LAYER_TARGET, "environment": env,
                        "markdown": ls.to_markdown("layer", rows, LAYER_TARGET, None)}  # fmt: skip
    if "step" in args.sections:
        extra = [tuple(_dims(c, 2, "--step-extra")) for c in args.step_extra]
        rows = ls.step_section(args.step_seq_lens, args.step_batch, args.section_repeats,
                               args.seed, args.precisions, extra)  # fmt: skip
        out["step"] = {
            "rows": rows,
            "target_ratio": STEP_TARGET,
            "target_mem_ratio": STEP_MEM_TARGET,
            "environment": env,
            "markdown": ls.to_markdown("step", rows, STEP_TARGET, STEP_MEM_TARGET),
        }
    return out


def main(argv: list[str] | None = None) -> dict:
    args = tyro.cli(Args, args=argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    result: dict = {}
    if "attention" in args.sections:
        try:
            result = run(args)
        except ValueError as err:
            raise SystemExit(f"attention benchmark: error: {err}") from None
        table = to_markdown(result)
        print(table)
        (args.out_dir / "attention.json").write_text(json.dumps(result, indent=2))
        (args.out_dir / "attention.md").write_text(table + "\n")
        plot(result, args.out_dir / "attention.png")
        written = "attention.json, attention.md, attention.png"
        print(f"\nwrote {args.out_dir}/{written}", file=sys.stderr)
    for name, section in run_sections(args).items():
        print("\n" + section["markdown"])
        (args.out_dir / f"{name}.json").write_text(json.dumps(section, indent=2))
        (args.out_dir / f"{name}.md").write_text(section["markdown"] + "\n")
        print(f"wrote {args.out_dir}/{name}.json, {name}.md", file=sys.stderr)
        result[name] = section
    return result


if __name__ == "__main__":
    main()

"""``structattn diagnose RUN_DIR``: the paper's theory measured on a trained HKT model.

For every HKT layer of a run's best weights, on a few validation sequences: level weights and
beta, reciprocity/directionality shares of each level's bilinear form, the PSD condition
(Prop. 3.1) and the smallest eigenvalue of the fused symmetric scores, Mardia's statistics and
kappa of the per-level score vectors, per-head excess kurtosis, the three-term approximation
error and its curve against the number of levels, and the cost ratios. Definitions:
:mod:`structattn.hkt.diagnostics`. Writes ``diagnostics.md``, ``diagnostics.json`` and PNG
plots into ``RUN_DIR/diagnostics/`` (or ``--out-dir``).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import torch

from structattn.data import load_task
from structattn.engine import RunDir
from structattn.engine.checkpoint import load_weights
from structattn.errors import RunError
from structattn.hkt import diagnostics as dg
from structattn.hkt.attention import HKTAttention

from .experiment import build_model, load_run_config

__all__ = ["diagnose", "diagnose_model", "summary_line"]


def _layer_inputs(model, sequences: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Inputs ``(T, D)`` of every HKT layer for each sequence (forward pre-hooks)."""
    layers = model.encoder.hkt_layers()
    captured: list[list[torch.Tensor]] = [[] for _ in layers]
    hooks = [
        layer.register_forward_pre_hook(
            lambda mod, args, kwargs, i=i: captured[i].append(args[0][0].detach()),
            with_kwargs=True,
        )
        for i, layer in enumerate(layers)
    ]
    try:
        with torch.no_grad():
            for seq in sequences:
                model(seq[None])
    finally:
        for h in hooks:
            h.remove()
    return captured


def _layer_report(layer: HKTAttention, inputs: list[torch.Tensor]) -> dict[str, Any]:
    forms = dg.bilinear_forms(layer)  # (L, H, D, D)
    recip, direc = dg.shares(forms.double())
    psd = dg.psd_report(forms)
    gram_min, kurt, vectors, errors, all_scores = [], [], [], [], []
    for x in inputs:
        scores = dg.layer_scores(layer, x)
        all_scores.append(scores)
        fused = scores.fused()  # (H, T, T)
        sym, _ = dg.split_symmetric(fused)
        gram_min.append(torch.linalg.eigvalsh(sym)[:, 0])
        kurt.append(dg.excess_kurtosis(fused[:, scores.admissible()]))
        vectors.append([dg.score_vectors(scores, h) for h in range(fused.shape[0])])
        errors.append(dg.approximation_error(scores))
    H = forms.shape[1]
    mardia = [dg.mardia(torch.cat([v[h] for v in vectors])) for h in range(H)]
    candidates = {k: v.tolist() for k, v in dg.kurtosis_candidates(all_scores).items()}
    candidates["levels_mardia"] = [m.kappa for m in mardia]
    candidates["levels_mardia_b2"] = [m.kurtosis for m in mardia]
    mean = lambda name: torch.stack([getattr(e, name) for e in errors]).mean(0)  # noqa: E731
    return {
        "level_weights": layer.level_weights().detach().double().tolist(),
        "beta": layer.beta().detach().double().tolist(),
        "reciprocity": recip.tolist(),  # (L, H)
        "directionality": direc.tolist(),
        "psd_min_eigenvalue": psd["min_eigenvalue"].tolist(),  # (L, H)
        "psd_condition_holds": psd["holds"],
        "fused_symmetric_min_eigenvalue": torch.stack(gram_min).min(0).values.tolist(),  # (H,)
        "excess_kurtosis": torch.stack(kurt).mean(0).tolist(),  # (H,)
        "mardia": [vars(m) for m in mardia],
        "kappa": [m.kappa for m in mardia],
        "kurtosis_candidates": candidates,  # name -> (H,), see dg.KURTOSIS_CANDIDATES
        "approximation": {
            "total": mean("total").tolist(),
            "hierarchical": mean("hierarchical").tolist(),
            "quantisation": mean("quantisation").tolist(),
            "optimisation": mean("optimisation").tolist(),
            "best_weights": mean("best_weights").tolist(),
            "error_vs_levels": mean("error_vs_levels").tolist(),  # (H, L)
            "decay_ratios": dg.decay_ratios(mean("error_vs_levels")).tolist(),
        },
    }


def diagnose_model(model, sequences: list[torch.Tensor]) -> dict[str, Any]:
    """Diagnostics of every HKT layer of ``model`` on unpadded ``sequences`` (1-D token ids)."""
    model = model.double().eval()
    layers = model.encoder.hkt_layers()
    if not layers:
        raise ValueError("the model has no HKT layers (is it an MHA baseline run?)")
    inputs = _layer_inputs(model, sequences)
    cfg = layers[0].config
    T = max(len(s) for s in sequences)
    report = {
        "layers": [_layer_report(layer, x) for layer, x in zip(layers, inputs)],
        "cost": dg.cost_summary(cfg.n_levels, cfg.stride, T),
        "sequences": len(sequences),
        "max_len": T,
    }
    kappas = [k for layer in report["layers"] for k in layer["kappa"]]
    recips = [r for layer in report["layers"] for row in layer["reciprocity"] for r in row]
    report["kurtosis_candidates"] = _candidate_summary(report["layers"])
    b2 = report["kurtosis_candidates"].get("levels_mardia_b2", {})
    report["summary"] = {
        "kappa_mean": statistics.mean(kappas),
        "kappa_max": max(kappas),
        "paper_kappa_mean": b2.get("mean"),  # Mardia's b2,p itself: the paper's kappa's scale
        "paper_kappa_gaussian": b2.get("gaussian"),
        "reciprocity_mean": statistics.mean(recips),
        "psd_condition_holds": all(layer["psd_condition_holds"] for layer in report["layers"]),
        "approx_total_mean": statistics.mean(
            t for layer in report["layers"] for t in layer["approximation"]["total"]
        ),
    }
    return report


def _candidate_summary(layers: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each kurtosis reading's mean and max over layers and heads, with its Gaussian value."""
    out = {}
    for name, (_, gaussian) in dg.KURTOSIS_CANDIDATES.items():
        values = [v for layer in layers for v in layer["kurtosis_candidates"].get(name, [])]
        values = [v for v in values if v == v]  # NaN: a head with constant weights
        if gaussian is None:  # Mardia's p(p+2), p = L
            gaussian = layers[0]["mardia"][0]["gaussian_kurtosis"]
        if values:
            out[name] = {"mean": statistics.mean(values), "max": max(values),
                         "gaussian": gaussian}  # fmt: skip
    return out


def candidates_markdown(report: dict[str, Any]) -> list[str]:
    """The table of kurtosis readings against the paper's kappa ~ 33 (Gaussian 1)."""
    lines = [
        "Score kurtosis, every reading (the paper reports κ ≈ 33 after training and analyses "
        "non-Gaussianity with Mardia's test; the reading whose value matches is Mardia's b₂,p "
        "itself, `levels_mardia_b2`, Gaussian p(p+2) = 15 at L = 3; see docs/theory.md):",
        "",
        "| reading | what | Gaussian | mean over layers and heads | max | mean / Gaussian |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, v in report.get("kurtosis_candidates", {}).items():
        what = dg.KURTOSIS_CANDIDATES[name][0]
        lines.append(
            f"| `{name}` | {what} | {v['gaussian']:g} | {v['mean']:.3g} | {v['max']:.3g} "
            f"| {v['mean'] / v['gaussian']:.3g} |"
        )
    return lines


def summary_line(report: dict[str, Any]) -> str:
    s = report["summary"]
    paper = ""
    if s.get("paper_kappa_mean") is not None:
        paper = (f"the paper's κ (Mardia b₂,p) {s['paper_kappa_mean']:.1f} (Gaussian "
                 f"{s['paper_kappa_gaussian']:g}; paper ≈ 33), ")  # fmt: skip
    return (
        f"{paper}kappa mean {s['kappa_mean']:.2f} (max {s['kappa_max']:.2f}; Gaussian 1), "
        f"reciprocity share {s['reciprocity_mean']:.2f}, PSD condition "
        f"{'holds' if s['psd_condition_holds'] else 'fails'}, approximation error "
        f"{s['approx_total_mean']:.3g}"
    )


def to_markdown(report: dict[str, Any], title: str) -> str:
    lines = [
        f"# HKT diagnostics: {title}",
        "",
        f"{report['sequences']} validation sequences, T <= {report['max_len']}. "
        f"Summary: {summary_line(report)}.",
        "",
        "| layer | λ (mean over heads) | β (mean) | reciprocity per level | PSD min eig "
        "(min over heads) per level | fused sym. min eig | κ per head | excess kurtosis "
        "| error total = hier + quant + optim |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    fmt = lambda xs: ", ".join(f"{x:.3g}" for x in xs)  # noqa: E731
    for i, layer in enumerate(report["layers"]):
        lam = torch.tensor(layer["level_weights"]).mean(0).tolist()
        recip = torch.tensor(layer["reciprocity"]).mean(1).tolist()
        psd = torch.tensor(layer["psd_min_eigenvalue"]).min(1).values.tolist()
        a = layer["approximation"]
        avg = lambda k: statistics.mean(a[k])  # noqa: E731,B023
        lines.append(
            f"| {i} | {fmt(lam)} | {statistics.mean(layer['beta']):.3f} | {fmt(recip)} "
            f"| {fmt(psd)} | {min(layer['fused_symmetric_min_eigenvalue']):.3g} "
            f"| {fmt(layer['kappa'])} | {fmt(layer['excess_kurtosis'])} "
            f"| {avg('total'):.3g} = {avg('hierarchical'):.3g} + {avg('quantisation'):.3g} + "
            f"{avg('optimisation'):.3g} |"
        )
    c = report["cost"]
    lines += ["", *candidates_markdown(report)]
    lines += [
        "",
        f"Cost vs MHA: paper score FLOPs {c['paper_score_ratio']:.4f}x (bound "
        f"{c['paper_bound']:.4f}x), SDPA fast path executes {c['fast_total_ratio']:.1f}x, "
        f"an exact fused kernel {c['fused_total_ratio']:.3f}x.",
    ]
    return "\n".join(lines)


def plot_report(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """``diagnostics.png`` (six panels per layer) and ``kurtosis.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    layers = report["layers"]
    n = len(layers)
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    lam = np.array([layer["level_weights"] for layer in layers])  # (layers, H, L)
    L = lam.shape[-1]
    for level in range(L):
        axes[0, 0].bar(
            np.arange(n) + level * 0.8 / L,
            lam[:, :, level].mean(1),
            0.8 / L,
            label=f"level {level}",
        )
    axes[0, 0].set(title="level weights λ (mean over heads)", xlabel="layer")
    axes[0, 0].legend(fontsize=7)
    beta = np.array([layer["beta"] for layer in layers])
    axes[0, 1].plot(range(n), beta, "o-")
    axes[0, 1].set(title="β per head", xlabel="layer")
    recip = np.array([layer["reciprocity"] for layer in layers]).mean(-1)  # (layers, L)
    for level in range(L):
        axes[0, 2].plot(range(n), recip[:, level], "o-", label=f"level {level}")
    axes[0, 2].axhline(0.5, color="k", ls=":", lw=0.8)
    axes[0, 2].set(title="reciprocity share (1 - directionality)", xlabel="layer", ylim=(0, 1))
    axes[0, 2].legend(fontsize=7)
    psd = np.array([layer["psd_min_eigenvalue"] for layer in layers])  # (layers, L, H)
    for level in range(L):
        axes[1, 0].scatter(
            np.repeat(np.arange(n), psd.shape[-1]) + 0.1 * level,
            psd[:, level].ravel(),
            s=12,
            label=f"level {level}",
        )
    axes[1, 0].axhline(0, color="k", lw=0.8)
    axes[1, 0].set(title="smallest eigenvalue of M_s (PSD if >= 0)", xlabel="layer")
    axes[1, 0].legend(fontsize=7)
    kappa = np.array([layer["kappa"] for layer in layers])
    axes[1, 1].plot(range(n), kappa, "o")
    axes[1, 1].axhline(1, color="k", ls=":", lw=0.8, label="Gaussian")
    axes[1, 1].set(title="Mardia κ per head", xlabel="layer", yscale="log")
    axes[1, 1].legend(fontsize=7)
    for i, layer in enumerate(layers):
        curve = np.array(layer["approximation"]["error_vs_levels"]).mean(0)
        axes[1, 2].plot(range(1, len(curve) + 1), curve, "o-", label=f"layer {i}")
    axes[1, 2].set(title="approximation error vs levels", xlabel="L", yscale="log")
    axes[1, 2].legend(fontsize=7)
    for ax in axes.ravel()[:-1]:
        ax.set_xticks(range(n))
    axes[1, 2].set_xticks(range(1, L + 1))
    fig.tight_layout()
    path = out_dir / "diagnostics.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path, _plot_kurtosis(layers, out_dir)]


def _plot_kurtosis(layers: list[dict[str, Any]], out_dir: Path) -> Path:
    """Excess kurtosis per head against the Gaussian's 0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(6, 4))
    ek = np.array([layer["excess_kurtosis"] for layer in layers])
    ax.hist(ek.ravel(), bins=20, color="tab:red", alpha=0.7, label="heads")
    ax.axvline(0, color="k", ls=":", label="Gaussian (0)")
    ax.set(title="excess kurtosis of fused scores", xlabel="excess kurtosis", ylabel="heads")
    ax.legend()
    fig.tight_layout()
    path = out_dir / "kurtosis.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def diagnose(
    run_dir: Path,
    out_dir: Path | None = None,
    n_sequences: int = 4,
    max_len: int = 256,
    untrained: bool = False,
) -> dict[str, Any]:
    """Diagnose a run directory's best weights on ``n_sequences`` validation sequences.

    ``untrained``: a model of the run's configuration initialised from its seed instead (the
    "before" of the paper's "after training"), written to ``diagnostics-untrained/`` by default.
    """
    run_dir = Path(run_dir)
    cfg = load_run_config(run_dir)
    if cfg.model.attention != "hkt":
        raise RunError(f"{run_dir} trained attention={cfg.model.attention!r}; diagnose needs hkt")
    data = load_task(cfg.data, write_cache=False)  # the run's data folder is read, never written
    torch.manual_seed(cfg.seed)  # the run's own initialisation, for `untrained`
    model = build_model(cfg, data)
    weights = RunDir(run_dir).best
    if not untrained:
        if not weights.is_file():
            raise FileNotFoundError(f"{weights} not found: has the run finished an evaluation?")
        try:
            load_weights(model, weights)
        except (ValueError, OSError) as err:  # damaged or non-finite weights: say which
            raise RunError(f"{run_dir}: cannot load weights ({err})") from None
    sequences = [data.val.sequences[i][:max_len] for i in range(min(n_sequences, len(data.val)))]
    report = diagnose_model(model, sequences)
    report["run_dir"] = str(run_dir)
    report["data_source"] = data.source
    report["weights"] = "untrained (the run's seed)" if untrained else str(weights)
    default = "diagnostics-untrained" if untrained else "diagnostics"
    out_dir = Path(out_dir) if out_dir is not None else run_dir / default
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "diagnostics.json").write_text(json.dumps(report, indent=2))
    (out_dir / "diagnostics.md").write_text(to_markdown(report, str(run_dir)) + "\n")
    report["plots"] = [str(p) for p in plot_report(report, out_dir)]
    return report

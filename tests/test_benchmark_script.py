"""benchmarks/attention.py runs end to end on tiny sizes and writes its table, JSON and plot."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "attention.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_attention", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_tiny_benchmark_writes_outputs(tmp_path, capsys):
    bench = _load()
    argv = [
        "--seq-lens",
        "64",
        "96",
        "--head-dims",
        "8",
        "--levels",
        "1",
        "3",
        "--repeats",
        "1",
        "--reference-max-len",
        "64",
        "--out-dir",
        str(tmp_path),
    ]
    bench.main(argv)
    out = capsys.readouterr().out
    assert "HKT sdpa path / SDPA" in out
    data = json.loads((tmp_path / "attention.json").read_text())
    rows = data["rows"]
    assert [(r["T"], r["L"]) for r in rows] == [(64, 1), (64, 3), (96, 1), (96, 3)]
    for r in rows:  # every ratio column is its time over SDPA's time in the same row
        for key in [k for k in r if k.endswith("_ratio") and f"{k[:-6]}_ms" in r]:
            assert r[key] == pytest.approx(r[f"{key[:-6]}_ms"] / r["sdpa_ms"]), key
        assert r["hkt_sdpa_ms"] > 0 and r["sdpa_ms"] > 0
    assert "hkt_ref_ms" in rows[0] and "hkt_ref_ms" not in rows[2]  # reference capped at T=64
    # The materialised reference allocates more than the O(T) fast path.
    assert rows[1]["hkt_ref_peak_mib"] > rows[1]["hkt_sdpa_peak_mib"]
    # Every exact O(T) path is a column; the tile loop and the reference are capped by T.
    from structattn.hkt.kernels.extension import cpu_kernel

    if cpu_kernel() is not None:
        assert all("hkt_fused_cpp_ratio" in r for r in rows)
        assert data["auto_picks"] == "fused_cpp"
        assert "fused C++ / SDPA" in out
    assert all("hkt_fused_torch_ms" in r for r in rows)
    assert rows[1]["hkt_ref_peak_mib"] > rows[1].get("hkt_fused_cpp_peak_mib", 0.0)
    assert (tmp_path / "attention.png").stat().st_size > 0
    assert (tmp_path / "attention.md").read_text().startswith("Attention forward+backward")


def test_layer_and_step_sections_write_ratios_and_profiles(tmp_path, capsys):
    bench = _load()
    result = bench.main(
        [
            "--sections",
            "layer",
            "step",
            "--layer-seq-lens",
            "64",
            "--layer-d-model",
            "32",
            "--step-seq-lens",
            "32",
            "--step-batch",
            "2",
            "--section-repeats",
            "1",
            "--out-dir",
            str(tmp_path),
        ]
    )
    assert "attention" not in result  # only the sections asked for
    out = capsys.readouterr().out
    for name in ("layer", "step"):
        data = json.loads((tmp_path / f"{name}.json").read_text())
        assert data == json.loads(json.dumps(result[name]))
        (row,) = data["rows"]
        assert row["time_ratio"] == pytest.approx(row["hkt_ms"] / row["mha_ms"])
        assert row["mem_ratio"] == pytest.approx(row["hkt_peak_mib"] / row["mha_peak_mib"])
        for model in ("hkt", "mha"):
            prof = row[f"{model}_profile_ms"]
            parts = sum(v for k, v in prof.items() if k != "total")
            assert prof["total"] == pytest.approx(parts) and prof["attention kernel"] > 0
        assert (tmp_path / f"{name}.md").read_text().startswith(data["markdown"][:40])
    assert "Where the time goes" in out
    step = json.loads((tmp_path / "step.json").read_text())["rows"][0]
    assert step["hkt_parameters"] > step["mha_parameters"]  # per-level projections, convs


def test_decode_benchmark_runs_and_reports_ratios(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_decode", SCRIPT.parent / "decode.py")
    decode = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(decode)
    out = tmp_path / "decode.json"
    result = decode.main(
        ["--seq-lens", "40", "64", "--new-tokens", "3", "--repeats", "1", "--d-model", "16",
         "--n-heads", "2", "--n-layers", "1", "--json", str(out)]
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert "| 40 |" in printed and "| 64 |" in printed
    saved = json.loads(out.read_text())
    assert [r["seq_len"] for r in saved["rows"]] == [40, 64]
    for row in result["rows"]:
        assert row["step_ratio"] == pytest.approx(row["hkt"]["step_ms"] / row["mha"]["step_ms"])
        torch_step = row["hkt_torch"]["step_ms"] / row["mha"]["step_ms"]
        assert row["torch_step_ratio"] == pytest.approx(torch_step)
        # HKT's cache holds (1 + 1/2 + 1/4) key rows per value row, plus its small windows
        assert 1.3 < row["cache_ratio"] < 1.6


def test_profiles_are_averaged_over_alternating_calls(monkeypatch):
    """The "where the time goes" buckets are the mean of several profiled calls per model,
    taken in turn (one call's buckets move by a fifth or more on a shared machine)."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import layer_step
    finally:
        sys.path.remove(str(SCRIPT.parent))
    order = []

    def fake_profile(fn):
        fn()
        n = len(order)
        return {"GEMM (projections, MLP)": float(n), "total": 10.0 * n}

    monkeypatch.setattr(layer_step, "profile_buckets", fake_profile)
    out = layer_step.mean_profiles(
        {"hkt": lambda: order.append("hkt"), "mha": lambda: order.append("mha")}, calls=3
    )
    assert order == ["hkt", "mha"] * 3
    assert out["hkt"] == {"GEMM (projections, MLP)": (1 + 3 + 5) / 3, "total": 10 * 3.0}
    assert out["mha"] == {"GEMM (projections, MLP)": (2 + 4 + 6) / 3, "total": 10 * 4.0}

"""The code-names table (``structattn code-names ablate``) and naming one
function with a finished run (``structattn code-names generate``)."""

from __future__ import annotations

import json

import pytest
from test_code_names import FILES, _build

from structattn.errors import ConfigError
from structattn.experiments.glfusion.code.metrics import name_scores
from structattn.experiments.glfusion.code.table import (
    code_names_table,
    shallow_baselines,
    table_markdown,
)

TINY = """
llm:
  model: glfusion
  max_prompt_tokens: 64
  max_new_tokens: 4
  eval_batch_size: 2
  optim: {lr: 0.001, warmup_steps: 0, schedule: constant}
  train: {max_steps: 2, batch_size: 2, eval_every: 2, log_every: 1}
gnn:
  model: gcn
  emb_dim: 8
  gnn_layers: 2
  optim: {lr: 0.001}
  train: {max_steps: 2, batch_size: 2, eval_every: 2, log_every: 1}
"""


@pytest.fixture()
def setup(tmp_path):
    from helpers import tiny_glfusion_models

    _build().save(tmp_path / "ds")
    (tmp_path / "tiny.yaml").write_text(TINY)
    kw = dict(config=tmp_path / "tiny.yaml", preset="llm", gnn_preset="gnn",
              out_dir=tmp_path / "out", dataset_path=tmp_path / "ds", data_dir=tmp_path,
              progress=False, models=lambda: tiny_glfusion_models(tmp_path))  # fmt: skip
    return tmp_path, kw


def test_shallow_baselines_by_hand():
    train = [["get", "name"], ["get", "name"], ["set", "value"], ["get", "id"]]
    refs = {"test": [["get", "name"], ["set", "id"]]}
    out = shallow_baselines(train, refs)
    assert out["most frequent name"]["guess"] == ["get", "name"]
    assert out["most frequent first sub-token"]["guess"] == ["get"]
    # "get name" against [get name] (F1 1) and [set id] (F1 0)
    assert out["most frequent name"]["test"]["f1"] == pytest.approx(50.0)
    assert out["most frequent name"]["test"]["exact"] == pytest.approx(50.0)
    # "get" against [get name]: precision 1, recall 1/2, F1 2/3; against [set id]: 0
    assert out["most frequent first sub-token"]["test"]["f1"] == pytest.approx(100 / 3)


def test_table_trains_every_row_and_pairs_by_seed(setup):
    tmp_path, kw = setup
    rows = ("gcn", "llm-code", "glfusion", "no-message-passing")
    res = code_names_table(seeds=(0, 1), rows=rows, **kw)
    root = tmp_path / "out" / "llm"
    for row in rows:
        for s in (0, 1):
            final = json.loads((root / row / f"seed{s}" / "final.json").read_text())
            assert final["model"] == (
                "gcn" if row == "gcn" else "llm-code" if row == "llm-code" else "glfusion"
            )
            assert res["runs"][f"{row} seed{s}"]["test"] == final["test"]
    cfg = json.loads(json.dumps(res["runs"]["no-message-passing seed0"]))
    assert cfg["model"] == "glfusion"
    f1 = {(r, s): 100 * res["runs"][f"{r} seed{s}"]["test"]["f1"] for r in rows for s in (0, 1)}
    comps = res["summary"]["comparisons"]
    assert set(comps) == {"glfusion - gcn", "glfusion - llm-code", "no-message-passing - glfusion"}
    want = [f1["glfusion", s] - f1["gcn", s] for s in (0, 1)]
    assert comps["glfusion - gcn"]["mean"] == pytest.approx(sum(want) / 2)
    want = [f1["no-message-passing", s] - f1["glfusion", s] for s in (0, 1)]
    assert comps["no-message-passing - glfusion"]["mean"] == pytest.approx(sum(want) / 2)
    assert res["summary"]["rows"]["gcn"]["test_f1"] == [f1["gcn", 0], f1["gcn", 1]]
    # the shallow rows are scored on the same draw the models saw
    data = _build()
    refs = [ex.subtokens for ex in data.test]
    guess = res["shallow"]["most frequent name"]["guess"]
    assert res["shallow"]["most frequent name"]["test"]["f1"] == pytest.approx(
        100 * name_scores(refs, [guess] * len(refs))["f1"]
    )
    md = (root / "table.md").read_text()
    assert md == table_markdown(res) + "\n"
    assert "GL-Fusion without message passing" in md and "most frequent name" in md
    assert "GL-Fusion − GCN + virtual node (OGB)" in md
    assert json.loads((root / "table.json").read_text())["rates"]["gcn"] == pytest.approx(1e-3)
    assert (root / "table.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # a second call reads every finished run back and trains nothing
    before = {p: p.stat().st_mtime_ns for p in root.rglob("final.json")}
    again = code_names_table(seeds=(0, 1), rows=rows, train_missing=False, **kw)
    assert again["summary"] == res["summary"]
    assert {p: p.stat().st_mtime_ns for p in root.rglob("final.json")} == before
    # asking for one row tables every finished row of the folder: none is dropped
    one = code_names_table(seeds=(0,), rows=rows[:1], train_missing=False, **kw)
    assert one["summary"] == res["summary"] and one["seeds"] == [0, 1]


def test_lr_sweep_keeps_the_best_validation_rate(setup):
    tmp_path, kw = setup
    res = code_names_table(seeds=(0,), rows=("gin",), lr_sweep=(1e-3, 1e-2), **kw)
    sweep = res["lr_sweep"]["gin"]
    root = tmp_path / "out" / "llm" / "sweep" / "gin"
    val = {lr: 100 * json.loads((root / f"lr{lr}" / "final.json").read_text())["val"]["f1"]
           for lr in ("0.001", "0.01")}  # fmt: skip
    assert sweep["val_f1"] == pytest.approx(val)
    best = max(val, key=lambda k: (val[k], -float(k)))
    assert sweep["chosen"] == best and res["rates"]["gin"] == pytest.approx(float(best))
    from structattn.engine import RunDir

    cfg = RunDir(tmp_path / "out" / "llm" / "gin" / "seed0").read_config()
    assert cfg["optim"]["lr"] == pytest.approx(float(best)) and cfg["seed"] == 0
    # the summary alone trains no sweep run: a rate not run yet is left out of the choice
    again = code_names_table(seeds=(0,), rows=("gin",), lr_sweep=(1e-3, 1e-2, 1e-4),
                             train_missing=False, **kw)  # fmt: skip
    assert not (root / "lr0.0001").exists()
    assert again["lr_sweep"]["gin"] == sweep and again["summary"] == res["summary"]


def test_a_call_for_one_row_tables_the_others_at_their_swept_rates(setup):
    tmp_path, kw = setup
    first = code_names_table(seeds=(0,), rows=("gin",), lr_sweep=(1e-2, 3e-2), **kw)
    chosen = first["rates"]["gin"]
    assert chosen != pytest.approx(1e-3)  # not the config's rate: the sweep decided it
    # another row, nothing trained: gin's finished run is read back at the rate it was
    # trained with, not named "another configuration" and dropped
    other = code_names_table(seeds=(0,), rows=("gcn",), lr_sweep=(1e-2, 3e-2),
                             train_missing=False, **kw)  # fmt: skip
    assert other["left_out"] == [] and other["rates"]["gin"] == pytest.approx(chosen)
    assert other["summary"]["rows"]["gin"] == first["summary"]["rows"]["gin"]
    assert other["lr_sweep"]["gin"] == first["lr_sweep"]["gin"]


def test_table_rejects_bad_requests(setup):
    tmp_path, kw = setup
    with pytest.raises(ConfigError, match="unknown rows"):
        code_names_table(rows=("gcn", "transformer"), **kw)
    with pytest.raises(ConfigError, match="add the glfusion row"):
        code_names_table(rows=("no-edge-texts",), **kw)
    text = (
        (tmp_path / "tiny.yaml")
        .read_text()
        .replace("  model: gcn\n", "  model: gcn\n  max_train: 2\n")
    )
    (tmp_path / "tiny.yaml").write_text(text)
    with pytest.raises(ConfigError, match="max_train"):
        code_names_table(rows=("gcn", "glfusion"), **kw)
    assert not (tmp_path / "out").exists()  # nothing trained before the checks


# ---------------------------------------------------------------------------- generate


def test_generate_names_a_function_with_a_gnn_run(tmp_path, capsys):
    from structattn.cli import main

    _build().save(tmp_path / "ds")
    run = tmp_path / "run"
    main(["code-names", "train", "--dataset-path", str(tmp_path / "ds"),
          "--model", "gcn", "--run-dir", str(run), "--emb-dim", "8", "--gnn-layers", "2",
          "--train.max-steps", "2", "--train.batch-size", "2",
          "--train.eval-every", "2"])  # fmt: skip
    capsys.readouterr()
    source = FILES / "beta" / "shared.py"
    main(["code-names", "generate", str(run), "--file", str(source),
          "--function", "load_items"])  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert out["true"] == ["load", "items"] and out["model"] == "gcn" and out["head"] == "gnn"
    assert isinstance(out["predicted"], list) and len(out["predicted"]) <= 5
    with pytest.raises(SystemExit, match="no LM head"):  # a GNN run cannot generate text
        main(["code-names", "generate", str(run), "--file",
              str(source), "--function", "load_items", "--head", "lm"])  # fmt: skip
    # the same function's prediction in the run's own test examples
    final = json.loads((run / "final.json").read_text())
    (same,) = [e for e in final["test_examples"] if e["true"] == ["load", "items"]]
    assert same["predicted"] == out["predicted"]


def test_generate_names_what_it_cannot_find(tmp_path):
    from structattn.errors import RunError
    from structattn.experiments.glfusion.code.generate import function_example, name_function

    with pytest.raises(ConfigError, match="no function 'missing'.*it has:"):
        function_example("def present(a):\n    return a + 1\n", "missing")
    ex = function_example("class A:\n    def size_of(self, x):\n        return x\n", "A.size_of")
    assert ex.subtokens == ["size", "of"] and "size_of" not in " ".join(ex.node_texts())
    with pytest.raises(RunError, match="not a code-names run|config"):
        name_function(tmp_path, "def f(a):\n    return a\n", "f")


def test_generate_with_glfusion_matches_the_runs_own_prediction(tmp_path):
    """A GL-Fusion run loaded back names a test function as the run's own evaluation did,
    with either head."""
    from helpers import tiny_glfusion_models

    from structattn.engine.config import TrainConfig
    from structattn.experiments.glfusion.code import CodeNamesConfig, train_code_names
    from structattn.experiments.glfusion.code.generate import name_function

    train = TrainConfig(max_steps=2, batch_size=2, eval_every=2, log_every=1)
    cfg = CodeNamesConfig(model="glfusion", run_dir=tmp_path / "run", data_dir=tmp_path,
                          max_prompt_tokens=64, max_new_tokens=4, eval_batch_size=2,
                          train=train)  # fmt: skip
    llm, encoder = tiny_glfusion_models(tmp_path)
    final = train_code_names(cfg, _build(), progress=False, llm=llm, encoder=encoder)
    (want,) = [e for e in final["test_examples"] if e["true"] == ["load", "items"]]
    source = (FILES / "beta" / "shared.py").read_text()
    theirs = sorted((tmp_path / "encodings").iterdir())  # the cache the run's config names
    for head in ("lm", "gnn"):
        llm, encoder = tiny_glfusion_models(tmp_path)  # the same base weights, untrained
        out = name_function(tmp_path / "run", source, "load_items", llm=llm, encoder=encoder,
                            head=head, data_dir=tmp_path / "mine")  # fmt: skip
        assert out["head"] == head and out["true"] == ["load", "items"]
        assert out["model"] == "glfusion" and out["nodes"] > 1
        if head == final["head"]:
            assert out["predicted"] == want["predicted"]
    # the new function's encodings go to the caller's folder, never the run's
    assert sorted((tmp_path / "encodings").iterdir()) == theirs
    assert any((tmp_path / "mine" / "encodings").iterdir())
    with pytest.raises(ConfigError, match="head must be"):
        name_function(tmp_path / "run", source, "load_items", llm=llm, encoder=encoder,
                      head="both", data_dir=tmp_path / "mine")  # fmt: skip


def test_cli_table_has_glfusion_and_every_baseline(setup, capsys):
    """`structattn code-names ablate` with models from folders, shrunk by
    --set, writes table.md / table.json with an F1 for GL-Fusion and each baseline."""
    from structattn.cli import main

    tmp_path, kw = setup
    (llm, tok), (enc, enc_tok) = kw["models"]()
    for model, folder in ((llm, "llm"), (tok, "llm"), (enc, "encoder"), (enc_tok, "encoder")):
        model.save_pretrained(tmp_path / folder)
    rows = ["gcn", "gin", "llm-tree", "llm-code", "glfusion"]
    main(["code-names", "ablate", "--config", str(kw["config"]),
          "--preset", "llm", "--gnn-preset", "gnn", "--seeds", "0", "--rows", *rows,
          "--out-dir", str(tmp_path / "cli"), "--threads", "1", "--no-progress",
          "--set", f"dataset_path={tmp_path / 'ds'}", f"data_dir={tmp_path}",
          f"llm={tmp_path / 'llm'}", f"encoder={tmp_path / 'encoder'}"])  # fmt: skip
    printed = capsys.readouterr().out
    table = json.loads((tmp_path / "cli" / "llm" / "table.json").read_text())
    assert list(table["summary"]["rows"]) == rows
    for row in rows:
        (f1,) = table["summary"]["rows"][row]["test_f1"]
        assert 0.0 <= f1 <= 100.0
    assert set(table["summary"]["comparisons"]) == {f"glfusion - {r}" for r in rows[:-1]}
    assert printed.strip() == (tmp_path / "cli" / "llm" / "table.md").read_text().strip()
    with pytest.raises(SystemExit, match="no finished run"):  # --summary-only trains nothing
        main(["code-names", "ablate", "--config", str(kw["config"]),
              "--preset", "llm", "--gnn-preset", "gnn", "--rows", "gcn", "--summary-only",
              "--out-dir", str(tmp_path / "empty"),
              "--set", f"dataset_path={tmp_path / 'ds'}"])  # fmt: skip


def test_the_papers_form_is_a_row_with_its_own_rates():
    from structattn.experiments.glfusion.code.table import _base_model, _Jobs

    jobs = _Jobs("glfusion-code", "cpu-llm", "cpu-gnn", {}, False, None)
    paper = jobs.resolved("glfusion-paper", 0, None, lr=0.0003)  # a rate tuned for the others
    assert (paper.variant, paper.gate_lr, paper.optim.lr) == ("paper", 0.02, 0.001)
    gated = jobs.resolved("glfusion", 0, None, lr=0.0003)
    assert (gated.variant, gated.optim.lr) == ("gated", 0.0003)
    assert _base_model("glfusion-paper") == "glfusion-paper"
    assert _base_model("no-edge-texts") == "glfusion"

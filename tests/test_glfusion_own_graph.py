"""A new user's own graph from the command line, without a YAML file: save the graph with node
ids, train with flags (paused, then resumed with ``--run-dir X --resume`` alone), score the
baselines on the run's own nodes, predict a node by its id; what the run folder keeps."""

from __future__ import annotations

import contextlib
import io
import json
import random
import warnings

import pytest
import torch
from helpers import WORDS, tiny_glfusion_models, tiny_llama

from structattn.errors import ConfigError

#: train's flags for the tiny models: 10 / 4 / 5 targets of the 20 / 8 / 12 nodes of the splits
FLAGS = ["--max-nodes", "4", "--text-tokens", "8", "--lora-r", "2", "--lora-alpha", "4",
         "--max-train", "10", "--max-val", "4", "--max-test", "5", "--eval-batch-size", "8",
         "--baseline-epochs", "2"]  # fmt: skip
BUDGET = ["--train.max-steps", "4", "--train.eval-every", "2", "--train.batch-size", "2"]


def _graph(n=40, seed=0):
    """A tree of ``n`` nodes with node ids ``pkg:<i>`` and a relation text on every edge."""
    from torch_geometric.data import Data

    from structattn.data.graphs import TextAttributedGraph

    rng = random.Random(seed)
    src, dst = list(range(1, n)), [rng.randrange(i) for i in range(1, n)]
    data = Data(edge_index=torch.tensor([src, dst]), y=torch.tensor([i % 3 for i in range(n)]),
                num_nodes=n)  # fmt: skip
    split = {"train": torch.arange(0, 20), "val": torch.arange(20, 28), "test": torch.arange(28, n)}
    texts = [" ".join(rng.choice(WORDS) for _ in range(4)) for _ in range(n)]
    return TextAttributedGraph.from_pyg(
        data, texts, ["alpha", "beta", "gamma"], split=split, name="mine",
        edge_texts=["cites"] * (n - 1), node_ids=[f"pkg:{i}" for i in range(n)],
    )  # fmt: skip


def _cli(args: list[str]) -> tuple[str, str]:
    """``structattn glfusion ARGS`` in this process: its stdout and stderr."""
    from structattn.experiments.glfusion.commands import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        main(args)
    return out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def journey(tmp_path_factory):
    """Model folders, the saved graph, and a run trained by flags: paused at step 2, then
    resumed by ``--run-dir X --resume`` alone."""
    root = tmp_path_factory.mktemp("own")
    mp = pytest.MonkeyPatch()
    mp.setenv("STRUCTATTN_DATA_DIR", str(root / "user-data"))
    (llm, tok), (enc, enc_tok) = tiny_glfusion_models(root)
    llm.save_pretrained(root / "llm")  # a folder, as a user's LLM is (peft then knows its path)
    tok.save_pretrained(root / "llm")
    enc.save_pretrained(root / "enc")
    enc_tok.save_pretrained(root / "enc")
    _graph().save(root / "graph")
    data = ["--dataset", "file", "--graph-path", str(root / "graph"), "--llm", str(root / "llm"),
            "--encoder", str(root / "enc"), *FLAGS]  # fmt: skip
    run = root / "runs" / "mine"
    (root / "elsewhere").mkdir()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mp.chdir(root)  # the first segment names its files relative to its folder, caching in
        relative = ["--dataset", "file", "--graph-path", "graph", "--llm", "llm", "--encoder",
                    "enc", *FLAGS, "--data-dir", "theirs"]  # fmt: skip
        paused, first = _cli(["train", *relative, *BUDGET, "--train.stop-at", "2",
                              "--run-dir", str(run)])  # fmt: skip
        theirs = sorted((root / "theirs").rglob("*"))
        mp.chdir(root / "elsewhere")  # resumed from another folder, as someone handed the run
        table, second = _cli(["train", "--run-dir", str(run), "--resume"])
    yield {"root": root, "run": run, "data": data, "stderr": (first, second), "paused": paused,
           "table": table, "warnings": [str(w.message) for w in caught],
           "theirs": theirs}  # fmt: skip
    mp.undo()


def test_a_resumed_run_finds_its_files_from_anywhere_and_caches_in_the_callers_folder(journey):
    """Relative --graph-path/--llm/--encoder are saved absolute; resuming from the run folder
    alone caches encodings in the caller's data folder, never in the one the config names."""
    root = journey["root"]
    saved = (journey["run"] / "config.yaml").read_text()
    for name in ("graph", "llm", "enc"):
        assert f"{root / name}\n" in saved
    assert journey["theirs"] and sorted((root / "theirs").rglob("*")) == journey["theirs"]
    assert any((root / "user-data" / "encodings").glob("*.keys.json"))


def test_own_graph_trains_by_flags_resumes_alone_and_says_what_it_leaves_out(journey):
    assert json.loads(journey["paused"])["paused_at"] == 2
    final = json.loads((journey["run"] / "final.json").read_text())
    assert final["best_step"] in (2, 4) and "GL-Fusion ensemble" in journey["table"]
    for err in journey["stderr"]:  # each segment says so once, at its start
        assert err.count("carries edge texts") == 1 and "--edge-texts" in err
        assert err.count("scoring a seeded sample") == 1
        assert "4 of the 8 val nodes" in err and "5 of the 12 test nodes" in err
        assert "--max-val 8 --max-test 12" in err
    # the run records both counts and the nodes it scored, as indices and node ids
    assert final["targets"] == {"train": 10, "val": 4, "test": 5}
    assert final["split_sizes"] == {"train": 20, "val": 8, "test": 12}
    test = final["test_nodes"]
    assert len(test["indices"]) == 5 and set(test["indices"]) <= set(range(28, 40))
    assert test["ids"] == [f"pkg:{i}" for i in test["indices"]]
    assert len(final["val_nodes"]["ids"]) == 4
    assert "of the splits' {'train': 20, 'val': 8, 'test': 12} nodes" in journey["table"]
    # peft's read of a deprecated transformers property is silenced, nothing else
    assert not [w for w in journey["warnings"] if "is_gradient_checkpointing" in w]
    assert not [w for w in journey["warnings"] if "save_embedding_layers" in w]


def test_baselines_score_the_runs_own_nodes_and_refuse_a_run_of_other_nodes(journey):
    root, run = journey["root"], journey["run"]
    final = json.loads((run / "final.json").read_text())
    out_dir = root / "tables"
    table, err = _cli(["baselines", *journey["data"], "--against", str(run),
                       "--out-dir", str(out_dir)])  # fmt: skip
    saved = json.loads((out_dir / "quick" / "baselines.json").read_text())
    scored = saved["per_seed"]["0"]
    assert scored["test_nodes"] == final["test_nodes"] and scored["val_nodes"] == final["val_nodes"]
    assert saved["nodes_checked"] == [0] and saved["full_ensemble"]["0"] == pytest.approx(
        100 * final["heads"]["test"]["ensemble"]
    )
    assert f"5 of 12 test nodes ({', '.join(final['test_nodes']['ids'][:3])}, ..." in table
    assert "The same test and validation nodes as" in table and "one seed: no interval" in table
    assert err.count("carries edge texts") == 1
    # --run-dir RUN alone: the run's own config, the same nodes
    table, _ = _cli(["baselines", "--run-dir", str(run), "--against", str(run),
                     "--out-dir", str(out_dir)])  # fmt: skip
    (folder,) = [p for p in out_dir.iterdir() if p.name.startswith(f"{run.parent.name}-mine-")]
    again = json.loads((folder / "baselines.json").read_text())["per_seed"]["0"]
    assert again["test_nodes"] == final["test_nodes"] and again["baselines"] == scored["baselines"]
    # other flags (quick's max_test 120: all 12 test nodes) are refused, in one line
    other = list(journey["data"])
    other[other.index("--max-test") + 1] = "120"
    with pytest.raises(ConfigError, match="scored other test nodes") as err:
        _cli(["baselines", *other, "--against", str(run), "--out-dir", str(out_dir)])
    assert "\n" not in str(err.value) and "5 there, 12 here, 5 in common" in str(err.value)
    with pytest.raises(ConfigError, match=r"seeds \[0\], none among the seeds scored here \[3\]"):
        _cli(["baselines", *journey["data"], "--seed", "3", "--against", str(run)])


def test_predict_by_node_id_and_the_run_folder_keeps_no_copy_of_the_frozen_llm(journey):
    from safetensors import safe_open

    from structattn.experiments.glfusion import predict_nodes

    run = journey["run"]
    out, _ = _cli(["predict", str(run), "--nodes", "pkg:3"])
    row = json.loads(out)
    assert (row["node"], row["node_id"], row["true"]) == (3, "pkg:3", "alpha")
    # best/ reloads exactly: predicting the run's test nodes gives its test accuracy
    final = json.loads((run / "final.json").read_text())
    rows = predict_nodes(run, final["test_nodes"]["ids"])
    hits = [r["predicted"] == r["true"] for r in rows]
    assert sum(hits) / len(hits) == pytest.approx(final["heads"]["test"]["ensemble"])

    def keys(path):
        with safe_open(str(path), "pt") as f:
            return set(f.keys())

    # best/adapter holds the LoRA weights alone (no copy of the resized embedding / LM head)
    adapter = keys(run / "best" / "adapter" / "adapter_model.safetensors")
    assert adapter and all(".lora_A." in k or ".lora_B." in k for k in adapter)
    # checkpoints and best.safetensors hold what trains: LoRA and the GL-Fusion modules
    for path in [*(run / "checkpoints").glob("step-*/model.safetensors"), run / "best.safetensors"]:
        saved = keys(path)
        assert all(".lora_A." in k or ".lora_B." in k or k.startswith("glf_") for k in saved)
        assert {k.split(".")[0] for k in saved} >= {"glf_node_proj", "glf_gnn_head", "base"}
    modules = keys(run / "best" / "glfusion_modules.safetensors")
    assert {"base_rows.embed_tokens", "base_rows.lm_head"} <= modules  # the graph tokens' rows


def test_the_notes_name_only_what_a_run_leaves_out():
    import dataclasses

    from structattn.experiments.glfusion import build_glfusion_config
    from structattn.experiments.glfusion.run import edge_text_notice
    from structattn.experiments.glfusion.targets import cut_notice, split_targets

    g = _graph()
    cfg = build_glfusion_config({"dataset": "file", "graph_path": "unused", "max_val": 8,
                                 "max_test": 12})  # fmt: skip
    assert "--edge-texts" in edge_text_notice(g, cfg)
    assert edge_text_notice(g, dataclasses.replace(cfg, edge_texts=True)) is None
    assert edge_text_notice(dataclasses.replace(g, edge_texts=None), cfg) is None
    assert cut_notice(g, split_targets(g, cfg)) is None  # every val and test node scored
    note = cut_notice(g, split_targets(g, dataclasses.replace(cfg, max_test=5)))
    assert "5 of the 12 test nodes" in note and "val" not in note and "--max-test 12" in note


def test_quiet_library_warnings_silences_only_the_listed_library_warnings():
    from structattn.glfusion.loading import quiet_library_warnings

    model = tiny_llama(16, layers=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with quiet_library_warnings():
            assert model.is_gradient_checkpointing is False  # transformers' deprecated alias
            warnings.warn("`is_gradient_checkpointing` is deprecated (ours)", FutureWarning, 1)
            warnings.warn("a warning of the project's own", UserWarning, 1)
        model.is_gradient_checkpointing  # noqa: B018 (outside the block it warns again)
    shown = [str(w.message) for w in caught]
    assert shown[:2] == ["`is_gradient_checkpointing` is deprecated (ours)",
                         "a warning of the project's own"]  # fmt: skip
    assert len(shown) == 3 and "is_activation_checkpointing" in shown[2]

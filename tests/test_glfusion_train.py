"""GL-Fusion training end to end on tiny models and a generated WordNet-format graph."""

from __future__ import annotations

import json
import random

import pytest
import torch
from helpers import WORDS, tiny_glfusion_models, write_wordnet

from structattn.data.graphs import WORDNET_NOUN_CLASSES
from structattn.experiments.glfusion import build_glfusion_config, train_glfusion

TINY = dict(
    dataset="wordnet",
    max_nodes=4,
    text_tokens=8,
    lora_r=2,
    lora_alpha=4,
)


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """predict and generate cache encodings in the user's data folder, never the run's: here a
    folder of the test's own."""
    monkeypatch.setenv("STRUCTATTN_DATA_DIR", str(tmp_path / "user-cache"))


def tiny_cfg(tmp_path, train, **kw):
    """A tiny GL-Fusion config on the generated graph in ``tmp_path / "data"``."""
    return build_glfusion_config({**TINY, "data_dir": tmp_path / "data", **kw, "train": train})


def test_tiny_glfusion_train_and_eval(tmp_path):
    write_wordnet(tmp_path / "data" / "wordnet" / "data.noun")
    llm, encoder = tiny_glfusion_models(tmp_path)
    cfg = tiny_cfg(
        tmp_path,
        {"max_steps": 6, "batch_size": 3, "eval_every": 3},
        max_train=12,
        max_val=6,
        max_test=6,
        eval_batch_size=6,
        baseline_epochs=20,
        run_dir=tmp_path / "run",
    )
    results = train_glfusion(cfg, progress=False, llm=llm, encoder=encoder)
    assert set(results["baselines"]) == {"mlp", "graphsage", "mlp+labels", "graphsage+labels",
                                         "neighbour-vote", "label-propagation"}  # fmt: skip
    assert results["stand_in"] and results["targets"] == {"train": 12, "val": 6, "test": 6}
    run = tmp_path / "run"
    table = (run / "results.md").read_text()
    assert "GraphSAGE" in table and "(stand-in)" in table and "label propagation" in table
    assert "78.20" not in table and "paper" not in table  # the paper's figures are ogbn-arxiv
    val_rows = [r.split(",") for r in (run / "metrics.csv").read_text().splitlines()[1:]]
    val = [(int(r[0]), float(r[3])) for r in val_rows if r[1] == "val"]
    assert [step for step, _ in val] == [3, 6]
    best, best_acc = max(val, key=lambda sv: (sv[1], -sv[0]))  # the first best evaluation
    assert json.loads((run / "final.json").read_text())["best_step"] == best
    # validation picks the best weights by what is reported (both heads trained: their
    # ensemble, its weight chosen on validation); the report scores those weights again
    assert results["heads"]["val"]["ensemble"] == pytest.approx(best_acc)
    assert (run / "best" / "adapter" / "adapter_model.safetensors").is_file()
    assert any((run / "checkpoints").glob("step-*/model.safetensors"))
    rows = (run / "metrics.csv").read_text().splitlines()
    assert len([r for r in rows if ",train," in r]) == 6


def test_validation_scores_what_the_run_reports(tmp_path, monkeypatch):
    """The checkpoint metric is the reported number: the ensemble when both heads train (not
    the GNN head alone, which can sit far below it), the LM head or the GNN head alone."""
    from types import SimpleNamespace

    from structattn.experiments.glfusion import run as run_mod

    probs = {"gnn": torch.tensor([[0.9, 0.1]] * 3),  # always class 0: 1 of 3 right
             "lm": torch.tensor([[0.2, 0.8], [0.2, 0.8], [0.8, 0.2]]),  # 3 of 3
             "classes": torch.tensor([1, 1, 0])}  # fmt: skip
    monkeypatch.setattr(run_mod, "head_probabilities", lambda *a, **k: probs)
    monkeypatch.setattr(run_mod, "gnn_accuracy", lambda *a, **k: 1 / 3)

    def acc(heads, weight=None):
        cfg = SimpleNamespace(heads=heads, ensemble_weight=weight, eval_batch_size=3,
                              train=SimpleNamespace(eval_batches=None))  # fmt: skip
        task = SimpleNamespace(
            cfg=cfg,
            examples={"val": [0, 1, 2]},
            encode=None,
            label_choices=None,
            engine=SimpleNamespace(run_dir=tmp_path),
        )
        return run_mod.NodeClassification.validate(task, None)["acc"]

    assert acc("both") == pytest.approx(1.0)  # the weight chosen on validation lets the LM lead
    assert acc("both", weight=1.0) == pytest.approx(1 / 3)  # a fixed weight is kept
    assert acc("lm") == pytest.approx(1.0) and acc("gnn") == pytest.approx(1 / 3)


def test_glfusion_resume_is_exact(tmp_path):
    """6 straight steps == 3 steps, pause, resume 3 more (trainable weights bit-identical)."""
    from safetensors.torch import load_file

    write_wordnet(tmp_path / "data" / "wordnet" / "data.noun")
    common = dict(max_train=12, max_val=4, max_test=4, eval_batch_size=4, baseline_epochs=5)
    budget = {"max_steps": 6, "batch_size": 3, "eval_every": 2}

    def run(stop_at=None, **kw):
        llm, encoder = tiny_glfusion_models(tmp_path)
        cfg = tiny_cfg(tmp_path, {**budget, "stop_at": stop_at}, **common, **kw)
        return train_glfusion(cfg, progress=False, llm=llm, encoder=encoder)

    straight = run(run_dir=tmp_path / "a")
    assert run(run_dir=tmp_path / "b", stop_at=3)["paused_at"] == 3
    resumed = run(run_dir=tmp_path / "b", resume=True)
    a = load_file(str(tmp_path / "a" / "checkpoints" / "step-00000006" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "checkpoints" / "step-00000006" / "model.safetensors"))
    assert a.keys() == b.keys() and len(a) > 0
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert resumed["heads"] == straight["heads"] and resumed["best_step"] == straight["best_step"]


def test_glfusion_trains_with_a_bfloat16_llm_and_gradient_checkpointing(tmp_path):
    write_wordnet(tmp_path / "data" / "wordnet" / "data.noun")
    llm, encoder = tiny_glfusion_models(tmp_path)
    cfg = tiny_cfg(
        tmp_path,
        {"max_steps": 2, "batch_size": 3, "eval_every": 2},
        max_train=6,
        max_val=3,
        max_test=3,
        eval_batch_size=3,
        baseline_epochs=2,
        llm_dtype="bfloat16",
        gradient_checkpointing=True,
        run_dir=tmp_path / "run",
    )
    results = train_glfusion(cfg, progress=False, llm=llm, encoder=encoder)
    base = llm[0]
    assert base.model.embed_tokens.weight.dtype == torch.bfloat16
    assert base.model.layers[0].gradient_checkpointing
    assert results["skipped_steps"] == 0 and results["best_step"] == 2


def _custom_pyg_graph(n=30, seed=0):
    from torch_geometric.data import Data

    rng = random.Random(seed)
    src = list(range(1, n))
    dst = [rng.randrange(i) for i in range(1, n)]
    y = torch.tensor([i % 3 for i in range(n)])
    masks = {k: torch.zeros(n, dtype=torch.bool) for k in ("train", "val", "test")}
    for i in range(n):
        masks[("train", "train", "val", "test")[i % 4]][i] = True
    data = Data(edge_index=torch.tensor([src, dst]), y=y, num_nodes=n)
    for k, m in masks.items():
        data[f"{k}_mask"] = m
    texts = [" ".join(rng.choice(WORDS) for _ in range(4)) for _ in range(n)]
    return data, texts


def test_your_own_graph_from_pyg_trains_directly_and_from_disk(tmp_path):
    from structattn.data.graphs import TextAttributedGraph

    data, texts = _custom_pyg_graph()
    graph = TextAttributedGraph.from_pyg(data, texts, ["animal", "plant", "food"], name="toy")
    assert graph.num_nodes == 30 and not graph.stand_in
    assert sorted(torch.cat(list(graph.splits.values())).tolist()) == list(range(30))
    graph.save(tmp_path / "toy")
    again = TextAttributedGraph.load(tmp_path / "toy")
    assert again.node_texts == texts and torch.equal(again.edge_index, graph.edge_index)
    assert {k: v.tolist() for k, v in again.splits.items()} == {
        k: v.tolist() for k, v in graph.splits.items()
    }
    llm, encoder = tiny_glfusion_models(tmp_path)
    train = {"max_steps": 2, "batch_size": 2, "eval_every": 2}
    common = dict(max_train=4, max_val=3, max_test=3, eval_batch_size=3, baseline_epochs=5)
    direct = train_glfusion(
        tiny_cfg(tmp_path, train, **common, run_dir=tmp_path / "a"),
        progress=False, llm=llm, encoder=encoder, graph=graph,
    )  # fmt: skip
    llm, encoder = tiny_glfusion_models(tmp_path)
    cfg = tiny_cfg(tmp_path, train, **common, run_dir=tmp_path / "b", dataset="file",
                   graph_path=tmp_path / "toy")  # fmt: skip
    from_disk = train_glfusion(cfg, progress=False, llm=llm, encoder=encoder)
    assert direct["dataset"] == from_disk["dataset"] == "toy"
    assert direct["heads"] == from_disk["heads"]


def test_from_pyg_names_bad_input():
    import pytest

    from structattn.data.graphs import TextAttributedGraph

    data, texts = _custom_pyg_graph()
    names = ["animal", "plant", "food"]
    cases = [
        (dict(texts=texts[:-1]), "29 texts for 30 nodes"),
        (dict(texts=texts[:3] + [" "] + texts[4:]), r"node\(s\) \[3\] have no text"),
        (dict(label_names=names[:2]), "labels outside 0..1"),
        (dict(split={"train": torch.tensor([0]), "val": torch.tensor([1])}), "no 'test'"),
        (
            dict(
                split={
                    "train": torch.tensor([0]),
                    "val": torch.tensor([99]),
                    "test": torch.tensor([2]),
                }
            ),
            "outside 0..29",
        ),  # fmt: skip
    ]
    for kwargs, match in cases:
        args = {"data": data, "texts": texts, "label_names": names, **kwargs}
        with pytest.raises(ValueError, match=match):
            TextAttributedGraph.from_pyg(**args)
    bad = data.clone()
    bad.edge_index = torch.tensor([[0, 1], [1, 30]])
    with pytest.raises(ValueError, match="outside 0..29"):
        TextAttributedGraph.from_pyg(bad, texts, names)
    bad = data.clone()
    del bad.test_mask
    with pytest.raises(ValueError, match="no test_mask"):
        TextAttributedGraph.from_pyg(bad, texts, names)
    from torch_geometric.data import Data

    with pytest.raises(ValueError, match="zero nodes"):
        TextAttributedGraph.from_pyg(Data(num_nodes=0), [], names)


def test_recipe_trains_end_to_end(tmp_path):
    write_wordnet(tmp_path / "data" / "wordnet" / "data.noun")
    llm, encoder = tiny_glfusion_models(tmp_path)
    cfg = tiny_cfg(
        tmp_path,
        {"max_steps": 3, "batch_size": 2, "eval_every": 3},
        max_train=6,
        max_val=4,
        max_test=4,
        eval_batch_size=4,
        baseline_epochs=5,
        run_dir=tmp_path / "run",
        message_passing_norm=True,
        target_marker=True,
        lm_loss="labels",
        gate_lr=0.05,
        module_lr=1e-3,
        head_lr=1e-3,
        ensemble_weight=None,
    )
    results = train_glfusion(cfg, progress=False, llm=llm, encoder=encoder)
    assert results["ensemble_weight_chosen_on_val"] is True
    # the weight is chosen on validation among 0 (the LM head alone) .. 1 (the GNN head alone):
    # the ensemble it gives on validation is at least as good as either head there
    val = results["heads"]["val"]
    assert val["ensemble"] >= max(val["gnn"], val["lm"]) - 1e-9
    saved = json.loads((tmp_path / "run" / "best" / "glfusion_config.json").read_text())
    assert saved["target_marker"] and saved["message_passing_norm"]
    rows = (tmp_path / "run" / "metrics.csv").read_text().splitlines()
    assert len([r for r in rows if ",train," in r]) == 3


def test_label_aware_baselines_use_neighbour_labels_and_never_the_targets_own():
    from structattn.data.graphs import TextAttributedGraph
    from structattn.experiments.glfusion import run_baselines

    n, K = 240, 4
    g = torch.Generator().manual_seed(0)
    y = torch.arange(n) % K
    order = torch.argsort(y * n + torch.randperm(n, generator=g))  # nodes grouped by class
    noise = torch.randn(n, 8, generator=g)  # text that says nothing about the class
    perm = torch.randperm(n, generator=g).tolist()
    targets = {"train": perm[:120], "val": perm[120:180], "test": perm[180:]}

    def make(edges):
        return TextAttributedGraph(
            name="t", node_texts=["x"] * n, labels=y, label_names=list("abcd"),
            edge_index=edges, splits={"train": torch.tensor(targets["train"])}, source="t",
            stand_in=True,
        )  # fmt: skip

    # homophilous: a ring through each class's nodes
    src, dst = [], []
    for c in range(K):
        members = order[y[order] == c]
        src += members.tolist()
        dst += members.roll(1).tolist()
    homo = run_baselines(make(torch.tensor([src, dst])), list(range(n)), noise, targets, 60, 0)
    # a val node sees a labelled neighbour with probability 3/4 (two ring neighbours, half train)
    assert homo["graphsage+labels"]["val"] > 0.7 and homo["mlp+labels"]["val"] > 0.7
    assert homo["mlp"]["val"] < 0.45  # chance is 0.25
    # no edges: a node's own label is the only label it could see, and it never does
    alone = run_baselines(make(torch.zeros(2, 0, dtype=torch.long)), list(range(n)), noise,
                          targets, 60, 0)  # fmt: skip
    assert alone["graphsage+labels"]["val"] < 0.45 and alone["mlp+labels"]["val"] < 0.45


def test_predict_new_nodes_from_a_saved_run(tmp_path, capsys):
    from structattn.experiments.glfusion import predict_nodes

    write_wordnet(tmp_path / "data" / "wordnet" / "data.noun")
    llm, encoder = tiny_glfusion_models(tmp_path)
    cfg = tiny_cfg(
        tmp_path,
        {"max_steps": 2, "batch_size": 2, "eval_every": 2},
        max_train=4, max_val=3, max_test=3, eval_batch_size=3, baseline_epochs=2,
        run_dir=tmp_path / "run",
    )  # fmt: skip
    results = train_glfusion(cfg, progress=False, llm=llm, encoder=encoder)
    fresh_llm, _ = tiny_glfusion_models(tmp_path)  # the same base weights (seeded), as from disk
    # the saved run predicts its own test targets as its evaluation did
    from structattn.experiments.glfusion import load_graph, sample_targets

    test_nodes = sample_targets(load_graph(cfg), "test", 3, cfg.seed)
    test_rows = predict_nodes(tmp_path / "run", test_nodes, llm=fresh_llm, encoder=encoder)
    hits = sum(r["predicted"] == r["true"] for r in test_rows) / 3
    assert abs(hits - results["heads"]["test"]["ensemble"]) < 1e-9
    from structattn.experiments.glfusion import generate_about_node

    texts = [
        generate_about_node(
            tmp_path / "run",
            5,
            "What is this node about?",
            llm=tiny_glfusion_models(tmp_path)[0],
            encoder=encoder,
            max_new_tokens=4,
        )  # fmt: skip
        for _ in range(2)
    ]
    assert isinstance(texts[0], str) and texts[0] == texts[1]  # greedy: the same text
    fresh_llm, _ = tiny_glfusion_models(tmp_path)
    rows = predict_nodes(tmp_path / "run", [0, 5, 47], llm=fresh_llm, encoder=encoder)
    assert [r["node"] for r in rows] == [0, 5, 47]
    for r in rows:
        assert abs(sum(r["ensemble"]) - 1) < 1e-5 and r["ensemble_weight"] == 0.5
        assert r["predicted"] in [n.removeprefix("noun.") for n in WORDNET_NOUN_CLASSES]
    # deterministic: the same run and node give the same distributions
    again = predict_nodes(
        tmp_path / "run", [0], llm=tiny_glfusion_models(tmp_path)[0], encoder=encoder
    )
    assert again[0]["gnn"] == rows[0]["gnn"]
    import pytest

    from structattn.errors import ConfigError, RunError

    with pytest.raises(ConfigError, match=r"nodes \[10000\] are not in the graph"):
        predict_nodes(tmp_path / "run", [10_000], llm=fresh_llm, encoder=encoder)
    with pytest.raises(RunError, match="not found"):
        predict_nodes(tmp_path / "nowhere", [0])


def test_glfusion_ablations_one_table(tmp_path):
    import shutil

    import pytest

    from structattn.errors import RunError
    from structattn.experiments.glfusion import ablate_glfusion

    write_wordnet(tmp_path / "data" / "wordnet" / "data.noun")
    tiny = dict(TINY, data_dir=tmp_path / "data", max_train=4, max_val=3, max_test=3,
                eval_batch_size=3, baseline_epochs=3,
                train={"max_steps": 2, "batch_size": 2, "eval_every": 2})  # fmt: skip
    calls = []

    def models():
        calls.append(1)
        return tiny_glfusion_models(tmp_path)

    variants = ("no-message-passing", "lm-head-only", "gnn-head-only")
    out = ablate_glfusion("recipe", (0, 1), tmp_path / "abl", variants, False, models, **tiny)
    assert len(calls) == 8  # full + 3 variants, 2 seeds
    table = (tmp_path / "abl" / "recipe" / "ablations.md").read_text()
    for name in ("GL-Fusion full", "no-message-passing", "lm-head-only", "GraphSAGE + training"):
        assert name in table
    assert out["best_label_baseline"] in ("mlp+labels", "graphsage+labels")
    runs = out["runs"]
    assert runs["lm-head-only"]["0"]["ensemble_weight"] == 0.0
    assert runs["gnn-head-only"]["1"]["ensemble_weight"] == 1.0
    rows = {line.split(" | ")[0]: line.split(" | ") for line in table.splitlines()}
    assert rows["| GL-Fusion lm-head-only"][3] == "(not trained)"  # its GNN head column
    assert rows["| GL-Fusion gnn-head-only"][4] == "(not trained)"  # its LM head column
    assert "(not trained)" not in rows["| GL-Fusion full"]
    saved = json.loads((tmp_path / "abl/recipe/no-message-passing/seed0/best/glfusion_config.json")
                       .read_text())  # fmt: skip
    assert saved["message_passing_layers"] == []
    again = ablate_glfusion("recipe", (0, 1), tmp_path / "abl", variants, False, models, **tiny)
    assert len(calls) == 8 and again["table"] == out["table"]  # finished runs are kept
    # a later call asking for fewer variants adds nothing and drops nothing: the table is the
    # union of the finished runs in its folder
    fewer = ablate_glfusion("recipe", (0,), tmp_path / "abl", ("lm-head-only",), False, models,
                            **tiny)  # fmt: skip
    assert len(calls) == 8 and fewer["table"] == out["table"] and fewer["seeds"] == [0, 1]
    # every ablation against the full model, paired by seed, with its own row
    diffs = out["ablation_minus_full"]
    assert set(diffs) == set(variants)
    for v in variants:
        ens = [runs[v][str(s)]["heads"]["test"]["ensemble"] * 100 for s in (0, 1)]
        ref = [runs["full"][str(s)]["heads"]["test"]["ensemble"] * 100 for s in (0, 1)]
        assert diffs[v]["mean"] == pytest.approx(sum(a - b for a, b in zip(ens, ref)) / 2)
        assert f"GL-Fusion {v} − full (ensemble)" in table

    # summary only: trains nothing, tables what finished, says which seeds each row has
    shutil.rmtree(tmp_path / "abl/recipe/gnn-head-only")
    (tmp_path / "abl/recipe/lm-head-only/seed1/final.json").unlink()
    part = ablate_glfusion("recipe", (0, 1), tmp_path / "abl", variants, False, models,
                           train_missing=False, **tiny)  # fmt: skip
    assert len(calls) == 8
    assert "| GL-Fusion gnn-head-only | none finished |" in part["table"]
    assert "| GL-Fusion lm-head-only | 0 |" in part["table"]
    assert "one seed: no interval" in part["table"]
    assert "gnn-head-only" not in part["ablation_minus_full"]
    shutil.rmtree(tmp_path / "abl/recipe/full")
    with pytest.raises(RunError, match="full model"):
        ablate_glfusion("recipe", (0, 1), tmp_path / "abl", variants, False, models,
                        train_missing=False, **tiny)  # fmt: skip


def test_a_graph_of_ones_own_with_unlabelled_nodes_trains_and_every_command_reads_the_run(
    tmp_path,
):
    """Nodes outside every split may be unlabelled (-1): they are context, never targets and
    never shown with a label; the baselines run; the graph given from Python is saved into the
    run folder and its config points there, so prediction works on the run alone."""
    from structattn.data.graphs import read_wordnet_nouns
    from structattn.experiments.glfusion import predict_nodes

    write_wordnet(tmp_path / "data" / "wordnet" / "data.noun")
    g = read_wordnet_nouns(tmp_path / "data" / "wordnet" / "data.noun", seed=0)
    dropped = g.splits["train"][-8:]  # out of every split, and unlabelled
    g.splits["train"] = g.splits["train"][:-8]
    g.labels = g.labels.clone()
    g.labels[dropped] = -1
    g.validate()
    llm, encoder = tiny_glfusion_models(tmp_path)
    cfg = tiny_cfg(tmp_path, {"max_steps": 2, "batch_size": 2, "eval_every": 2}, max_train=6,
                   max_val=4, max_test=4, eval_batch_size=4, baseline_epochs=3,
                   run_dir=tmp_path / "own")  # fmt: skip
    results = train_glfusion(cfg, progress=False, llm=llm, encoder=encoder, graph=g)
    assert 0.0 <= results["baselines"]["label-propagation"]["test"] <= 1.0
    assert (tmp_path / "own" / "curves.png").is_file()  # the learning curves of the run
    saved = (tmp_path / "own" / "config.yaml").read_text()
    assert "dataset: file" in saved and str(tmp_path / "own" / "graph") in saved
    fresh_llm, _ = tiny_glfusion_models(tmp_path)
    node = int(dropped[0])
    (row,) = predict_nodes(tmp_path / "own", [node], llm=fresh_llm, encoder=encoder)
    assert row["node"] == node and abs(sum(row["ensemble"]) - 1) < 1e-5 and row["true"] is None
    (by_id,) = predict_nodes(
        tmp_path / "own", [g.node_ids[node]], llm=tiny_glfusion_models(tmp_path)[0], encoder=encoder
    )  # a node named by its id, as printed
    assert (by_id["node"], by_id["node_id"], by_id["gnn"]) == (node, g.node_ids[node], row["gnn"])
    # a node the run never saw: its text and an edge, no label
    import dataclasses

    from structattn.errors import ConfigError

    n = g.num_nodes
    new = dataclasses.replace(
        g,
        node_texts=[*g.node_texts, "a new node about alpha and beta"],
        labels=torch.cat([g.labels, torch.tensor([-1])]),
        edge_index=torch.cat([g.edge_index, torch.tensor([[n], [0]])], 1),
        edge_texts=None,
        node_ids=[],
    )
    fresh_llm, _ = tiny_glfusion_models(tmp_path)
    (row,) = predict_nodes(tmp_path / "own", [n], llm=fresh_llm, encoder=encoder, graph=new,
                           top_k=2)  # fmt: skip
    assert row["true"] is None and row["predicted"] == row["top"]["ensemble"][0][0]
    assert [len(row["top"][h]) for h in ("ensemble", "gnn", "lm")] == [2, 2, 2]
    assert row["top"]["gnn"][0][1] >= row["top"]["gnn"][1][1]
    other = dataclasses.replace(new, label_names=[*g.label_names, "extra"])
    with pytest.raises(ConfigError, match="label names but the run's GNN head"):
        predict_nodes(tmp_path / "own", [n], llm=fresh_llm, encoder=encoder, graph=other)


def test_the_neighbour_vote_reads_only_the_labels_a_prompt_shows():
    from types import SimpleNamespace

    from structattn.experiments.glfusion.baselines import neighbour_vote

    # nodes 0-3 train (labels 0, 0, 1, 1), 4 val (label 1), 5 test (label 0), 6 unlabelled
    graph = SimpleNamespace(
        label_names=["a", "b"], num_nodes=7, labels=torch.tensor([0, 0, 1, 1, 1, 0, -1]),
        splits={"train": torch.tensor([0, 1, 2, 3]), "val": torch.tensor([4]),
                "test": torch.tensor([5])},
    )  # fmt: skip
    ex = lambda target, nodes, y: SimpleNamespace(nodes=torch.tensor([target, *nodes]), label=y)  # noqa: E731
    examples = {"val": [ex(4, [2, 3, 6, 5], 1)], "test": [ex(5, [2, 0, 1, 4], 0)]}
    assert neighbour_vote(graph, examples, show_labels=True) == {"val": 1.0, "test": 1.0}
    # without labels shown every target gets the training majority (a tie: the prior's argmax)
    hidden = neighbour_vote(graph, examples, show_labels=False)
    assert hidden["val"] + hidden["test"] == 1.0


def test_baselines_over_seeds_without_training_and_against_an_ablation(tmp_path):
    from structattn.experiments.glfusion.label_baselines import (
        baselines_over_seeds,
        baselines_table,
    )

    write_wordnet(tmp_path / "data" / "wordnet" / "data.noun")
    ablations = tmp_path / "ablations.json"
    full = {str(s): {"heads": {"test": {"ensemble": e}}} for s, e in ((0, 0.9), (1, 0.8))}
    ablations.write_text(json.dumps({"runs": {"full": full}}))
    kw = {**TINY, "data_dir": tmp_path / "data", "max_train": 6, "max_val": 4, "max_test": 4,
          "baseline_epochs": 3}  # fmt: skip
    out = baselines_over_seeds("quick", (0, 1), against=ablations,
                               models=lambda: tiny_glfusion_models(tmp_path), **kw)  # fmt: skip
    vote = [out["per_seed"][s]["baselines"]["neighbour-vote"]["test"] for s in (0, 1)]
    d = out["full_minus"]["neighbour-vote"]
    assert d["seeds"] == [0, 1]
    assert d["mean"] == pytest.approx(((90 - 100 * vote[0]) + (80 - 100 * vote[1])) / 2)
    table = baselines_table(out)
    assert "majority of the labels the prompt shows" in table and "95% interval" in table


def test_the_example_graph_of_the_docs_trains_from_its_folder(tmp_path):
    """docs/glfusion.md's example folder (tests/data/tiny-graph: two unlabelled nodes outside
    the splits) trains through ``dataset: file`` and its nodes can be predicted."""
    from pathlib import Path

    from structattn.data.graphs import TextAttributedGraph
    from structattn.experiments.glfusion import predict_nodes

    folder = Path(__file__).parent / "data" / "tiny-graph"
    graph = TextAttributedGraph.load(folder)
    assert graph.num_nodes == 12 and (graph.labels == -1).sum() == 2
    llm, encoder = tiny_glfusion_models(tmp_path)
    cfg = tiny_cfg(tmp_path, {"max_steps": 2, "batch_size": 2, "eval_every": 2},
                   dataset="file", graph_path=folder, max_train=6, max_val=2, max_test=2,
                   eval_batch_size=2, baseline_epochs=2, run_dir=tmp_path / "run")  # fmt: skip
    results = train_glfusion(cfg, progress=False, llm=llm, encoder=encoder)
    assert results["dataset"] == "tiny-papers" and results["targets"]["test"] == 2
    fresh_llm, _ = tiny_glfusion_models(tmp_path)
    rows = predict_nodes(tmp_path / "run", [10, 11], llm=fresh_llm, encoder=encoder)
    assert [r["true"] for r in rows] == [None, None]


def test_edge_texts_become_edge_features_end_to_end(tmp_path):
    """WordNet's edges carry their relation; with ``edge_texts`` each edge's text is encoded
    like a node text and fed to message passing (edge_dim = the encoder's width); a graph
    without edge texts is one error."""
    import dataclasses

    from structattn.data.graphs import read_wordnet_nouns
    from structattn.errors import ConfigError
    from structattn.experiments.glfusion import predict_nodes
    from structattn.experiments.glfusion.prompts import build_example, collate_examples
    from structattn.glfusion.configuration import GLFusionConfig

    write_wordnet(tmp_path / "data" / "wordnet" / "data.noun")
    g = read_wordnet_nouns(tmp_path / "data" / "wordnet" / "data.noun", seed=0)
    assert set(g.edge_texts) <= {"hypernym", "instance hypernym"} and g.edge_texts
    u, v = g.edge_index[:, 0].tolist()
    assert g.edge_text(u, v) == g.edge_texts[0] and g.edge_text(v, u).startswith("reverse: ")
    llm, encoder = tiny_glfusion_models(tmp_path)
    tok = llm[1]
    ex = build_example(g, u, tok, GLFusionConfig(text_dim=16, num_node_classes=26, variant="paper"),
                       max_nodes=4, edge_texts=True)  # fmt: skip
    assert len(ex.edge_texts) == ex.edge_index.shape[1] > 0
    words = {"hypernym": 1.0, "reverse: hypernym": 2.0}

    def encode(texts):  # a stand-in encoder: one distinct vector per edge relation
        enc = torch.stack([torch.full((3, 16), words.get(t, 0.5)) for t in texts])
        return enc, torch.ones(len(texts), 3, dtype=torch.bool)

    batch = collate_examples([ex], encode)
    expected = torch.tensor([words.get(t, 0.5) for t in ex.edge_texts])
    assert torch.equal(batch["graph"].edge_attr, expected[:, None].expand(-1, 16))
    cfg = tiny_cfg(tmp_path, {"max_steps": 2, "batch_size": 2, "eval_every": 2}, max_train=4,
                   max_val=3, max_test=3, eval_batch_size=3, baseline_epochs=2,
                   run_dir=tmp_path / "run", edge_texts=True)  # fmt: skip
    train_glfusion(cfg, progress=False, llm=llm, encoder=encoder)
    saved = json.loads((tmp_path / "run" / "best" / "glfusion_config.json").read_text())
    assert saved["edge_dim"] == encoder[0].config.hidden_size
    fresh_llm, _ = tiny_glfusion_models(tmp_path)
    (row,) = predict_nodes(tmp_path / "run", [u], llm=fresh_llm, encoder=encoder)
    assert abs(sum(row["ensemble"]) - 1) < 1e-5
    bare = dataclasses.replace(g, edge_texts=None)
    cfg = dataclasses.replace(cfg, run_dir=tmp_path / "bare")
    with pytest.raises(ConfigError, match="has no edge texts"):
        train_glfusion(cfg, progress=False, llm=llm, encoder=encoder, graph=bare)


def test_resuming_with_another_python_graph_is_refused_and_keeps_the_saved_one(tmp_path):
    import dataclasses

    from structattn.data.graphs import TextAttributedGraph, read_wordnet_nouns
    from structattn.errors import RunError

    write_wordnet(tmp_path / "data" / "wordnet" / "data.noun")
    g = read_wordnet_nouns(tmp_path / "data" / "wordnet" / "data.noun", seed=0)
    llm, encoder = tiny_glfusion_models(tmp_path)
    cfg = tiny_cfg(tmp_path, {"max_steps": 2, "batch_size": 2, "eval_every": 1, "stop_at": 1},
                   max_train=4, max_val=2, max_test=2, eval_batch_size=2, baseline_epochs=1,
                   run_dir=tmp_path / "run")  # fmt: skip
    assert "paused_at" in train_glfusion(cfg, progress=False, llm=llm, encoder=encoder, graph=g)
    other = dataclasses.replace(g, node_texts=[t + " changed" for t in g.node_texts])
    resumed = dataclasses.replace(
        cfg, resume=True, train=dataclasses.replace(cfg.train, stop_at=None)
    )
    llm, encoder = tiny_glfusion_models(tmp_path)  # fresh models: the first run wrapped these
    with pytest.raises(RunError, match="the data differs"):
        train_glfusion(resumed, progress=False, llm=llm, encoder=encoder, graph=other)
    saved = TextAttributedGraph.load(tmp_path / "run" / "graph")
    assert saved.node_texts == g.node_texts  # the graph the checkpoints were trained on


def test_a_chat_run_is_scored_predicted_and_asked_in_its_chat_frame(tmp_path, monkeypatch):
    """``chat``: training, evaluation, ``predict`` and ``generate`` all frame the prompt in the
    chat template, the answer closed by the end-of-turn token: predict scores the saved run's
    test targets as its evaluation did, and generate asks inside the training instruction."""
    import pytest

    from structattn.experiments.glfusion import (
        generate_about_node,
        load_graph,
        predict_nodes,
        sample_targets,
    )
    from structattn.experiments.glfusion.prompts import GATED_INSTRUCTION, chat_parts
    from structattn.glfusion import GLFusionForCausalLM

    write_wordnet(tmp_path / "data" / "wordnet" / "data.noun")

    def models():
        (llm, tok), encoder = tiny_glfusion_models(tmp_path)
        tok.eos_token = "[SEP]"
        tok.chat_template = (
            "{% for m in messages %}[CLS] {{ m['content'] }} [SEP]{% endfor %}"
            "{% if add_generation_prompt %} answer :{% endif %}"
        )
        return (llm, tok), encoder

    llm, encoder = models()
    train = {"max_steps": 2, "batch_size": 2, "eval_every": 2}
    with pytest.raises(ValueError, match="chat: .* lm_loss: tokens"):
        tiny_cfg(tmp_path, train, chat=True, lm_loss="labels")
    cfg = tiny_cfg(tmp_path, train, max_train=4, max_val=3, max_test=3, eval_batch_size=3,
                   baseline_epochs=2, run_dir=tmp_path / "run", chat=True)  # fmt: skip
    results = train_glfusion(cfg, progress=False, llm=llm, encoder=encoder)
    test_nodes = sample_targets(load_graph(cfg), "test", 3, cfg.seed)
    rows = predict_nodes(tmp_path / "run", test_nodes, llm=models()[0], encoder=encoder)
    hits = sum(r["predicted"] == r["true"] for r in rows) / 3
    assert abs(hits - results["heads"]["test"]["ensemble"]) < 1e-9
    asked = []
    real = GLFusionForCausalLM.generate

    def spy(self, input_ids, *args, **kwargs):
        asked.append(input_ids[0].tolist())
        return real(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(GLFusionForCausalLM, "generate", spy)
    (llm, tok), _ = models()
    generate_about_node(tmp_path / "run", 5, "what is it ?", llm=(llm, tok), encoder=encoder,
                        max_new_tokens=2)  # fmt: skip
    before, after = chat_parts(tok)
    head = before + tok(GATED_INSTRUCTION, add_special_tokens=False)["input_ids"]
    assert asked[0][: len(head)] == head and asked[0][-len(after) :] == after

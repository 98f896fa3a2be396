"""code-names: method naming from Python syntax trees (structattn.data.code) and its metric."""

from __future__ import annotations

import gzip
import zipfile
from pathlib import Path

import pytest

from structattn.data import code as codemod
from structattn.data.code import (
    MASK,
    build_code_names,
    function_examples,
    load_code_names,
    python_files,
    split_subtokens,
)
from structattn.experiments.glfusion.code.metrics import name_scores

FILES = Path(__file__).parent / "data" / "code"


def _build(**kw):
    projects = {
        "alpha": ("train", python_files(FILES / "alpha")),
        "beta": ("test", python_files(FILES / "beta")),
        "gamma": ("val", python_files(FILES / "gamma")),
    }
    return build_code_names(projects, **{"min_nodes": 1, **kw})


def _one(source: str, qualname: str):
    (ex,) = [
        e for e in function_examples(source, "p", "f.py", min_nodes=1) if e.qualname == qualname
    ]
    return ex


@pytest.mark.parametrize(
    "name, expected",
    [
        ("add_one", ["add", "one"]),
        ("countDown", ["count", "down"]),
        ("get_HTTPResponse", ["get", "http", "response"]),
        ("_to_utf8", ["to", "utf8"]),
        ("HTMLParser2", ["html", "parser2"]),
        ("__private_name", ["private", "name"]),
        ("x", ["x"]),
        ("_", []),
    ],
)
def test_subtokens_split_snake_and_camel_case(name, expected):
    assert split_subtokens(name) == expected


def test_hand_made_function_has_ogb_nodes_and_edges():
    ex = _one("def add_one(value):\n    return value + 1\n", "add_one")
    assert ex.node_types == ["FunctionDef", "arguments", "arg", "Return", "BinOp", "Name",
                             "Load", "Add", "Constant"]  # fmt: skip
    assert ex.node_attributes == [MASK, None, "value", None, None, "value", None, None, "1"]
    assert ex.depth == [0, 1, 2, 1, 2, 3, 4, 3, 3]
    child = [e for e, k in zip(ex.edges, ex.edge_kinds) if k == 0]
    nxt = [e for e, k in zip(ex.edges, ex.edge_kinds) if k == 1]
    assert child == [(0, 1), (1, 2), (0, 3), (3, 4), (4, 5), (5, 6), (4, 7), (4, 8)]
    assert len(child) == ex.num_nodes - 1  # a tree
    assert nxt == [(0, 2), (2, 5), (5, 8)]  # attributed nodes in source order
    assert ex.edge_texts() == ["child"] * 8 + ["next token"] * 3
    assert ex.node_texts()[0] == f"FunctionDef: {MASK}" and ex.node_texts()[1] == "arguments"
    assert ex.subtokens == ["add", "one"] and ex.target == ["add", "one"]
    assert ex.source == f"def {MASK}(value):\n    return value + 1"


def test_name_is_masked_everywhere_and_docstrings_removed():
    data = _build()
    every = data.train + data.val + data.test
    assert every
    for ex in every:  # no attribute spells the name's sub-tokens in order
        assert not any(_spells([a], ex.subtokens) for a in ex.node_attributes if a is not None)
        words = " ".join(t for t in ex.node_texts())
        assert ex.name not in words.replace(MASK, " ")  # not as a word, nor inside one
        assert ex.name not in ex.source.replace(MASK, " ")
        assert ex.node_types[0] in ("FunctionDef", "AsyncFunctionDef")
        assert ex.node_attributes[0] == MASK
    count = next(ex for ex in data.train if ex.name == "countDown")
    assert "Count down to zero" not in " ".join(count.node_texts())  # docstring gone
    assert "Count down" not in count.source and "#" not in count.source
    # the recursive call and the string's uses are masked, a longer word holding it too
    assert f"return {MASK}(n - 1)" in count.source
    assert f"'{MASK} done, {MASK} left'" in count.source
    method = next(ex for ex in data.train if ex.qualname == "Box.get_HTTPResponse")
    assert method.subtokens == ["get", "http", "response"]
    assert method.source.count(MASK) == 3  # def, the argument of that name, self.<name>


def _spells(texts, target) -> bool:
    """Some run of the texts' words has the target's sub-tokens in order."""
    import re

    flat = [s for text in texts for w in re.findall(r"[A-Za-z0-9_]+", text)
            for s in split_subtokens(w)]  # fmt: skip
    n = len(target)
    return any(flat[i : i + n] == target for i in range(len(flat) - n + 1))


MASKING_CASES = """
def run(self):
    t = truncate(self._run_count, self.runner)
    return run(t)

def load_user(x):
    LoadUser(x); self.loadUser; y = "load user"; z = "reload users"
    return x.load_user_id

def _default_config(a):
    return transform_a.default_config(a, b"default-config")
"""


def test_masking_covers_other_spellings_and_keeps_other_words():
    exs = {e.name: e for e in function_examples(MASKING_CASES, "p", "f.py", min_nodes=1)}
    for ex in exs.values():
        assert not any(_spells([a], ex.subtokens) for a in ex.node_attributes if a), ex.source
        assert not _spells([ex.source.replace(MASK, " ")], ex.subtokens), ex.source
    run = exs["run"].source
    assert "truncate" in run and "self.runner" in run  # words that only share letters stay
    assert "'reload users'" in exs["load_user"].source
    assert exs["_default_config"].source.count(MASK) == 4  # def, attribute, both bytes words


def test_functions_kept_and_left_out():
    data = _build()
    names = {ex.qualname for ex in data.train}
    # dunders, names with "test", files in test folders and nested functions are left out
    assert names == {"add_one", "countDown", "Box.get_HTTPResponse", "Box.Inner._to_utf8"}
    inner = next(ex for ex in data.train if ex.qualname == "Box.Inner._to_utf8")
    assert "FunctionDef: helper" in inner.node_texts()  # the nested helper is in its tree
    # a file that does not parse gives nothing (its good function too); async functions count
    assert {ex.qualname for ex in data.val} == {"fetch_page"}
    assert data.val[0].node_types[0] == "AsyncFunctionDef"
    assert data.info["projects"]["gamma"]["files"] == 2


def test_split_is_by_project_and_test_repeats_of_train_are_dropped():
    data = _build()
    for split, project in (("train", "alpha"), ("val", "gamma"), ("test", "beta")):
        assert {ex.project for ex in data.split(split)} == {project}
    # beta's add_one is a copy of alpha's: dropped from test, counted as a duplicate
    assert [ex.qualname for ex in data.test] == ["load_items"]
    assert data.info["projects"]["beta"]["duplicates"] == 1
    assert data.info["counts"] == {"train": 4, "val": 1, "test": 1}


def test_node_range_filters_trees():
    sizes = {ex.qualname: ex.num_nodes for ex in _build().train}
    small = _build(min_nodes=10, max_nodes=20).train
    assert {ex.qualname for ex in small} == {q for q, n in sizes.items() if 10 <= n <= 20}
    assert data_sizes_are_summarised(_build())


def data_sizes_are_summarised(data) -> bool:
    s = data.info["sizes"]["train"]
    return s["n"] == 4 and s["min"] <= s["median"] <= s["max"]


def test_save_load_round_trip_and_damage_is_named(tmp_path):
    data = _build()
    data.save(tmp_path / "ds")
    back = load_code_names(tmp_path / "ds")
    assert back.train == data.train and back.test == data.test and back.info == data.info
    with gzip.open(tmp_path / "ds" / "val.jsonl.gz", "wt") as f:
        f.write('{"project": "x"}\n')
    with pytest.raises(ValueError, match="line 1"):
        load_code_names(tmp_path / "ds")
    data.save(tmp_path / "ds")
    (tmp_path / "ds" / "test.jsonl.gz").write_bytes(b"not gzip")
    with pytest.raises(ValueError, match="damaged"):
        load_code_names(tmp_path / "ds")
    with pytest.raises(FileNotFoundError, match="data fetch"):
        load_code_names(tmp_path / "nothing")


def test_wheels_are_read_without_extracting(tmp_path):
    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(FILES / "beta" / "shared.py", "demo/shared.py")
        z.writestr("demo/tests/test_x.py", "def check(a):\n    return a\n")
        z.writestr("demo-1.0.dist-info/METADATA", "Name: demo\n")
    assert [p for p, _ in python_files(wheel)] == ["demo/shared.py"]


def test_fetch_checks_the_pinned_hash(tmp_path, monkeypatch):
    from structattn.data import fetch

    payload = {"bytes": b"wheel bytes"}
    calls = []

    def fake_pip(cmd, cwd, what):
        calls.append(cmd)
        dest = Path(cmd[cmd.index("--dest") + 1])
        (dest / "demo_pkg-1.0-py3-none-any.whl").write_bytes(payload["bytes"])

    monkeypatch.setattr(fetch, "_run", fake_pip)
    import hashlib

    good = hashlib.sha256(b"wheel bytes").hexdigest()
    dist = codemod.Distribution("demo-pkg", "1.0", "train", "2025-01-01", good)
    path = fetch._fetch_wheel(dist, tmp_path)
    assert path.read_bytes() == b"wheel bytes" and len(calls) == 1
    assert fetch._fetch_wheel(dist, tmp_path) == path and len(calls) == 1  # cached
    other = codemod.Distribution("other", "1.0", "train", "2025-01-01", good)
    monkeypatch.setattr(
        fetch,
        "_run",
        lambda cmd, cwd, what: (
            Path(cmd[cmd.index("--dest") + 1]) / "other-1.0-py3-none-any.whl"
        ).write_bytes(b"x"),
    )
    with pytest.raises(fetch.FetchError, match="pinned"):
        fetch._fetch_wheel(other, tmp_path)


def test_pinned_distributions_are_split_and_recent():
    dists = codemod.DISTRIBUTIONS
    assert len({d.name for d in dists}) == len(dists)
    assert {d.split for d in dists} == {"train", "val", "test"}
    assert all(d.first_release >= "2025-01-01" and len(d.sha256) == 64 for d in dists)


# ---------------------------------------------------------------------------- the metric


def test_f1_matches_hand_computation():
    refs = [["get", "user", "name"], ["load"], ["to", "utf8"], ["run"]]
    preds = [["get", "name"], ["load"], ["utf8", "to"], []]
    s = name_scores(refs, preds)
    # example 1: P = 2/2, R = 2/3, F1 = 0.8; 2: 1, 1, 1; 3 (sets): 1, 1, 1; 4: empty -> 0
    assert s["precision"] == pytest.approx((1 + 1 + 1 + 0) / 4)
    assert s["recall"] == pytest.approx((2 / 3 + 1 + 1 + 0) / 4)
    assert s["f1"] == pytest.approx((0.8 + 1 + 1 + 0) / 4)
    assert s["exact"] == pytest.approx(1 / 4)  # order matters for exact match


def test_f1_uses_sets_like_ogb():
    s = name_scores([["get", "get", "item"]], [["get", "value", "value"]])
    # sets {get, item} vs {get, value}: P = 1/2, R = 1/2
    assert s["precision"] == pytest.approx(0.5) and s["f1"] == pytest.approx(0.5)


def test_metric_rejects_bad_input():
    with pytest.raises(ValueError, match="references"):
        name_scores([["a"]], [])
    with pytest.raises(ValueError, match="no examples"):
        name_scores([], [])
    with pytest.raises(ValueError, match="list of sub-token"):
        name_scores(["get_name"], [["get"]])


# ---------------------------------------------------------------------------- training


def test_cli_trains_a_gnn_and_writes_its_scores(tmp_path, capsys):
    import json

    from structattn.cli import main

    _build().save(tmp_path / "ds")
    run = tmp_path / "run"
    main(["code-names", "train", "--dataset-path", str(tmp_path / "ds"),
          "--model", "gin", "--run-dir", str(run), "--emb-dim", "8", "--gnn-layers", "2",
          "--train.max-steps", "4", "--train.batch-size", "2",
          "--train.eval-every", "2"])  # fmt: skip
    final = json.loads((run / "final.json").read_text())
    assert final["model"] == "gin" and final["examples"] == {"train": 4, "val": 1, "test": 1}
    for split in ("val", "test"):
        assert set(final[split]) == {"f1", "precision", "recall", "exact"}
        assert 0.0 <= final[split]["f1"] <= 1.0
    assert final["test_examples"][0]["true"] == ["load", "items"]
    assert "| test |" in capsys.readouterr().out
    assert (run / "results.md").is_file() and (run / "vocabulary.json").is_file()


def test_code_names_is_its_own_command_and_each_refuses_the_others_runs(tmp_path):
    from structattn.cli import main
    from structattn.experiments.glfusion import GLFusionTrainConfig

    _build().save(tmp_path / "ds")
    run = tmp_path / "run"
    main(["code-names", "train", "--dataset-path", str(tmp_path / "ds"), "--model", "gin",
          "--run-dir", str(run), "--emb-dim", "8", "--gnn-layers", "2",
          "--train.max-steps", "2", "--train.batch-size", "2"])  # fmt: skip
    with pytest.raises(SystemExit, match=f"{run} is a code-names run: resume it with `structattn "
                       f"code-names train --run-dir {run} --resume`"):  # fmt: skip
        main(["glfusion", "train", "--run-dir", str(run), "--resume"])
    for command in ("train", "ablate", "generate"):  # the spelling before the group existed
        with pytest.raises(SystemExit, match=f"own: structattn code-names {command}"):
            main(["glfusion", command, "--dataset", "code-names", str(run)])
    with pytest.raises(ValueError, match="code-names is a task of its own.*structattn code-names"):
        GLFusionTrainConfig(dataset="code-names")  # the config refuses it too
    other = tmp_path / "node-run"
    other.mkdir()
    (other / "config.yaml").write_text("dataset: wordnet\nname: x\n")
    resume = f"resume it with `structattn glfusion train --run-dir {other} --resume`"
    with pytest.raises(
        SystemExit, match=f"{other} is a GL-Fusion node-classification run: {resume}"
    ):
        main(["code-names", "train", "--run-dir", str(other), "--resume"])
    lra = tmp_path / "lra-run"
    lra.mkdir()
    (lra / "config.yaml").write_text("name: x\ndata: {task: listops}\n")
    with pytest.raises(SystemExit, match=f"resume it with `structattn train --run-dir {lra}"):
        main(["code-names", "train", "--run-dir", str(lra), "--resume"])


def test_gnn_learns_names_of_trees_it_was_trained_on():
    """On a training set it can memorise, the GNN's F1 rises from 0 to near 1 (the heads, the
    decoding and the metric are wired to the right targets)."""
    import torch
    from torch_geometric.data import Batch

    from structattn.experiments.glfusion.code.gnn import NameGNN, Vocabulary, graph_data

    exs = _build().train
    vocab = Vocabulary.from_examples(exs)
    graphs = Batch.from_data_list([graph_data(ex, vocab, 20) for ex in exs])
    torch.manual_seed(0)
    for kind in ("gcn", "gin"):
        model = NameGNN(vocab, kind, layers=2, dim=32)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for _ in range(60):
            opt.zero_grad()
            model(graphs, graphs.y).loss.backward()
            opt.step()
        model.eval()
        preds = [vocab.decode(r.tolist()) for r in model.predict_ids(graphs)]
        assert name_scores([ex.subtokens for ex in exs], preds)["exact"] == 1.0, (kind, preds)


def test_vocabulary_encodes_and_decodes_like_ogb():
    from structattn.experiments.glfusion.code.gnn import Vocabulary

    v = Vocabulary.from_examples(_build().train, num_vocab=3)
    assert v.subtokens[:2] == ["__UNK__", "__EOS__"] and len(v.subtokens) == 5
    ids = v.encode_target(["zzz", *v.subtokens[2:4], "a", "b", "c", "d"])
    assert ids[0] == 0 and len(ids) == 5  # unknown -> __UNK__, cut at 5
    assert v.decode([v.subtoken_id[v.subtokens[2]], 1, 3]) == [v.subtokens[2]]  # stops at EOS
    assert v.encode_target(["x"])[1:] == [1, 1, 1, 1]  # padded with __EOS__


# ---------------------------------------------------------------------------- the LLM models


def _tiny_models(tmp_path):
    from helpers import tiny_glfusion_models

    return tiny_glfusion_models(tmp_path)


def test_prompts_of_each_llm_model(tmp_path):
    from structattn.experiments.glfusion.code.llm import (
        ANSWER,
        END,
        PromptSpec,
        build_prompt,
        edge_lists,
    )

    (llm, tok), _ = _tiny_models(tmp_path)
    ex = next(e for e in _build().train if e.qualname == "countDown")
    spec = PromptSpec(node_id=900, graph_start=901, graph_end=902)
    g = build_prompt(ex, "glfusion", tok, spec)
    assert g.texts == ex.node_texts() and 900 not in g.prompt_ids and 901 not in g.prompt_ids
    edges, texts = edge_lists(ex)
    assert edges.shape == (2, 2 * len(ex.edges)) and (g.edge_index == edges).all()
    assert texts.count("child") == texts.count("parent") == ex.num_nodes - 1
    assert texts.count("next token") == texts.count("previous token") == len(ex.leaf_order()) - 1
    # the gated prompt is the node-text prompt itself; each node's span is its own line
    tree = build_prompt(ex, "llm-tree", tok, spec)
    assert g.prompt_ids == tree.prompt_ids and g.target_ids == tree.target_ids
    words = tok(" " + " ".join(ex.target), add_special_tokens=False)["input_ids"]
    assert tree.target_ids == words + tok(END, add_special_tokens=False)["input_ids"]
    cue = tok(ANSWER, add_special_tokens=False)["input_ids"]
    assert g.prompt_ids[-len(cue) :] == cue
    newline = tok(END, add_special_tokens=False)["input_ids"]
    for text, (a, b) in zip(ex.node_texts(), g.spans):
        own = tok(text, add_special_tokens=False)["input_ids"][: spec.node_text_tokens - 1]
        assert g.prompt_ids[a:b] == own + newline
    for mode in ("llm-tree", "llm-code", "glfusion"):
        small = PromptSpec(900, 901, 902, max_prompt_tokens=40)
        p = build_prompt(ex, mode, tok, small)
        assert len(p.prompt_ids) <= 40 and (p.texts is None) == (mode != "glfusion")
        if mode == "glfusion":  # nodes past the budget leave the graph with their edges
            n = len(p.spans)
            assert 0 < n < ex.num_nodes and p.texts == ex.node_texts()[:n]
            assert int(p.edge_index.max()) < n and len(p.edge_texts) == p.edge_index.shape[1]
    full = build_prompt(ex, "llm-code", tok, PromptSpec(900, 901, 902, max_prompt_tokens=10_000))
    assert len(full.prompt_ids) > 40  # the cut above was real
    with pytest.raises(ValueError, match="holds no node"):
        build_prompt(ex, "glfusion", tok, PromptSpec(900, 901, 902, max_prompt_tokens=20))
    paper = build_prompt(ex, "glfusion", tok, PromptSpec(900, 901, 902, variant="paper"))
    assert paper.prompt_ids.count(901) == 1 and paper.spans is None
    assert paper.target_ids[-1] == tok.eos_token_id or tok.eos_token_id is None


def test_generated_text_becomes_subtokens():
    from structattn.experiments.glfusion.code.llm import subtokens_of_text

    assert subtokens_of_text(" get user name") == ["get", "user", "name"]
    assert subtokens_of_text("getUserName, (x)") == ["get", "user", "name", "x"]
    assert subtokens_of_text("a b c d e f g") == ["a", "b", "c", "d", "e"]
    assert subtokens_of_text("") == []


@pytest.mark.parametrize("model", ["llm-tree", "llm-code", "glfusion"])
def test_llm_models_train_and_report(tmp_path, model):
    from structattn.engine.config import TrainConfig
    from structattn.experiments.glfusion.code import CodeNamesConfig, train_code_names

    llm, encoder = _tiny_models(tmp_path)
    train = TrainConfig(max_steps=3, batch_size=2, eval_every=3, log_every=1)
    cfg = CodeNamesConfig(model=model, run_dir=tmp_path / "run", data_dir=tmp_path,
                          max_prompt_tokens=64, max_new_tokens=4, eval_batch_size=2,
                          train=train)  # fmt: skip
    final = train_code_names(cfg, _build(), progress=False, llm=llm, encoder=encoder)
    assert final["model"] == model and 0.0 <= final["test"]["f1"] <= 1.0
    heads = set(final["heads"])
    assert heads == ({"lm", "gnn"} if model == "glfusion" else {"lm"})
    assert final["head"] in heads
    assert final["val"] == final["heads"][final["head"]]["val"]  # the head chosen on validation
    assert (tmp_path / "run" / "results.md").is_file()
    if model == "glfusion":
        assert any((tmp_path / "encodings").iterdir())  # node and edge texts encoded once, cached


def test_glfusion_groups_give_the_gates_their_own_learning_rate(tmp_path):
    """At optim.lr the zero-initialised gates stay nearly shut for a short run: code-names'
    GL-Fusion trains them at gate_lr, its modules, GNN head and LoRA each at theirs; the text
    models train LoRA alone."""
    from structattn.experiments.glfusion.code import CodeNamesConfig
    from structattn.experiments.glfusion.code.experiment import LLMNaming, build_naming_lm
    from structattn.experiments.glfusion.groups import parameter_kind

    rates = {"gates": 0.02, "modules": 0.003, "head": 0.004, "lora": 0.0005}
    for model in ("glfusion", "llm-code"):
        (tmp_path / model).mkdir()
        llm, encoder = _tiny_models(tmp_path / model)  # LoRA is applied in place: fresh ones
        cfg = CodeNamesConfig(model=model, gate_lr=0.02, module_lr=0.003, head_lr=0.004,
                              lora_lr=0.0005)  # fmt: skip
        cfg.optim.lr = 0.001
        naming = build_naming_lm(cfg, 10, llm, encoder).model
        groups = LLMNaming(cfg, progress=False).param_groups(naming)
        kinds = {parameter_kind(n): g["lr"] for g in groups for n in g["names"]}
        assert all(rates[k] == lr for k, lr in kinds.items())
        want = {"gates", "modules", "head", "lora"} if model == "glfusion" else {"lora"}
        assert set(kinds) == want
        grouped = {id(p) for g in groups for p in g["params"]}
        trainable = {id(p) for p in naming.parameters() if p.requires_grad}
        assert grouped == trainable  # every trainable parameter once, nothing frozen
    with pytest.raises(ValueError, match="gate_lr"):
        CodeNamesConfig(model="glfusion", gate_lr=0.0)


def test_a_stop_during_validation_ends_the_pass_before_its_next_batch(tmp_path, monkeypatch):
    """A SIGTERM the training loop received is read before every batch of a validation pass
    (generation makes a pass take minutes): the process ends as a stop during training does,
    with nothing of the pass recorded."""
    import signal

    import structattn.experiments.glfusion.code.experiment as experiment
    from structattn.experiments.glfusion.code.config import load_code_config

    _build().save(tmp_path / "ds")
    cfg = load_code_config("glfusion-code", "quick", dataset_path=str(tmp_path / "ds"),
                           model="gin", run_dir=str(tmp_path / "run"), emb_dim=8, gnn_layers=2,
                           train={"max_steps": 4, "batch_size": 2, "eval_every": 2})  # fmt: skip
    monkeypatch.setattr(experiment, "stop_requested", lambda: signal.SIGTERM)
    with pytest.raises(SystemExit) as exc:
        experiment.train_code_names(cfg, progress=False)
    assert exc.value.code == 128 + signal.SIGTERM
    rows = (tmp_path / "run" / "metrics.csv").read_text().splitlines()[1:]
    assert not [r for r in rows if ",val," in r]
    assert not (tmp_path / "run" / "final.json").exists()


def test_the_checkpoint_is_chosen_on_the_better_heads_validation_f1(monkeypatch):
    from structattn.experiments.glfusion.code.config import CodeNamesConfig
    from structattn.experiments.glfusion.code.experiment import LLMNaming

    exp = LLMNaming(CodeNamesConfig(model="glfusion"), progress=False)
    f1 = {"lm": 0.1, "gnn": 0.3}
    monkeypatch.setattr(exp, "scores", lambda m, s, limit=None, head="lm": ({"f1": f1[head]}, []))
    assert exp.heads == ["lm", "gnn"]
    assert exp.val_metrics(None, None) == {"f1": 0.3, "lm_f1": 0.1, "gnn_f1": 0.3}
    f1["lm"] = 0.3  # a tie goes to the LM head (the generated names)
    assert exp.val_metrics(None, None)["f1"] == 0.3
    text = LLMNaming(CodeNamesConfig(model="llm-tree"), progress=False)
    assert text.heads == ["lm"]

"""A new graph dataset is one reader plus one registry line: a toy reader, registered the way a
user's package would register it, trains GL-Fusion end to end and is refused when unknown."""

from __future__ import annotations

import pytest
import torch
from helpers import WORDS, tiny_glfusion_models

from structattn.data.graphs import GRAPH_READERS, TextAttributedGraph, graph_reader
from structattn.experiments.glfusion import build_glfusion_config, train_glfusion
from structattn.experiments.glfusion.config import load_graph


def read_ring(cfg, data_root) -> TextAttributedGraph:
    """The toy dataset: 24 nodes on a ring, each node's class its position mod 3."""
    n = 24
    ring = torch.arange(n)
    return TextAttributedGraph(
        name="ring",
        node_texts=[
            f"{WORDS[i % len(WORDS)]} {WORDS[(i * 5 + cfg.seed) % len(WORDS)]}" for i in range(n)
        ],
        labels=ring % 3,
        label_names=["tops", "act", "animal"],
        edge_index=torch.stack([ring, (ring + 1) % n]),
        splits={"train": ring[:12], "val": ring[12:18], "test": ring[18:]},
        source="a generated ring (toy dataset)",
        stand_in=True,
    )


@pytest.fixture
def ring_registered(monkeypatch):
    monkeypatch.setitem(GRAPH_READERS, "ring", read_ring)  # the one line a new dataset adds


def test_a_registered_reader_is_read_by_name(ring_registered, tmp_path):
    cfg = build_glfusion_config({"dataset": "ring", "data_dir": tmp_path, "seed": 3})
    graph = load_graph(cfg)
    assert graph.name == "ring" and graph.num_nodes == 24
    assert graph.node_texts[0] == f"{WORDS[0]} {WORDS[3]}"  # the reader saw the run's seed


def test_a_registered_reader_trains_end_to_end(ring_registered, tmp_path, monkeypatch):
    monkeypatch.setenv("STRUCTATTN_DATA_DIR", str(tmp_path / "user-cache"))
    llm, encoder = tiny_glfusion_models(tmp_path)
    cfg = build_glfusion_config(
        {
            "dataset": "ring",
            "data_dir": tmp_path / "data",
            "max_nodes": 4,
            "text_tokens": 8,
            "lora_r": 2,
            "lora_alpha": 4,
            "max_train": 6,
            "max_val": 3,
            "max_test": 3,
            "eval_batch_size": 3,
            "baseline_epochs": 5,
            "run_dir": tmp_path / "run",
            "train": {"max_steps": 2, "batch_size": 3, "eval_every": 2},
        }  # fmt: skip
    )
    results = train_glfusion(cfg, progress=False, llm=llm, encoder=encoder)
    assert results["targets"] == {"train": 6, "val": 3, "test": 3}
    assert "ring" in (tmp_path / "run" / "results.md").read_text()


def test_an_unknown_dataset_names_the_registered_ones(tmp_path):
    with pytest.raises(ValueError, match="arxiv, file, wordnet.*'rnig'"):
        build_glfusion_config({"dataset": "rnig", "data_dir": tmp_path})
    with pytest.raises(ValueError, match="'rnig'"):
        graph_reader("rnig")


def test_a_reader_that_returns_something_else_is_named(monkeypatch, tmp_path):
    monkeypatch.setitem(GRAPH_READERS, "broken", lambda cfg, root: {"nodes": []})
    cfg = build_glfusion_config({"dataset": "broken", "data_dir": tmp_path})
    with pytest.raises(TypeError, match="'broken' graph reader returned dict"):
        load_graph(cfg)


def test_a_reader_named_by_a_wrong_path_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setitem(GRAPH_READERS, "lost", "no_such_package.readers:from_config")
    with pytest.raises(ValueError, match="'lost' graph reader .* cannot be loaded"):
        build_glfusion_config({"dataset": "lost", "data_dir": tmp_path})
    monkeypatch.setitem(GRAPH_READERS, "typo", "structattn.data.graphs.wordnet:from_confg")
    with pytest.raises(ValueError, match="'typo' graph reader .* cannot be loaded"):
        graph_reader("typo")

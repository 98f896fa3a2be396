"""Data files that must never run code, mix up models or splits, or collide when written twice:
the CIFAR-10 unpickler, the GGUF cache key, graph validation, ListOps limits, atomic writes."""

from __future__ import annotations

import csv
import hashlib
import json
import multiprocessing
import os
import pickle
import shlex
import struct
import time
import types

import numpy as np
import pytest
import torch
from helpers import write_idx

from structattn.data import TaskSpec, load_task
from structattn.data.graphs import TextAttributedGraph
from structattn.data.images import read_cifar10
from structattn.data.listops import read_listops_tsv, write_listops_tsv
from structattn.errors import DataError
from structattn.utils.files import atomic_dir, atomic_path

# --------------------------------------------------------------------------- CIFAR-10 batches


class _WritesMarker:
    """Unpickling this runs a shell command that creates ``path``."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(self.path)}",))


def _cifar_dir(tmp_path, batch_bytes: dict[str, bytes]):
    root = tmp_path / "cifar-10-batches-py"
    root.mkdir()
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        blob = batch_bytes.get(name)
        if blob is None:
            data = rng.integers(0, 256, (2, 3072), dtype=np.uint8)
            blob = pickle.dumps({b"data": data, b"labels": [1, 2]}, protocol=2)
        (root / name).write_bytes(blob)
    return root


def _bomb(marker, where):
    payload = {b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 1]}
    if where == "top":
        return pickle.dumps(_WritesMarker(marker), protocol=2)
    payload[where.encode()] = _WritesMarker(marker)
    return pickle.dumps(payload, protocol=2)


@pytest.mark.parametrize("where", ["data", "labels", "top"])
def test_cifar_batch_that_would_run_code_is_refused(tmp_path, where):
    proof = tmp_path / "proof"  # the payload is live: plain pickle.loads does run it
    pickle.loads(_bomb(proof, where))
    assert proof.exists()
    marker = tmp_path / "marker"
    root = _cifar_dir(tmp_path, {"data_batch_1": _bomb(marker, where)})
    with pytest.raises(DataError) as err:
        read_cifar10(root)
    message = str(err.value)
    assert "data_batch_1: not a CIFAR-10 python batch" in message and "system" in message
    assert "\n" not in message
    assert not marker.exists()


def test_cifar_unpickler_refuses_builtins_that_run_code(tmp_path):
    class _Eval:
        def __reduce__(self):
            return (eval, ("1 + 1",))

    blob = pickle.dumps({b"data": _Eval(), b"labels": []}, protocol=2)
    root = _cifar_dir(tmp_path, {"test_batch": blob})
    with pytest.raises(DataError, match=r"test_batch: .*refused global builtins\.eval"):
        read_cifar10(root)


def _py2_batch(data: np.ndarray, labels: list[int]) -> bytes:
    """A batch as Python 2's cPickle (protocol 2) wrote the real files: ``str`` keys and array
    bytes as SHORT_BINSTRING/BINSTRING, the array rebuilt by ``numpy.core.multiarray``."""

    def s(b):
        return b"U" + bytes([len(b)]) + b if len(b) < 256 else b"T" + struct.pack("<i", len(b)) + b

    def i(v):
        return b"K" + bytes([v]) if v < 256 else b"M" + struct.pack("<H", v)

    def g(module, name):
        return b"c" + module + b"\n" + name + b"\n"

    minus_one = b"J" + struct.pack("<i", -1)
    dtype = (
        g(b"numpy", b"dtype") + s(b"u1") + i(0) + i(1) + b"\x87R"
        + b"(" + i(3) + s(b"|") + b"NNN" + minus_one + minus_one + i(0) + b"tb"
    )  # fmt: skip
    array = (
        g(b"numpy.core.multiarray", b"_reconstruct") + g(b"numpy", b"ndarray") + i(0) + b"\x85"
        + s(b"b") + b"\x87R" + b"(" + i(1) + b"".join(i(d) for d in data.shape) + b"\x86"
        + dtype + b"\x89" + s(data.tobytes()) + b"tb"
    )  # fmt: skip
    label_ops = b"".join(i(v) for v in labels)
    return b"\x80\x02}(" + s(b"data") + array + s(b"labels") + b"](" + label_ops + b"eu."


def test_genuine_cifar_batches_still_load(tmp_path):
    rng = np.random.default_rng(3)
    batches, expected = {}, {}
    for k, name in enumerate([f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]):
        data = rng.integers(0, 256, (3, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, 3).tolist()
        full = {b"batch_label": b"batch", b"labels": labels, b"data": data,
                b"filenames": [b"x.png"] * 3}  # fmt: skip
        if k == 0:
            batches[name] = _py2_batch(data, labels)  # as the downloaded files are
        elif k == 1:
            batches[name] = pickle.dumps(full, protocol=2)
        elif k == 2:  # numpy arrays as an older numpy names its module
            blob = pickle.dumps(full, protocol=2)
            batches[name] = blob.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
        else:
            batches[name] = pickle.dumps(full, protocol=pickle.HIGHEST_PROTOCOL)
        expected[name] = (data, labels)
    py2 = pickle.loads(batches["data_batch_1"], encoding="bytes")  # the hand-made file is sound
    assert py2[b"labels"] == expected["data_batch_1"][1]
    out = read_cifar10(_cifar_dir(tmp_path, batches))
    train_x, train_y = out["train"]
    want = np.concatenate([expected[f"data_batch_{i}"][0] for i in range(1, 6)])
    np.testing.assert_array_equal(train_x, want.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
    assert train_y.tolist() == sum((expected[f"data_batch_{i}"][1] for i in range(1, 6)), [])
    assert out["test"][1].tolist() == expected["test_batch"][1]


# --------------------------------------------------------------------------- GGUF cache


def _tiny_tokenizer(folder):
    from transformers import BertTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b"]
    (folder / "vocab.txt").write_text("\n".join(words) + "\n")
    return BertTokenizer(str(folder / "vocab.txt"))


def _model_for(content: bytes):
    """A tiny Llama whose weights follow from ``content`` (a stand-in for a parsed GGUF)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(int(hashlib.sha256(content).hexdigest()[:8], 16))
    cfg = LlamaConfig(
        vocab_size=16,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )
    return LlamaForCausalLM(cfg)


def _fake_gguf_parse(monkeypatch, tmp_path) -> list[bytes]:
    """Replace the slow GGUF parse (a real model) by :func:`_model_for` of the file's bytes;
    returns the list of the contents parsed."""
    from structattn.glfusion import loading

    parsed: list[bytes] = []
    tokenizer = _tiny_tokenizer(tmp_path / "tok")

    def dequantise(path):
        parsed.append(path.read_bytes())
        return _model_for(path.read_bytes()), tokenizer

    monkeypatch.setattr(loading, "_dequantise_gguf", dequantise)
    monkeypatch.setenv("STRUCTATTN_DATA_DIR", str(tmp_path / "data"))
    return parsed


def _same_weights(model, other) -> bool:
    a, b = model.state_dict(), other.state_dict()
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_gguf_cache_is_keyed_by_content_not_by_file_name(tmp_path, monkeypatch):
    from structattn.glfusion.loading import load_llm

    parsed = _fake_gguf_parse(monkeypatch, tmp_path)
    first = tmp_path / "a" / "model.gguf"
    first.parent.mkdir()
    first.write_bytes(b"A" * 1000)
    model, _ = load_llm(first)
    again, tok = load_llm(first)  # the same file: answered by the cache
    assert len(parsed) == 1 and _same_weights(again, model) and tok.get_vocab()["a"] == 5
    # a different file of the same name (the bug: it loaded as the cached model)
    other = tmp_path / "b" / "model.gguf"
    other.parent.mkdir()
    other.write_bytes(os.urandom(1000))
    got, _ = load_llm(other)
    assert len(parsed) == 2 and _same_weights(got, _model_for(other.read_bytes()))
    assert not _same_weights(got, model)
    cached, _ = load_llm(other)
    assert len(parsed) == 2 and _same_weights(cached, got)
    # the first file rewritten in place with other bytes of the same size
    first.write_bytes(b"C" * 1000)
    os.utime(first, ns=(first.stat().st_atime_ns, first.stat().st_mtime_ns + 10**9))
    rewritten, _ = load_llm(first)
    assert len(parsed) == 3 and _same_weights(rewritten, _model_for(b"C" * 1000))
    # an explicit cache folder is rebuilt, never reused, for a file it was not built from
    folder = tmp_path / "explicit"
    a, _ = load_llm(first, cache_dir=folder)
    b, _ = load_llm(other, cache_dir=folder)
    assert len(parsed) == 5 and _same_weights(b, got) and not _same_weights(b, a)
    b_again, _ = load_llm(other, cache_dir=folder)
    assert len(parsed) == 5 and _same_weights(b_again, got)
    left = [p.name for p in tmp_path.rglob("*") if p.name.endswith((".tmp", ".old"))]
    assert left == []


def test_gguf_cache_without_a_source_record_is_not_trusted(tmp_path, monkeypatch):
    """A cache folder written before the key existed (no ``gguf-source.json``) is rebuilt."""
    from structattn.glfusion.loading import load_llm

    parsed = _fake_gguf_parse(monkeypatch, tmp_path)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x" * 100)
    folder = tmp_path / "cache"
    load_llm(gguf, cache_dir=folder)
    (folder / "gguf-source.json").unlink()
    load_llm(gguf, cache_dir=folder)
    assert len(parsed) == 2 and (folder / "gguf-source.json").is_file()
    load_llm(gguf, cache_dir=folder)
    assert len(parsed) == 2


# --------------------------------------------------------------------------- graphs


def _pyg(n=12, y=None, **masks):
    from torch_geometric.data import Data

    y = torch.tensor([i % 3 for i in range(n)]) if y is None else y
    data = Data(edge_index=torch.tensor([[0, 1, 2], [1, 2, 3]]), y=y, num_nodes=n)
    default = {"train": range(0, 6), "val": range(6, 9), "test": range(9, 12)}
    for key in ("train", "val", "test"):
        mask = torch.zeros(n, dtype=torch.bool)
        mask[list(masks.get(key, default[key]))] = True
        data[f"{key}_mask"] = mask
    return data


TEXTS = [f"node {i}" for i in range(12)]
NAMES = ["a", "b", "c"]


def _one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def test_from_pyg_refuses_overlapping_splits():
    with pytest.raises(ValueError) as err:
        TextAttributedGraph.from_pyg(_pyg(test=[0, 1, 9, 10, 11]), TEXTS, NAMES)
    assert "2 node(s) of the test split are also in the train split" in _one_line(err)


def test_from_pyg_refuses_repeated_indices():
    split = {"train": torch.tensor([0, 1, 1, 2, 2]), "val": torch.tensor([6]),
             "test": torch.tensor([9])}  # fmt: skip
    with pytest.raises(ValueError) as err:
        TextAttributedGraph.from_pyg(_pyg(), TEXTS, NAMES, split=split)
    assert "the train split repeats 2 node index(es)" in _one_line(err)


def test_from_pyg_refuses_fractional_labels_and_keeps_whole_float_ones():
    y = torch.tensor([i % 3 for i in range(12)], dtype=torch.float32)
    graph = TextAttributedGraph.from_pyg(_pyg(y=y), TEXTS, NAMES)
    assert graph.labels.dtype == torch.long and graph.labels.tolist() == y.long().tolist()
    y[4], y[7] = 1.7, float("nan")
    with pytest.raises(ValueError) as err:
        TextAttributedGraph.from_pyg(_pyg(y=y), TEXTS, NAMES)
    assert "data.y has 2 value(s) that are not whole numbers (e.g. 1.7" in _one_line(err)
    split = {"train": torch.tensor([0.0, 1.5]), "val": torch.tensor([6]), "test": [9]}
    with pytest.raises(ValueError, match="the train split has 1 value"):
        TextAttributedGraph.from_pyg(_pyg(), TEXTS, NAMES, split=split)


def test_from_pyg_labels_beyond_the_names_and_unlabelled_nodes():
    y = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2, 0, -1, -1])
    masks = {"test": [9]}  # nodes 10, 11 unlabelled, outside every split: allowed
    graph = TextAttributedGraph.from_pyg(_pyg(y=y, **masks), TEXTS, NAMES)
    assert graph.labels[10] == -1
    with pytest.raises(ValueError) as err:  # an unlabelled node inside a split
        TextAttributedGraph.from_pyg(_pyg(y=y), TEXTS, NAMES)
    assert "2 test node(s) [10, 11] have labels outside 0..2" in _one_line(err)
    y = y.clone()
    y[10], y[11] = 3, 7  # beyond the label names, even outside the splits
    with pytest.raises(ValueError) as err:
        TextAttributedGraph.from_pyg(_pyg(y=y, **masks), TEXTS, NAMES)
    assert "2 node(s) [10, 11] have labels outside 0..2 (3 label names" in _one_line(err)


def test_from_pyg_refuses_an_empty_split():
    with pytest.raises(ValueError) as err:
        TextAttributedGraph.from_pyg(_pyg(val=[]), TEXTS, NAMES)
    assert _one_line(err) == "the val split is empty"


def _saved(tmp_path):
    graph = TextAttributedGraph.from_pyg(_pyg(), TEXTS, NAMES)
    graph.save(tmp_path / "g")
    again = TextAttributedGraph.load(tmp_path / "g")
    assert {k: v.tolist() for k, v in again.splits.items()} == {
        k: v.tolist() for k, v in graph.splits.items()
    }
    return graph


def _rewrite_tensors(tmp_path, **changes):
    from safetensors.torch import load_file, save_file

    path = tmp_path / "g" / "graph.safetensors"
    tensors = load_file(str(path))
    for key, value in changes.items():
        key = key.replace("__", ".")
        if value is None:
            del tensors[key]
        else:
            tensors[key] = value
    save_file(tensors, str(path))


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(edge_index=torch.tensor([[0, 1, 2], [1, 99, 12]])),
         "2 edge(s) refer to nodes outside 0..11"),
        (dict(split__test=torch.tensor([5, 9])),
         "1 node(s) of the train split are also in the test split"),
        (dict(split__val=torch.tensor([6, 6, 7])), "the val split repeats 1 node index(es)"),
        (dict(split__val=torch.zeros(0, dtype=torch.long)), "the val split is empty"),
        (dict(split__test=None), "graph.safetensors has no test split"),
        (dict(labels=torch.tensor([0, 1, 2] * 3 + [0, 1, 5])),
         "1 node(s) [11] have labels outside 0..2"),
        (dict(labels=torch.zeros(12)), "labels must be a (N,) integer tensor"),
    ],
)  # fmt: skip
def test_load_validates_the_graph(tmp_path, changes, message):
    _saved(tmp_path)
    _rewrite_tensors(tmp_path, **changes)
    with pytest.raises(DataError) as err:
        TextAttributedGraph.load(tmp_path / "g")
    text = _one_line(err)
    assert text.startswith(str(tmp_path / "g")) and message in text, text


@pytest.mark.parametrize(
    "meta, message",
    [
        (dict(node_texts="abcdefghijkl"), "node_texts must be a list of strings"),
        (dict(node_texts=None), "node_texts must be a list of strings"),
        (dict(node_texts=[f"node {i}" for i in range(11)] + ["  "]),
         "1 node(s) [11] have an empty text"),
        (dict(label_names=["a", "b", "a"]), "label_names repeat ['a']"),
        (dict(label_names=[0, 1, 2]), "label_names must be a list of strings"),
        (dict(node_ids=[f"n{i}" for i in range(11)] + ["n0"]), "node ids repeat ['n0']"),
        (dict(node_ids=["n0", "n1"]), "2 node ids for 12 nodes"),
        (dict(node_ids="n0"), "node_ids must be a list of strings"),
    ],
)  # fmt: skip
def test_load_validates_the_graph_json(tmp_path, meta, message):
    """graph.json goes through the same validator as a graph built in Python: a string of
    12 characters is not 12 nodes, blank texts and repeated or non-string label names are
    named in one line."""
    _saved(tmp_path)
    path = tmp_path / "g" / "graph.json"
    data = json.loads(path.read_text())
    data.update(meta)
    path.write_text(json.dumps(data))
    with pytest.raises(DataError) as err:
        TextAttributedGraph.load(tmp_path / "g")
    text = _one_line(err)
    assert text.startswith(str(tmp_path / "g")) and message in text, text


def test_save_leaves_no_temporary_files(tmp_path):
    _saved(tmp_path)
    assert sorted(p.name for p in (tmp_path / "g").iterdir()) == [
        "graph.json",
        "graph.safetensors",
    ]


# --------------------------------------------------------------------------- ListOps


def test_listops_tsv_line_longer_than_csv_default_limit(tmp_path):
    digits = [(7 * i) % 10 for i in range(30_000)]
    text = "[MAX"
    for d in digits:
        text = f"( {text} {d} )"
    source = f"( {text} ] )"
    assert len(source) > 131_072
    path = tmp_path / "long.tsv"
    write_listops_tsv(path, [(source, 9), ("( ( ( [MIN 2 ) 9 ) ] )", 2)])
    before = csv.field_size_limit()
    assert read_listops_tsv(path) == [(source, 9), ("( ( ( [MIN 2 ) 9 ) ] )", 2)]
    assert csv.field_size_limit() == before


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(listops_sizes=(-100, 300, 50)), "listops_sizes must be three whole numbers >= 1"),
        (dict(listops_sizes=(100, 0, 50)), "listops_sizes"),
        (dict(listops_sizes=(100, 50)), "listops_sizes"),
        (dict(listops_min_length=0), "listops_min_length must be >= 1"),
        (dict(task="listops", seq_len=32, listops_min_length=64),
         "listops_min_length=64 is above seq_len=32"),
        (dict(task="listops", listops_min_length=600), "above seq_len=512"),
    ],
)  # fmt: skip
def test_task_spec_names_bad_listops_settings(kwargs, message):
    with pytest.raises(ValueError) as err:
        TaskSpec(**kwargs)
    assert message in _one_line(err)


def test_config_files_name_the_data_key():
    from structattn.engine.config import build_dataclass
    from structattn.errors import ConfigError
    from structattn.experiments.lra import LRAConfig

    for data, message in (
        ({"listops_sizes": [-100, 300, 50]}, "data.listops_sizes must be three whole numbers"),
        ({"seq_len": 32, "listops_min_length": 64}, "listops_min_length=64 is above seq_len=32"),
    ):
        with pytest.raises(ConfigError) as err:
            build_dataclass(LRAConfig, {"data": {"task": "listops", **data}})
        assert message in _one_line(err)


def test_task_spec_min_length_only_binds_generated_listops():
    TaskSpec(task="text", seq_len=32)  # the ListOps minimum does not concern other tasks
    TaskSpec(task="listops", seq_len=32, listops_min_length=64, source="original")


def test_data_summary_with_a_pool_larger_than_the_image(tmp_path):
    from structattn.cli import main

    fm = tmp_path / "fashion-mnist"
    fm.mkdir()
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 10), ("t10k", 4)):
        write_idx(fm / f"{prefix}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)))
        write_idx(fm / f"{prefix}-labels-idx1-ubyte.gz", rng.integers(0, 10, n))
    argv = ["data", "summary", "--task", "image", "--data-dir", str(tmp_path)]
    with pytest.raises(SystemExit) as err:
        main([*argv, "--image-pool", "100"])
    message = str(err.value.code)
    assert "image_pool=100 is larger than the images (28x28): at most 28" in message
    assert "\n" not in message
    with pytest.raises(SystemExit, match="image_pool=29"):
        main([*argv, "--image-pool", "29"])
    assert load_task(task="image", data_dir=tmp_path, image_pool=28).seq_len == 1


# --------------------------------------------------------------------------- atomic writes

_SPEC = dict(task="listops", seq_len=64, listops_sizes=(400, 60, 60), listops_min_length=8)


class _SlowWriter:
    """A csv writer that pauses after each row: writing a split takes a while, so two processes
    preparing the same data are writing its files at the same time."""

    def __init__(self, *args, **kwargs):
        self.writer = csv.writer(*args, **kwargs)

    def writerow(self, row):
        time.sleep(0.0003)
        return self.writer.writerow(row)


def _prepare(data_dir, barrier, queue):
    try:
        from structattn.data import listops

        slow = {name: getattr(csv, name) for name in ("reader", "field_size_limit")}
        listops.csv = types.SimpleNamespace(writer=_SlowWriter, **slow)  # this process only
        barrier.wait(timeout=60)
        load_task(TaskSpec(data_dir=data_dir, **_SPEC))
        queue.put(None)
    except BaseException as err:  # reported to the parent, which fails the test
        queue.put(f"{type(err).__name__}: {err}")


def test_two_processes_preparing_listops_data_never_collide(tmp_path):
    load_task(TaskSpec(data_dir=tmp_path / "reference", **_SPEC))
    reference = {p.name: p.read_bytes() for p in (tmp_path / "reference").rglob("*.tsv")}
    assert len(reference) == 3
    ctx = multiprocessing.get_context("fork")
    for round_ in range(4):
        data_dir = tmp_path / f"fresh-{round_}"
        barrier, queue = ctx.Barrier(2), ctx.Queue()
        procs = [ctx.Process(target=_prepare, args=(data_dir, barrier, queue)) for _ in range(2)]
        for p in procs:
            p.start()
        errors = [queue.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(timeout=60)
        assert errors == [None, None], errors
        assert all(p.exitcode == 0 for p in procs)
        files = {p.name: p.read_bytes() for p in data_dir.rglob("*") if p.is_file()}
        assert files == reference  # and no temporary file left behind


def test_atomic_path_and_dir_leave_the_target_whole_on_failure(tmp_path):
    target = tmp_path / "f.txt"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["f.txt"]
    with atomic_path(target) as tmp:
        assert tmp.parent == tmp_path and tmp != target
        tmp.write_text("new")
    assert target.read_text() == "new"
    folder = tmp_path / "d"
    with atomic_dir(folder) as tmp:
        (tmp / "x").write_text("1")
    with pytest.raises(RuntimeError), atomic_dir(folder) as tmp:
        (tmp / "x").write_text("2")
        raise RuntimeError
    assert (folder / "x").read_text() == "1"
    with atomic_dir(folder) as tmp:  # replaces a complete older build
        (tmp / "y").write_text("3")
    assert sorted(p.name for p in folder.iterdir()) == ["y"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "f.txt"]


def test_from_pyg_takes_class_names_as_labels_and_none_as_unlabelled():
    y = [NAMES[i % 3] for i in range(10)] + [None, ""]
    graph = TextAttributedGraph.from_pyg(_pyg(y=y, test=[9]), TEXTS, NAMES)
    assert graph.labels.tolist() == [i % 3 for i in range(10)] + [-1, -1]
    import numpy as np

    as_array = TextAttributedGraph.from_pyg(_pyg(y=np.array(y[:10] + ["a", "b"]), test=[9]),
                                            TEXTS, NAMES)  # fmt: skip
    assert as_array.labels.tolist()[:10] == graph.labels.tolist()[:10]
    with pytest.raises(ValueError) as err:
        TextAttributedGraph.from_pyg(_pyg(y=y[:11] + ["zebra"], test=[9]), TEXTS, NAMES)
    assert "class names that are not in label_names: ['zebra']" in _one_line(err)


def test_node_ids_name_nodes_and_survive_save_and_load(tmp_path):
    ids = [f"pkg:{i}" for i in range(12)]
    graph = TextAttributedGraph.from_pyg(_pyg(), TEXTS, NAMES, node_ids=ids)
    graph.save(tmp_path / "g")
    again = TextAttributedGraph.load(tmp_path / "g")
    assert again.node_ids == ids
    assert again.node_index("pkg:7") == 7 and again.node_index(3) == 3
    assert again.node_index("4") == 4
    with pytest.raises(ValueError, match=r"node 'pkg:99' is not in .*'pkg:0'"):
        again.node_index("pkg:99")
    with pytest.raises(ValueError, match="give 0..11"):
        again.node_index(12)
    numeric = TextAttributedGraph.from_pyg(
        _pyg(), TEXTS, NAMES, node_ids=[str(100 + i) for i in range(11)] + ["3"]
    )
    assert numeric.node_index("105") == 5 and numeric.node_index("id:3") == 11
    assert numeric.node_index(3) == 3
    with pytest.raises(
        ValueError, match="'3' is ambiguous: the id of node 11 and the index of node 3"
    ):
        numeric.node_index("3")


def test_a_graph_without_edges_is_named(tmp_path):
    data = _pyg()
    data.edge_index = torch.zeros(2, 0, dtype=torch.long)
    with pytest.warns(UserWarning, match="has no edges"):
        TextAttributedGraph.from_pyg(data, TEXTS, NAMES)


def test_a_moved_graph_folder_says_how_to_point_at_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="--graph PATH"):
        TextAttributedGraph.load(tmp_path / "gone")


@pytest.mark.parametrize(
    "damage", [b"\xff" * 5, b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage!!!!!!!}"]
)
def test_a_damaged_graph_safetensors_header_is_one_line(tmp_path, damage):
    _saved(tmp_path)
    (tmp_path / "g" / "graph.safetensors").write_bytes(damage)
    with pytest.raises(DataError) as err:
        TextAttributedGraph.load(tmp_path / "g")
    assert "not a readable graph (SafetensorError" in _one_line(err)

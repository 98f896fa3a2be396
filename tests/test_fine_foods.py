"""The fine-food reviews text stand-in: R lazy-load data read without R, the fetch's checks, and
the text task built from it."""

from __future__ import annotations

import gzip
import json
import lzma
import shutil
import struct
import zlib
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from structattn.data import fetch
from structattn.data.rlazy import lazyload_names, read_lazyload
from structattn.data.tasks import load_task
from structattn.data.text import read_fine_foods
from structattn.errors import DataError

LZMA2 = [{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}]


def _serialize(obj) -> bytes:
    from rdata.conversion import convert_python_to_r_data
    from rdata.unparser import unparse_data

    return unparse_data(convert_python_to_r_data(obj, file_type="rds"), file_format="xdr")


def _piece(raw: bytes, kind: bytes) -> bytes:
    body = {
        b"Z": lambda b: lzma.compress(b, format=lzma.FORMAT_RAW, filters=LZMA2),
        b"1": zlib.compress,
        b"0": lambda b: b,
    }[kind](raw)
    return struct.pack(">I", len(raw)) + kind + body


def write_lazyload(folder: Path, objects: dict, kinds=None) -> Path:
    """A lazy-load database as R writes one (``Rdata.rdx`` + ``Rdata.rdb``) holding ``objects``."""
    folder.mkdir(parents=True, exist_ok=True)
    rdb, index = b"", {}
    for i, (name, obj) in enumerate(objects.items()):
        kind = (kinds or [b"Z"])[i % len(kinds or [b"Z"])]
        piece = _piece(_serialize(obj), kind)
        index[name] = np.array([len(rdb), len(piece)], dtype=np.int32)
        rdb += piece
    (folder / "Rdata.rdb").write_bytes(rdb)
    rdx = {"variables": index, "references": {}, "compressed": 3}
    (folder / "Rdata.rdx").write_bytes(gzip.compress(_serialize(rdx)))
    return folder / "Rdata"


def _frame(reviews, scores):
    return pd.DataFrame({
        "product": [f"B{i:09d}" for i in range(len(reviews))],
        "review": reviews,
        "score": pd.Categorical(scores, categories=["great", "other"]),
    })  # fmt: skip


TRAIN = _frame(
    ["Love it, great taste.", "Stale and bland.", "Five stars!", "Not again ☹", "Best", "Meh."],
    ["great", "other", "great", "other", "great", "other"],
)
TEST = _frame(["Great deal", "Arrived broken"], ["great", "other"])


def test_lazyload_reads_every_compression_and_names_objects(tmp_path):
    base = write_lazyload(tmp_path, {"training_data": TRAIN, "testing_data": TEST,
                                     "n": np.array([3.5])}, kinds=[b"Z", b"1", b"0"])  # fmt: skip
    assert sorted(lazyload_names(base)) == ["n", "testing_data", "training_data"]
    got = read_lazyload(base, "training_data")
    assert list(got["review"]) == list(TRAIN["review"])  # non-ASCII text survives
    assert list(got["score"]) == list(TRAIN["score"])
    assert list(read_lazyload(base, "testing_data")["product"]) == list(TEST["product"])
    assert float(np.asarray(read_lazyload(base, "n"))[0]) == 3.5
    with pytest.raises(KeyError, match="no object 'missing'"):
        read_lazyload(base, "missing")


def test_lazyload_damaged_files_are_value_errors(tmp_path):
    base = write_lazyload(tmp_path, {"training_data": TRAIN})
    rdb = (tmp_path / "Rdata.rdb").read_bytes()
    (tmp_path / "Rdata.rdb").write_bytes(rdb[:5] + bytes(len(rdb) - 5))  # zeroed stream
    with pytest.raises(ValueError):
        read_lazyload(base, "training_data")
    (tmp_path / "Rdata.rdb").write_bytes(rdb[: len(rdb) // 2])  # cut short
    with pytest.raises(ValueError, match="shorter than its index"):
        read_lazyload(base, "training_data")
    (tmp_path / "Rdata.rdx").write_bytes(b"not compressed at all")
    with pytest.raises(ValueError, match="rdx"):
        lazyload_names(base)


def _install_fixture(monkeypatch, source: Path, counts=(6, 2)):
    """fetch_fine_foods on the fixture database instead of the Debian package."""

    def fake_debian_files(package, folder, names, dest):
        assert package == fetch.FINE_FOODS_PACKAGE and folder == fetch.FINE_FOODS_RDATA
        for name in names:
            shutil.copy2(source / name, Path(dest) / name)

    monkeypatch.setattr(fetch, "_debian_files", fake_debian_files)
    monkeypatch.setattr(fetch, "FINE_FOODS_SPLITS", dict(zip(("train", "test"), counts)))


def test_fetch_writes_jsonl_checks_counts_and_pinned_hash(tmp_path, monkeypatch):
    src = tmp_path / "deb"
    write_lazyload(src, {"training_data": TRAIN, "testing_data": TEST})
    _install_fixture(monkeypatch, src)
    monkeypatch.setattr(fetch, "FINE_FOODS_SHA256", "0" * 64)
    with pytest.raises(fetch.FetchError, match="not the pinned"):
        fetch.fetch_fine_foods(tmp_path / "data")
    digest = fetch._fine_foods_digest(tmp_path / "data" / "fine-foods")
    monkeypatch.setattr(fetch, "FINE_FOODS_SHA256", digest)
    folder = fetch.fetch_fine_foods(tmp_path / "data")
    rows = [json.loads(x) for x in (folder / "train.jsonl").read_text("utf-8").splitlines()]
    assert [r["review"] for r in rows] == list(TRAIN["review"])
    assert [r["score"] for r in rows] == list(TRAIN["score"])
    assert fetch.fine_foods_complete(folder)
    texts, labels = read_fine_foods(folder, "test")
    assert texts == list(TEST["review"]) and labels == [1, 0]  # 1 = great (five stars)
    # a second fetch finds the files complete and touches nothing
    monkeypatch.setattr(fetch, "_debian_files", lambda *a: pytest.fail("fetched again"))
    assert fetch.fetch_fine_foods(tmp_path / "data") == folder


def test_fetch_refuses_a_package_with_other_counts(tmp_path, monkeypatch):
    src = tmp_path / "deb"
    write_lazyload(src, {"training_data": TRAIN, "testing_data": TEST})
    _install_fixture(monkeypatch, src, counts=(4000, 1000))
    with pytest.raises(fetch.FetchError, match="holds 6 reviews, expected 4000"):
        fetch.fetch_fine_foods(tmp_path / "data")


def _jsonl(folder: Path, split: str, frame) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"product": p, "review": r, "score": s}
            for p, r, s in zip(frame["product"], frame["review"], frame["score"])]  # fmt: skip
    (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), "utf-8")


def test_text_task_on_fine_foods_bytes_and_splits(tmp_path):
    folder = tmp_path / "fine-foods"
    _jsonl(folder, "train", TRAIN)
    _jsonl(folder, "test", TEST)
    data = load_task(task="text", text_stand_in="fine-foods", data_dir=tmp_path, seq_len=8,
                     val_fraction=0.34)  # fmt: skip
    assert data.stand_in and "fine-food" in data.source and "stand-in" in data.source
    assert data.class_names == ["other", "great"]
    assert len(data.train) + len(data.val) == 6 and len(data.test) == 2
    x, y = data.test[0]
    assert x.tolist() == [b + 1 for b in b"Great de"] and int(y) == 1  # bytes + 1, cut at T


def test_damaged_review_lines_are_named(tmp_path):
    folder = tmp_path / "fine-foods"
    folder.mkdir()
    (folder / "train.jsonl").write_text('{"review": "ok", "score": "great"}\n{"review": 3\n')
    with pytest.raises(DataError, match="train.jsonl:2"):
        read_fine_foods(folder, "train")
    (folder / "train.jsonl").write_text('{"review": "ok", "score": "five"}\n')
    with pytest.raises(DataError, match="score one of"):
        read_fine_foods(folder, "train")
    with pytest.raises(FileNotFoundError, match="data fetch --only fine-foods"):
        read_fine_foods(folder, "test")
    with pytest.raises(ValueError, match="text_stand_in"):
        load_task(task="text", text_stand_in="imdb", data_dir=tmp_path)

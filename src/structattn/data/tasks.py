"""The paper's three tasks, each from the original data when present or an offline stand-in.

=========  ===============================  ==========================================  ======
task       paper data (read when present)   offline default                             T
=========  ===============================  ==========================================  ======
listops    LRA ``basic_{train,val,test}``   own generator (same task), cached as TSV    512
           ``.tsv`` in ``<data>/listops``
image      CIFAR-10 ``cifar-10-batches-py``  Fashion-MNIST (STAND-IN), grey levels        1024/784
text       IMDB ``aclImdb``                 SpamAssassin bodies (STAND-IN), bytes        1024
                                            or fine-food reviews (STAND-IN), bytes
=========  ===============================  ==========================================  ======

The text stand-in is ``text_stand_in``: ``spam-assassin`` (spam or not; byte counts alone
solve most of it) or ``fine-foods`` (5,000 Amazon reviews, five stars or not: sentiment, like
IMDB).

``<data>`` is ``data_dir`` (default ``$STRUCTATTN_DATA_DIR`` or ``~/.cache/structattn``).
Splits are deterministic for a seed: validation comes out of the training data where a dataset
has none; stand-ins without a test split are split 80/10/10.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from structattn.errors import ConfigError

from . import listops as lo
from .base import SequenceDataset, TaskData, default_data_dir, split_indices
from .images import (
    CIFAR10_CLASSES,
    FASHION_CLASSES,
    images_to_sequences,
    read_cifar10,
    read_idx,
)
from .text import (
    FINE_FOODS_CLASSES,
    encode_bytes,
    read_aclimdb,
    read_fine_foods,
    read_spam_assassin,
    stand_in_folder,
)

__all__ = ["TASKS", "TaskSpec", "load_task"]

TASKS = ("listops", "image", "text")
TEXT_STAND_INS = ("spam-assassin", "fine-foods")


@dataclass
class TaskSpec:
    """How to build one task's data."""

    task: str = "listops"  # listops | image | text
    data_dir: Path | None = None  # data cache (default $STRUCTATTN_DATA_DIR or ~/.cache/structattn)
    seq_len: int | None = None  # T: ListOps max length (512), text truncation (1024); images: H*W
    source: str = "auto"  # auto (original if present, else stand-in) | original | stand-in
    max_train: int | None = None  # keep at most this many training examples (None: all)
    max_val: int | None = None  # keep at most this many validation examples
    max_test: int | None = None  # keep at most this many test examples
    listops_sizes: tuple[int, int, int] = (96000, 2000, 2000)  # generated train/val/test sizes
    listops_min_length: int = 64  # shortest generated ListOps example (tokens without parens)
    rgb: bool = False  # CIFAR-10 as interleaved RGB (T = 3072) instead of grey
    image_pool: int = 1  # average-pool images k x k before flattening (2: 28x28 -> 14x14)
    text_stand_in: str = "spam-assassin"  # text without IMDB: spam-assassin | fine-foods
    val_fraction: float = 0.1  # validation share carved out of training data when needed
    seed: int = 0  # split and generation seed

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        if self.source not in ("auto", "original", "stand-in"):
            raise ValueError(f"source must be auto, original or stand-in, got {self.source!r}")
        if self.seq_len is not None and self.seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {self.seq_len}")
        for name in ("max_train", "max_val", "max_test"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {value}")
        sizes = tuple(self.listops_sizes)
        if len(sizes) != 3 or any(
            isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in sizes
        ):
            raise ValueError(
                "listops_sizes must be three whole numbers >= 1 (train, val, test examples), "
                f"got {list(sizes)}"
            )
        if self.listops_min_length < 1:
            raise ValueError(f"listops_min_length must be >= 1, got {self.listops_min_length}")
        longest = self.seq_len or 512
        generated = self.task == "listops" and self.source != "original"
        if generated and self.listops_min_length > longest:
            raise ValueError(
                f"listops_min_length={self.listops_min_length} is above seq_len={longest}, the "
                "longest generated example: no example could be generated"
            )
        if self.text_stand_in not in TEXT_STAND_INS:
            raise ValueError(
                f"text_stand_in must be one of {TEXT_STAND_INS}, got {self.text_stand_in!r}"
            )
        if self.image_pool < 1:
            raise ValueError(f"image_pool must be >= 1, got {self.image_pool}")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction}")


def _dataset(seqs, labels) -> SequenceDataset:
    return SequenceDataset([torch.as_tensor(s) for s in seqs], labels)


def _limit(ds: SequenceDataset, n: int | None, seed: int) -> SequenceDataset:
    if n is None or n >= len(ds):
        return ds
    perm = torch.randperm(len(ds), generator=torch.Generator().manual_seed(seed))
    return ds.subset(perm[:n].sort().values)


def _pick(spec: TaskSpec, original: Path, what: str) -> bool:
    """True to read the original data at ``original``."""
    if spec.source == "original":
        if not original.exists():
            raise FileNotFoundError(f"{what} not found at {original} (source='original')")
        return True
    return spec.source == "auto" and original.exists()


def _listops(spec: TaskSpec, root: Path, write_cache: bool = True) -> TaskData:
    T = spec.seq_len or 512
    lra = root / "listops"
    if _pick(spec, lra / "basic_train.tsv", "LRA ListOps TSVs"):
        splits = [lo.read_listops_tsv(lra / f"basic_{s}.tsv") for s in ("train", "val", "test")]
        source = f"ListOps, LRA TSVs from {lra}"
        if any(len(lo.listops_tokens(s)) > T for split in splits for s, _ in split):
            source += f", truncated to T={T}"
    else:
        n_train, n_val, n_test = spec.listops_sizes
        if spec.max_train:
            n_train = min(n_train, spec.max_train)
        if spec.max_val:
            n_val = min(n_val, spec.max_val)
        if spec.max_test:
            n_test = min(n_test, spec.max_test)
        cache = (
            root
            / "listops-generated"
            / (f"len{spec.listops_min_length}-{T}_seed{spec.seed}_{n_train}-{n_val}-{n_test}")
        )
        paths = [cache / f"basic_{s}.tsv" for s in ("train", "val", "test")]
        if all(p.is_file() for p in paths):
            splits = [lo.read_listops_tsv(p) for p in paths]
        else:
            examples = lo.generate_listops(
                n_train + n_val + n_test,
                min_length=spec.listops_min_length,
                max_length=T,
                seed=spec.seed,
            )
            bounds = [0, n_train, n_train + n_val, n_train + n_val + n_test]
            splits = [examples[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
            if write_cache:
                for path, split in zip(paths, splits):
                    lo.write_listops_tsv(path, split)  # atomic, per-process temporary name
        source = f"ListOps, own generator (LRA rules), lengths {spec.listops_min_length}-{T}"
    datasets = [
        _dataset([lo.encode_listops(s)[:T] for s, _ in split], [y for _, y in split])
        for split in splits
    ]
    return TaskData(
        "listops",
        *datasets,
        num_classes=10,
        vocab_size=len(lo.VOCAB),
        seq_len=T,
        source=source,
        stand_in=False,
        class_names=[str(i) for i in range(10)],
    )


def _train_val(spec, seqs, labels):
    train_idx, val_idx = split_indices(
        len(labels), [1 - spec.val_fraction, spec.val_fraction], seed=spec.seed
    )
    labels = np.asarray(labels)
    return (
        _dataset([seqs[i] for i in train_idx], labels[train_idx.numpy()]),
        _dataset([seqs[i] for i in val_idx], labels[val_idx.numpy()]),
    )


def _pool(images: np.ndarray, k: int) -> np.ndarray:
    """Average-pool ``(N, H, W[, C])`` uint8 images by ``k`` per side (edges cropped)."""
    n, h, w = images.shape[:3]
    h, w = h // k * k, w // k * k
    x = images[:, :h, :w].astype(np.float64)
    x = x.reshape(n, h // k, k, w // k, k, *images.shape[3:]).mean(axis=(2, 4))
    return np.clip(np.rint(x), 0, 255).astype(np.uint8)


def _image(spec: TaskSpec, root: Path) -> TaskData:
    cifar = root / "cifar-10-batches-py"
    if _pick(spec, cifar, "CIFAR-10 python batches"):
        data = read_cifar10(cifar)
        train_x, train_y = data["train"]
        test_x, test_y = data["test"]
        source, stand_in, names = (
            "CIFAR-10" + (" RGB" if spec.rgb else " grey"),
            False,
            CIFAR10_CLASSES,
        )
    else:
        folder = root / "fashion-mnist"
        if not folder.is_dir():
            raise FileNotFoundError(
                f"no image data: neither {cifar} nor {folder}; run `make data` or "
                "`structattn data fetch` to fetch the Fashion-MNIST stand-in"
            )
        train_x = read_idx(folder / "train-images-idx3-ubyte.gz")
        train_y = read_idx(folder / "train-labels-idx1-ubyte.gz")
        test_x = read_idx(folder / "t10k-images-idx3-ubyte.gz")
        test_y = read_idx(folder / "t10k-labels-idx1-ubyte.gz")
        source, stand_in, names = "Fashion-MNIST (stand-in for CIFAR-10)", True, FASHION_CLASSES
        if spec.rgb:
            raise ConfigError("rgb=True needs CIFAR-10; the Fashion-MNIST stand-in is grey")
    smallest = min(train_x.shape[1:3])
    if spec.image_pool > smallest:
        raise ConfigError(
            f"image_pool={spec.image_pool} is larger than the images "
            f"({train_x.shape[1]}x{train_x.shape[2]}): at most {smallest}"
        )
    if spec.image_pool > 1:
        train_x, test_x = _pool(train_x, spec.image_pool), _pool(test_x, spec.image_pool)
        side = train_x.shape[1]
        source += f", average-pooled {spec.image_pool}x{spec.image_pool} to {side}x{side}"
    train_seq = images_to_sequences(train_x, rgb=spec.rgb)
    test_seq = images_to_sequences(test_x, rgb=spec.rgb)
    T = train_seq.shape[1]
    if spec.seq_len is not None and spec.seq_len != T:
        raise ConfigError(f"seq_len={spec.seq_len} but these images give T = H*W = {T}")
    train, val = _train_val(spec, list(train_seq), train_y.astype(np.int64))
    test = _dataset(list(test_seq), test_y.astype(np.int64))
    return TaskData(
        "image",
        train,
        val,
        test,
        num_classes=10,
        vocab_size=257,
        seq_len=T,
        source=source,
        stand_in=stand_in,
        class_names=list(names),
    )


def _text(spec: TaskSpec, root: Path) -> TaskData:
    T = spec.seq_len or 1024
    imdb = root / "aclImdb"
    if _pick(spec, imdb, "aclImdb"):
        train_texts, train_y = read_aclimdb(imdb, "train")
        test_texts, test_y = read_aclimdb(imdb, "test")
        train, val = _train_val(spec, [encode_bytes(t, T) for t in train_texts], train_y)
        test = _dataset([encode_bytes(t, T) for t in test_texts], test_y)
        source, stand_in, names = "IMDB (aclImdb), bytes", False, ["negative", "positive"]
    elif spec.text_stand_in == "fine-foods":
        folder = root / "fine-foods"
        train_texts, train_y = read_fine_foods(folder, "train")
        test_texts, test_y = read_fine_foods(folder, "test")
        train, val = _train_val(spec, [encode_bytes(t, T) for t in train_texts], train_y)
        test = _dataset([encode_bytes(t, T) for t in test_texts], test_y)
        source = "Amazon fine-food reviews (modeldata small_fine_foods; stand-in for IMDB), bytes"
        stand_in, names = True, list(FINE_FOODS_CLASSES)
    else:
        texts, labels, _ = read_spam_assassin(stand_in_folder(root))
        seqs = [encode_bytes(t, T) for t in texts]
        parts = split_indices(len(seqs), [0.8, 0.1, 0.1], seed=spec.seed)
        labels = np.asarray(labels)
        train, val, test = (_dataset([seqs[i] for i in p], labels[p.numpy()]) for p in parts)
        source = "SpamAssassin message bodies (stand-in for IMDB), bytes"
        stand_in, names = True, ["ham", "spam"]
    return TaskData(
        "text",
        train,
        val,
        test,
        num_classes=2,
        vocab_size=257,
        seq_len=T,
        source=source,
        stand_in=stand_in,
        class_names=names,
    )


def load_task(spec: TaskSpec | None = None, write_cache: bool = True, **overrides) -> TaskData:
    """Build a task's splits: ``load_task(TaskSpec(task="image"))`` or
    ``load_task(task="text", seq_len=512)``. With ``write_cache=False`` nothing is written under
    the data folder (generated ListOps missing there is generated in memory): for a folder a
    handed run's config names, which is read but never written."""
    spec = TaskSpec(**overrides) if spec is None else spec
    root = Path(spec.data_dir) if spec.data_dir is not None else default_data_dir()
    if spec.task == "listops":
        data = _listops(spec, root, write_cache)
    else:
        data = {"image": _image, "text": _text}[spec.task](spec, root)
    data.train = _limit(data.train, spec.max_train, spec.seed)
    data.val = _limit(data.val, spec.max_val, spec.seed + 1)
    data.test = _limit(data.test, spec.max_test, spec.seed + 2)
    return data

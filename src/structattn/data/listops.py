"""ListOps: nested list operations over digits (Nangia & Bowman 2018; LRA's long version).

Our own generator following the Long Range Arena description. A tree is either a digit 0-9 or an
operator applied to 2..``max_args`` subtrees:

    MIN, MAX   minimum / maximum of the arguments
    MED        median, truncated to an integer (``int(median)``)
    SM         sum modulo 10

The label (10 classes) is the value of the whole expression. Sources use LRA's TSV format:
a header ``Source<TAB>Target``; each operator node with arguments ``a1 .. an`` is written as the
left-nested pairs ``((((OP a1) a2) ...) ])`` with every pair in ``( ... )``, e.g.::

    ( ( ( [MAX 2 ) 9 ) ] )            -> 9

The *length* of an example is its token count after dropping ``(`` and ``)``, i.e. operators,
digits and ``]``; the models see exactly those tokens.
"""

from __future__ import annotations

import csv
import io
import random
import statistics
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path

from structattn.errors import DataError
from structattn.utils.files import atomic_path

__all__ = [
    "OPERATORS",
    "VOCAB",
    "evaluate_listops",
    "generate_listops",
    "listops_tokens",
    "read_listops_tsv",
    "write_listops_tsv",
    "PRESETS",
]

OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
END = "]"
#: Model vocabulary; id 0 is padding.
VOCAB = ("<pad>", *(str(i) for i in range(10)), *OPERATORS, END)
_TOKEN_ID = {tok: i for i, tok in enumerate(VOCAB)}
_DIGITS = frozenset(VOCAB[1:11])  # "0" .. "9" (str.isdigit() also accepts "²")
_BRANCH_P = 0.25  # probability that a node below max_depth is an operator (LRA's VALUE_P)

#: Length presets: the paper's T = 512 and LRA's 500-2000.
PRESETS = {
    "listops-512": dict(min_length=64, max_length=512),
    "lra": dict(min_length=500, max_length=2000),
}


def _apply(op: str, args: list[int]) -> int:
    if op == "[MIN":
        return min(args)
    if op == "[MAX":
        return max(args)
    if op == "[MED":
        return int(statistics.median(args))
    if op == "[SM":
        return sum(args) % 10
    raise ValueError(f"unknown ListOps operator {op!r}")


def _random_tree(rng: random.Random, depth: int, max_depth: int, max_args: int):
    """Return ``(tree, length)``; a tree is an int or ``(op, [subtrees])``."""
    if depth >= max_depth or rng.random() > _BRANCH_P:
        return rng.randrange(10), 1
    op = rng.choice(OPERATORS)
    children, length = [], 2  # the operator and "]"
    for _ in range(rng.randint(2, max_args)):
        child, n = _random_tree(rng, depth + 1, max_depth, max_args)
        children.append(child)
        length += n
    return (op, children), length


def _value(tree) -> int:
    if isinstance(tree, int):
        return tree
    op, children = tree
    return _apply(op, [_value(c) for c in children])


def _render(tree) -> str:
    """LRA's parenthesised form: every (left, right) pair of the left-nested chain in parens."""
    if isinstance(tree, int):
        return str(tree)
    op, children = tree
    text = op
    for child in children:
        text = f"( {text} {_render(child)} )"
    return f"( {text} {END} )"


def generate_listops(
    num_examples: int,
    *,
    min_length: int,
    max_length: int,
    seed: int,
    max_depth: int = 10,
    max_args: int = 10,
) -> list[tuple[str, int]]:
    """Generate distinct ListOps examples with ``min_length <= length <= max_length``.

    Deterministic for a given ``seed``. Returns ``[(source, target)]`` with ``source`` in LRA's
    parenthesised format and ``target`` in 0..9. Raises ``ValueError`` on impossible bounds.
    """
    if num_examples < 0:
        raise ValueError(f"num_examples must be >= 0, got {num_examples}")
    if not 1 <= min_length <= max_length:
        raise ValueError(f"need 1 <= min_length <= max_length, got {min_length}, {max_length}")
    if max_depth < 1 or max_args < 2:
        raise ValueError(f"need max_depth >= 1 and max_args >= 2, got {max_depth}, {max_args}")
    if min_length > 1 and max_depth < 2:
        raise ValueError("max_depth must be >= 2 to reach lengths above 1")
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[tuple[str, int]] = []
    attempts, limit = 0, 2000 * max(num_examples, 1) + 100_000
    while len(out) < num_examples:
        attempts += 1
        if attempts > limit:
            raise ValueError(
                f"could not generate {num_examples} examples with lengths in "
                f"[{min_length}, {max_length}] (max_depth={max_depth}, max_args={max_args})"
            )
        tree, length = _random_tree(rng, 1, max_depth, max_args)
        if not min_length <= length <= max_length:
            continue
        source = _render(tree)
        if source in seen:
            continue
        seen.add(source)
        out.append((source, _value(tree)))
    return out


def listops_tokens(source: str) -> list[str]:
    """Tokens of a source without ``(`` and ``)`` (what the models read)."""
    return [t for t in source.split() if t not in ("(", ")")]


def encode_listops(source: str) -> list[int]:
    """Token ids (see :data:`VOCAB`; 0 is padding). Raises ``ValueError`` on unknown tokens."""
    try:
        return [_TOKEN_ID[t] for t in listops_tokens(source)]
    except KeyError as err:
        raise ValueError(f"unknown ListOps token {err.args[0]!r}") from None


def evaluate_listops(source: str) -> int:
    """Value of a source (parenthesised or not), computed with a stack."""
    stack: list[list] = []
    result = None
    for tok in listops_tokens(source):
        if tok in OPERATORS:
            stack.append([tok])
        elif tok == END:
            if not stack:
                raise ValueError("unbalanced ']' in ListOps source")
            op, *args = stack.pop()
            value = _apply(op, args)
            if stack:
                stack[-1].append(value)
            else:
                result = value
        elif tok in _DIGITS:
            if stack:
                stack[-1].append(int(tok))
            else:
                result = int(tok)
        else:
            raise ValueError(f"unknown ListOps token {tok!r}")
    if stack or result is None:
        raise ValueError("unbalanced ListOps source (missing ']')")
    return result


def write_listops_tsv(path: str | Path, examples: Iterable[tuple[str, int]]) -> None:
    """Write LRA's TSV: header ``Source<TAB>Target``, one example per row. The file is written
    under a temporary name of this process's own and renamed, so a reader (or another process
    writing the same file) never sees half of it."""
    with atomic_path(path) as tmp, tmp.open("w", newline="") as f:
        writer = csv.writer(f, delimiter="\t", lineterminator="\n")
        writer.writerow(["Source", "Target"])
        for source, target in examples:
            writer.writerow([source, target])


@contextmanager
def _field_size_limit(limit: int):
    """Let ``csv`` read fields up to ``limit`` characters (its default stops at 131,072, and
    LRA-style sources can be longer), restoring the previous limit afterwards."""
    previous = csv.field_size_limit()
    csv.field_size_limit(max(previous, min(limit, 2**31 - 1)))
    try:
        yield
    finally:
        csv.field_size_limit(previous)


def read_listops_tsv(path: str | Path) -> list[tuple[str, int]]:
    """Read an LRA ListOps TSV (``basic_train.tsv`` ...): ``[(source, target)]``.

    Raises ``ValueError`` naming the file and line for a missing header, a wrong column count or
    a target that is not a digit 0-9.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"ListOps TSV not found: {path}")
    out = []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        line = path.read_bytes()[: err.start].count(b"\n") + 1
        raise DataError(f"{path}:{line}: not UTF-8 text ({err.reason})") from None
    with io.StringIO(text, newline="") as f, _field_size_limit(len(text) + 1):
        reader = csv.reader(f, delimiter="\t")
        header = next(reader, None)
        if header is None or [h.strip() for h in header[:2]] != ["Source", "Target"]:
            raise DataError(f"{path}:1: expected header 'Source<TAB>Target', got {header!r}")
        for lineno, row in enumerate(reader, start=2):
            if not row:
                continue
            if len(row) != 2:
                raise DataError(
                    f"{path}:{lineno}: expected 2 tab-separated columns, got {len(row)}"
                )
            source, target = row
            digits = target.strip()  # ASCII only: str.isdigit() is also True for "²", "٣"
            if not (digits.isascii() and digits.isdigit()) or not 0 <= int(digits) <= 9:
                raise DataError(f"{path}:{lineno}: target must be a digit 0-9, got {target!r}")
            try:
                encode_listops(source)
            except ValueError as err:
                raise DataError(f"{path}:{lineno}: {err}") from None
            if not listops_tokens(source):
                raise DataError(f"{path}:{lineno}: empty source")
            out.append((source, int(digits)))
    if not out:
        raise DataError(f"{path}: no examples after the header")
    return out

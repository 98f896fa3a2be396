"""``code-names``: name a Python function from its syntax tree, built as ogbg-code2 is built.

ogbg-code2 (OGB) turns CodeSearchNet's Python functions into abstract syntax trees and asks for
the function's name as sub-tokens. Its files cannot be downloaded here, so the same construction
is repeated offline on real code that the package registries serve: a fixed list of pinned
pure-Python distributions (:data:`DISTRIBUTIONS`, versions and wheel hashes recorded) is fetched
once into the data cache by ``structattn data fetch --only code-names`` and read offline after.
Source files are parsed with :mod:`ast`, never imported or run.

One example per function or method (:func:`function_examples`):

* **nodes**: one per AST node in depth-first order, as OGB's walker visits them (expression
  contexts such as ``Load`` included), each with its type, its attribute where it has one (the
  identifier, argument, attribute or alias name, or the constant's text; :func:`node_attribute`)
  and its depth (the function's own node is the root, depth 0);
* **edges**: AST parent -> child, plus "next token" edges between consecutive attributed nodes in
  depth-first (source) order, as OGB's ``augment_edge`` adds them; each edge has a text
  (:data:`EDGE_TEXTS`);
* **masking**: every word that spells the function's name becomes ``_mask_``: its own node
  (OGB masks only that one), recursive uses (``Name``, ``Attribute``), arguments and keywords,
  and any identifier or string word whose sub-tokens hold the name's sub-tokens in order, in
  any case or spelling (``self.loadUser``, ``default_config`` inside ``_default_config``'s
  tree, ``"load user"``); no node text and no printed source holds the name's sub-token
  sequence;
* **docstrings are removed** (and comments are never in an AST): a difference from ogbg-code2,
  whose trees kept docstrings as string constants;
* **target**: the name split into lower-case sub-tokens at ``_`` and camelCase boundaries
  (:func:`split_subtokens`); models predict at most :data:`MAX_SUBTOKENS` (OGB's 5) and are
  scored against the whole list, as OGB's evaluator does;
* **source**: the masked function printed back as code (``ast.unparse``), for the baseline
  that reads code as text.

Like CodeSearchNet, special methods (``__init__``, ``__str__``, ...), names containing "test" and
files under test folders are left out, trees are kept within a node range (default 20-150), and
a function whose masked source repeats one seen earlier (train projects first) is dropped, so no
test example is a copy of a training one. The split is **by distribution** (OGB's project
split): train, validation and test functions come from different projects.
"""

from __future__ import annotations

import ast
import copy
import gzip
import hashlib
import json
import re
import sys
import zipfile
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

__all__ = [
    "DISTRIBUTIONS",
    "EDGE_TEXTS",
    "MASK",
    "MAX_SUBTOKENS",
    "CodeExample",
    "CodeNames",
    "Distribution",
    "build_code_names",
    "function_examples",
    "load_code_names",
    "node_attribute",
    "split_subtokens",
]

MASK = "_mask_"
MAX_SUBTOKENS = 5  # OGB's max_seq_len for ogbg-code2
#: Edge kinds of the stored (directed) edges: 0 = parent -> child, 1 = token -> next token.
EDGE_TEXTS = ("child", "next token")
#: Attributes longer than this are cut (long string constants), with an ellipsis.
MAX_ATTRIBUTE_CHARS = 80
FORMAT_VERSION = 2  # 2: masking by sub-token sequence


@dataclass(frozen=True)
class Distribution:
    """A pinned wheel on PyPI: ``name==version`` with the sha256 of its file, and the split its
    functions go to."""

    name: str
    version: str
    split: str  # train | val | test
    first_release: str  # date of the project's first upload to PyPI (why it was chosen)
    sha256: str  # of the wheel file

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"


#: The distributions of ``code-names``. All were first published on PyPI in 2025, after
#: SmolLM2 (released November 2024) collected its pretraining data, so the LLM cannot have read
#: them; pure-Python wheels (nothing to compile), with enough functions of 20-150 AST nodes.
#: The test projects were fixed here, before any model was run, and no choice made on
#: validation looks at them.
DISTRIBUTIONS: tuple[Distribution, ...] = (
    Distribution(
        "a2a-sdk",
        "1.3.0",
        "train",
        "2025-05-15",
        "b94a73b5dc7ff1afe5f11d324480f83386a64d02b8a6b719baf013595284cc6c",
    ),
    Distribution(
        "acp-sdk",
        "1.0.3",
        "train",
        "2025-02-18",
        "a0a6b3c3d98072eeb7ee001fbd7a53ee25d550226c880b81221ddaad170172ee",
    ),
    Distribution(
        "agent-squad",
        "1.1.4",
        "train",
        "2025-05-05",
        "70c55d820f2b0fef36a9664b4376401c037b898c7ed3207ac0fd930dce5a3b82",
    ),
    Distribution(
        "any-agent",
        "1.18.0",
        "train",
        "2025-04-08",
        "76f31c8ba4f4d7dbf7b2e7d1fa13f7dd48d041c8960fbf3c36523dea5a184138",
    ),
    Distribution(
        "beeai-framework",
        "0.1.85",
        "train",
        "2025-02-19",
        "74c01b78784a9bb92e8c02c99db231b720243b2bb062a6817853ebc7fc4a1f4f",
    ),
    Distribution(
        "chatterbox-tts",
        "0.1.7",
        "train",
        "2025-05-28",
        "83782500e3ad4e7c919132e9d7eb8755f29f57c5bde5ec48c655ca23a4eb113c",
    ),
    Distribution(
        "claude-code-sdk",
        "0.0.25",
        "train",
        "2025-06-12",
        "3d6a4ef958182f311d6050776d2675d9b39650a2db221c582a0a5156472dcee3",
    ),
    Distribution(
        "fast-agent-mcp",
        "0.2.36",
        "train",
        "2025-02-22",
        "f4fdedd10a8f6767038e4861e898e1a86c9a5917a02ef49ae954b1ba84ec11f6",
    ),
    Distribution(
        "fastrtc",
        "0.0.34",
        "train",
        "2025-01-30",
        "6da3831da9c2257810b6c5e5fd7cdd4f1636d716f47ab49d8bb3f2d5d9e499ac",
    ),
    Distribution(
        "google-adk",
        "2.13.0",
        "train",
        "2025-03-17",
        "bec4c4ee0aa3e63a2243c23365c5aef666ea539bc48c78dfbbf004dbddfc5f00",
    ),
    Distribution(
        "helion",
        "1.5.1",
        "train",
        "2025-05-04",
        "d0ee963f7ebf81a6698c4a7a6b6f7f5c2eb20922f8bafd535c0cded0260cab87",
    ),
    Distribution(
        "kokoro",
        "0.9.4",
        "train",
        "2025-01-28",
        "a129dc6364a286bd6a92c396e9862459d3d3e45f2c15596ed5a94dcee5789efd",
    ),
    Distribution(
        "langchain-mcp-adapters",
        "0.3.2",
        "train",
        "2025-02-18",
        "094e6b3096dbcc408417d5722f6915f164772e50c502ae3d8989405bf12c3c84",
    ),
    Distribution(
        "mcp-use",
        "1.7.1",
        "train",
        "2025-03-30",
        "e92ee5032c02e8f4a2cde7b2ec1877c72064ff209543ff011c1170a5125d8922",
    ),
    Distribution(
        "mlx-audio",
        "0.6.2",
        "train",
        "2025-02-28",
        "db57a552bd0ab16aa1fcc435d5fdb1c692d78e64926fa1f73669805c782e5731",
    ),
    Distribution(
        "openai-agents",
        "0.24.0",
        "train",
        "2025-03-04",
        "18d4ac34e84ed937333ec8ce46395ed3521ffcbb0a521780a4c2eaa451467f49",
    ),
    Distribution(
        "pydantic-graph",
        "2.68.0",
        "train",
        "2025-01-10",
        "3428c563bb6346aeeda28a79322cfcbe4e0087d7a23881ec2f1b06a95e983f00",
    ),
    Distribution(
        "python-a2a",
        "0.5.10",
        "train",
        "2025-04-09",
        "032c496dfc8d56ffa7f6dedee8200afc0699dfc6b7a337d9c310089fda1a8747",
    ),
    Distribution(
        "gepa",
        "0.1.4",
        "val",
        "2025-08-11",
        "12b971039599625c156d2231f6d72a29c31a22e9c237689459b5f1a3c353f532",
    ),
    Distribution(
        "openai-guardrails",
        "0.3.6",
        "val",
        "2025-10-06",
        "de69f9457c4bd8c4f54c00f405e0bff9c88c1b29cc1c0ed2a40651927a903d95",
    ),
    Distribution(
        "verifiers",
        "0.4.0",
        "val",
        "2025-01-28",
        "cf73b3089c12ff1e2471130153cfa93cfe9beb8b49abfb2ceb917658d99fefe2",
    ),
    Distribution(
        "quack-kernels",
        "0.6.5",
        "test",
        "2025-06-20",
        "df1ddd31366c82eb9692fe087c671209189dcbde53c909c81a865d4ee66b158d",
    ),
    Distribution(
        "strands-agents",
        "1.62.0",
        "test",
        "2025-05-14",
        "331c94c61a5ddf2c4f06dfd877551bdd1d0bfee5ea89b76d6c546b65ea2104e1",
    ),
)


# ---------------------------------------------------------------------------- sub-tokens

_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")


def split_subtokens(name: str) -> list[str]:
    """``name`` split at underscores and camelCase boundaries, lower-cased: ``get_HTTPResponse``
    -> ``["get", "http", "response"]``, ``_to_utf8`` -> ``["to", "utf8"]``."""
    out = []
    for part in name.split("_"):
        out.extend(p.lower() for p in _CAMEL.split(part) if p)
    return out


# ---------------------------------------------------------------------------- one function


def node_attribute(node: ast.AST) -> str | None:
    """The node's attribute as OGB reads it (the first of ``name``, ``arg``, the constant's
    value, ``id``, ``attr`` that is set), or None. Constants give their text; ``None`` gives
    ``"None"`` (OGB's walker, reading the deprecated ``.s``/``.n``, left it unattributed)."""
    if isinstance(node, ast.Constant):
        value = node.value
        text = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    else:
        text = None
        for key in ("name", "arg", "id", "attr"):
            value = getattr(node, key, None)
            if isinstance(value, str):
                text = value
                break
    if text is None:
        return None
    if len(text) > MAX_ATTRIBUTE_CHARS:
        text = text[: MAX_ATTRIBUTE_CHARS - 1] + "…"
    return text


def _strip_docstrings(tree: ast.AST) -> None:
    """Remove the docstring of every function and class in ``tree`` (in place); a body left
    empty gets ``...`` so the tree still prints as code."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            body = node.body
            if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):  # fmt: skip
                del body[0]
                if not body:
                    body.append(ast.Expr(ast.Constant(...)))


_WORD = re.compile(r"[A-Za-z0-9_]+")


def _mask_text(text: str, name: str, target: list[str]) -> str:
    """``text`` with every word that spells the name replaced by :data:`MASK`: the name itself,
    and any run of words whose sub-tokens contain the name's sub-tokens in order, whatever the
    case or separator (``LoadUser``, ``self.load_user_id``, ``"load user"`` for ``load_user``).
    A word holding a name of two or more sub-tokens as written (``countDowns``) is masked too;
    words that only share a one-word name's letters (``truncate`` for ``run``) are kept."""
    words = [(m.start(), m.end(), split_subtokens(m.group())) for m in _WORD.finditer(text)]
    flat = [(w, s) for w, (_, _, subs) in enumerate(words) for s in subs]
    n = len(target)
    core = name.strip("_")
    hit = {w for w, (a, b, _) in enumerate(words) if n >= 2 and core in text[a:b]}
    for i in range(len(flat) - n + 1):
        if [s for _, s in flat[i : i + n]] == target:
            hit.update(w for w, _ in flat[i : i + n])
    for w in sorted(hit, reverse=True):  # right to left: earlier spans keep their offsets
        a, b, _ = words[w]
        text = text[:a] + MASK + text[b:]
    return text


def _mask_name(tree: ast.AST, name: str) -> None:
    """Mask the function's name everywhere in ``tree`` (in place): in every identifier,
    argument, attribute, alias and module name and in every string or bytes constant, each word
    that spells it (:func:`_mask_text`), so that no node text and no printed source holds the
    name or its sub-tokens in order."""
    target = split_subtokens(name)
    for node in ast.walk(tree):
        for key, value in ast.iter_fields(node):
            if isinstance(value, str):
                setattr(node, key, _mask_text(value, name, target))
            elif isinstance(value, bytes):
                text = value.decode("utf-8", "replace")
                masked = _mask_text(text, name, target)
                if masked != text:
                    setattr(node, key, masked.encode())
            elif isinstance(value, list) and value and all(isinstance(v, str) for v in value):
                setattr(node, key, [_mask_text(v, name, target) for v in value])


@dataclass
class CodeExample:
    """One function: where it came from, its target and its masked tree (depth-first order)."""

    project: str  # the distribution
    path: str  # the file inside the wheel
    qualname: str  # Class.method or function (the real name, for reading results)
    name: str
    subtokens: list[str]  # the whole target (models predict at most MAX_SUBTOKENS)
    node_types: list[str]
    node_attributes: list[str | None]
    depth: list[int]
    edges: list[tuple[int, int]]  # (source, destination)
    edge_kinds: list[int]  # index into EDGE_TEXTS
    source: str  # the masked function as code, docstrings removed

    @property
    def num_nodes(self) -> int:
        return len(self.node_types)

    @property
    def target(self) -> list[str]:
        return self.subtokens[:MAX_SUBTOKENS]

    def node_texts(self) -> list[str]:
        """One text per node: ``"Type"`` or ``"Type: attribute"``."""
        return [t if a is None else f"{t}: {a}"
                for t, a in zip(self.node_types, self.node_attributes)]  # fmt: skip

    def edge_texts(self) -> list[str]:
        return [EDGE_TEXTS[k] for k in self.edge_kinds]

    def leaf_order(self) -> list[int]:
        """The attributed nodes in source order (what the next-token edges chain)."""
        return [i for i, a in enumerate(self.node_attributes) if a is not None]


def _tree_graph(root: ast.AST):
    """Types, attributes, depths and parent -> child edges of ``root`` in depth-first order."""
    types, attrs, depth, edges = [], [], [], []
    stack: list[tuple[ast.AST, int, int]] = [(root, -1, 0)]
    while stack:  # pre-order, children in field order (as ast.NodeVisitor visits them)
        node, parent, d = stack.pop()
        index = len(types)
        types.append(type(node).__name__)
        attrs.append(node_attribute(node))
        depth.append(d)
        if parent >= 0:
            edges.append((parent, index))
        stack.extend((c, index, d + 1) for c in reversed(list(ast.iter_child_nodes(node))))
    return types, attrs, depth, edges


def _keep_name(name: str) -> bool:
    dunder = name.startswith("__") and name.endswith("__")
    return not dunder and "test" not in name.lower() and bool(split_subtokens(name))


def _functions(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Module-level functions and methods of (nested) classes, with their qualified names;
    functions defined inside functions belong to their parent's tree."""
    todo: list[tuple[str, ast.AST]] = [("", tree)]
    while todo:
        prefix, scope = todo.pop(0)
        for node in scope.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield prefix + node.name, node
            elif isinstance(node, ast.ClassDef):
                todo.append((f"{prefix}{node.name}.", node))


def function_examples(source: str, project: str, path: str, min_nodes: int = 20,
                      max_nodes: int = 150) -> list[CodeExample]:  # fmt: skip
    """Every kept function of one file (see the module's description); a file that does not
    parse as this Python's syntax gives none."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):  # newer syntax, or NUL bytes
        return []
    out = []
    for qualname, func in _functions(tree):
        name = func.name
        if not _keep_name(name):
            continue
        func = copy.deepcopy(func)
        _strip_docstrings(func)
        _mask_name(func, name)
        types, attrs, depth, edges = _tree_graph(func)
        if not min_nodes <= len(types) <= max_nodes:
            continue
        tokens = [i for i, a in enumerate(attrs) if a is not None]
        kinds = [0] * len(edges) + [1] * max(len(tokens) - 1, 0)
        edges = edges + list(zip(tokens[:-1], tokens[1:]))
        out.append(CodeExample(project, path, qualname, name, split_subtokens(name), types,
                               attrs, depth, edges, kinds, ast.unparse(func)))  # fmt: skip
    return out


def _is_test_path(path: str) -> bool:
    parts = PurePosixPath(path).parts
    stem = PurePosixPath(path).name
    return (any(p in ("test", "tests", "testing") for p in parts[:-1])
            or stem.startswith("test_") or stem.endswith("_test.py")
            or stem == "conftest.py")  # fmt: skip


def python_files(folder_or_wheel: Path) -> Iterator[tuple[str, str]]:
    """``(path, text)`` of every non-test ``.py`` file of a folder or wheel, in sorted order."""
    src = Path(folder_or_wheel)
    if src.is_dir():
        for p in sorted(src.rglob("*.py")):
            rel = p.relative_to(src).as_posix()
            if not _is_test_path(rel):
                yield rel, p.read_text(encoding="utf-8", errors="replace")
        return
    with zipfile.ZipFile(src) as wheel:
        for info in sorted(wheel.infolist(), key=lambda i: i.filename):
            if info.filename.endswith(".py") and not _is_test_path(info.filename):
                yield info.filename, wheel.read(info).decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------- the dataset

SPLITS = ("train", "val", "test")


@dataclass
class CodeNames:
    """The three splits and a summary of how they were built."""

    train: list[CodeExample]
    val: list[CodeExample]
    test: list[CodeExample]
    info: dict[str, Any] = field(default_factory=dict)

    def split(self, name: str) -> list[CodeExample]:
        if name not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {name!r}")
        return getattr(self, name)

    def save(self, folder: Path) -> None:
        """``<folder>/{train,val,test}.jsonl.gz`` and ``info.json`` (plain JSON: data only)."""
        from structattn.utils.files import atomic_path

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        for s in SPLITS:
            with atomic_path(folder / f"{s}.jsonl.gz") as tmp:
                with gzip.open(tmp, "wt", encoding="utf-8") as f:
                    for ex in self.split(s):
                        f.write(json.dumps(asdict(ex), ensure_ascii=False) + "\n")
        with atomic_path(folder / "info.json") as tmp:  # written last: marks a complete build
            tmp.write_text(json.dumps(self.info, indent=2))


def _read_split(path: Path) -> list[CodeExample]:
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            try:
                d = json.loads(line)
                d["edges"] = [tuple(e) for e in d["edges"]]
                out.append(CodeExample(**d))
            except (json.JSONDecodeError, TypeError, KeyError, UnicodeDecodeError) as err:
                what = f"{path}: line {line_no} is not a code-names example ({err})"
                raise ValueError(what) from None
    return out


def load_code_names(folder: Path) -> CodeNames:
    """A dataset written by :meth:`CodeNames.save`; a damaged or partial folder is named."""
    folder = Path(folder)
    info_path = folder / "info.json"
    if not info_path.is_file():
        raise FileNotFoundError(
            f"{folder} holds no built code-names dataset (no info.json): run "
            "`structattn data fetch --only code-names`"
        )
    try:
        info = json.loads(info_path.read_text())
        splits = [_read_split(folder / f"{s}.jsonl.gz") for s in SPLITS]
    except (OSError, EOFError, gzip.BadGzipFile, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{folder}: damaged code-names files ({err}); fetch it again") from None
    return CodeNames(*splits, info=info)


def _distribution_records(dists: Sequence[Distribution]) -> list[dict[str, str]]:
    return [asdict(d) for d in dists]


def record_distributions(data: CodeNames, dists: Sequence[Distribution]) -> None:
    """Note in ``data.info`` which pinned wheels it was built from."""
    data.info["distributions"] = _distribution_records(dists)


def build_info_matches(folder: Path, dists: Sequence[Distribution] | None = None) -> bool:
    """``folder`` holds a complete build of ``dists`` (default :data:`DISTRIBUTIONS`) in this
    format and by this Python (its ``ast`` decides the node types)."""
    dists = DISTRIBUTIONS if dists is None else dists
    try:
        info = json.loads((Path(folder) / "info.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return (
        info.get("format") == FORMAT_VERSION
        and info.get("python") == ".".join(map(str, sys.version_info[:2]))
        and info.get("distributions") == _distribution_records(dists)
        and all((Path(folder) / f"{s}.jsonl.gz").is_file() for s in SPLITS)
    )


def _size_summary(sizes: Sequence[int]) -> dict[str, Any]:
    if not sizes:
        return {"n": 0}
    s = sorted(sizes)
    q = lambda f: s[min(len(s) - 1, int(f * len(s)))]  # noqa: E731
    bins = list(range(0, 160, 10))
    hist = Counter(min(x // 10 * 10, bins[-1]) for x in s)
    return {"n": len(s), "min": s[0], "p25": q(0.25), "median": q(0.5), "p75": q(0.75),
            "max": s[-1], "histogram_by_10": {str(b): hist.get(b, 0) for b in bins}}  # fmt: skip


def build_code_names(
    projects: dict[str, tuple[str, Iterable[tuple[str, str]]]],
    min_nodes: int = 20,
    max_nodes: int = 150,
    progress: bool = False,
) -> CodeNames:
    """The dataset from ``{project: (split, [(path, source), ...])}``: examples of every file,
    exact repeats of an earlier masked source dropped (projects in split order train, val,
    test, then by name)."""
    for project, (split, _) in projects.items():
        if split not in SPLITS:
            raise ValueError(f"project {project}: split must be one of {SPLITS}, got {split!r}")
    order = sorted(projects, key=lambda p: (SPLITS.index(projects[p][0]), p))
    splits: dict[str, list[CodeExample]] = {s: [] for s in SPLITS}
    seen: set[str] = set()
    per_project: dict[str, dict[str, int]] = {}
    if progress:
        from tqdm import tqdm

        order = tqdm(order, desc="code-names: parsing projects", unit="project")
    for project in order:
        split, files = projects[project]
        counts = Counter()
        for path, text in files:
            counts["files"] += 1
            for ex in function_examples(text, project, path, min_nodes, max_nodes):
                digest = hashlib.sha256(ex.source.encode()).hexdigest()
                if digest in seen:
                    counts["duplicates"] += 1
                    continue
                seen.add(digest)
                counts["functions"] += 1
                splits[split].append(ex)
        per_project[project] = {"split": split, **counts}
    if not any(splits.values()):
        raise ValueError("no function of the given projects was kept")
    info = {
        "format": FORMAT_VERSION,
        "python": ".".join(map(str, sys.version_info[:2])),  # ast node types follow it
        "node_range": [min_nodes, max_nodes],
        "projects": per_project,
        "sizes": {s: _size_summary([ex.num_nodes for ex in splits[s]]) for s in SPLITS},
        "counts": {s: len(splits[s]) for s in SPLITS},
    }
    return CodeNames(splits["train"], splits["val"], splits["test"], info)

"""The architecture the layout promises: no import cycle between modules of ``structattn``, every
function short (documented GPU kernels aside), model packages free of command-line code, and a
run's data path, followed through its calls, short and never calling up a layer."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
MAX_LINES = 60


def _modules() -> dict[str, Path]:
    out = {}
    for path in (SRC / "structattn").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path], nested: bool = True) -> set[str]:
    """The modules of ``structattn`` that ``name`` imports: at the top level and, with
    ``nested``, inside functions too (an import deferred into a function still makes the two
    modules depend on each other)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree) if nested else tree.body:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                found.add(sub if sub in modules else module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in modules and m != name}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if not state.get(nxt):
                found = visit(nxt, stack)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if not state.get(node):
            found = visit(node, [])
            if found:
                return found
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycle_in_the_package():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert "structattn.engine.loop" in graph["structattn.engine.experiment"]  # it sees imports
    # and those inside functions (commands import their experiment when they run)
    top = _imports("structattn.cli", modules["structattn.cli"], modules, nested=False)
    assert graph["structattn.cli"] > top
    assert _cycle(graph) is None


def _documented_kernel(node: ast.FunctionDef) -> bool:
    """A GPU kernel (``@triton.jit``) whose docstring maps its loops to the math: it may stay
    long, one loop nest being easier to check against the formulas than its pieces."""
    jit = any(ast.unparse(d).endswith("jit") for d in node.decorator_list)
    return jit and len((ast.get_docstring(node) or "").splitlines()) >= 3


def test_every_function_is_short():
    long = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES and not _documented_kernel(node):
                    long.append(f"{name}.{node.name}: {lines} lines")
    assert not long, long


def test_the_length_rule_sees_long_functions_and_documented_kernels():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    plain = ast.parse(f"def f():\n{body}\n").body[0]
    assert plain.end_lineno - plain.lineno + 1 > MAX_LINES and not _documented_kernel(plain)
    doc = '    """One.\n\n    The loop, as the formula."""\n'
    kernel = ast.parse(f"@triton.jit\ndef k():\n{doc}{body}\n").body[0]
    assert _documented_kernel(kernel)
    undocumented = ast.parse(f"@triton.jit\ndef k():\n{body}\n").body[0]
    assert not _documented_kernel(undocumented)


#: Packages a user builds and trains models from; the command line is the experiments' business.
MODEL_PACKAGES = ("structattn.hkt", "structattn.glfusion", "structattn.data", "structattn.engine")


def _third_party(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_model_packages_import_no_command_line_library():
    modules = _modules()
    assert "tyro" in _third_party(modules["structattn.experiments.commands"])  # it sees tyro
    offenders = sorted(
        name
        for name, path in modules.items()
        if name.startswith(MODEL_PACKAGES) and "tyro" in _third_party(path)
    )
    assert not offenders, offenders


# --------------------------------------------------------------- following a run's data path

#: Layers, lowest first: a call from a lower layer into a higher one is a climb.
LAYERS = ("utils", "errors", "compat", "data", "hkt", "glfusion", "engine", "experiments", "cli")


def _layer(module: str) -> int:
    top = module.split(".")[0]
    return LAYERS.index(top) if top in LAYERS else 0


def _calls(prepare) -> list[tuple[str | None, str]]:
    """Every call from one module of ``structattn`` into another while ``prepare()`` runs, as
    ``(caller, callee)`` module names (``None``: the first call)."""
    import sys

    root = str(SRC / "structattn") + "/"
    stack, edges = [], []

    def profile(frame, event, arg):
        name = frame.f_code.co_filename
        if not name.startswith(root):
            return
        module = name[len(root) : -3].replace("/", ".").removesuffix(".__init__")
        if event == "call":
            caller = stack[-1] if stack else None
            if module != caller:
                edges.append((caller, module))
            stack.append(module)
        elif event == "return" and stack:
            stack.pop()

    sys.setprofile(profile)
    try:
        prepare()
    finally:
        sys.setprofile(None)
    return edges


def _follow(edges) -> tuple[list[str], list[str], list[str]]:
    """The modules in the order they are first entered, the returns (a call along an edge not
    taken before into a module already entered: going back to a file already left) and the
    climbs (a call into a higher layer). Repeated calls along one edge (a loop) count once."""
    entered, returns, climbs, seen = [], [], [], set()
    for caller, module in edges:
        if (caller, module) in seen:
            continue
        seen.add((caller, module))
        if module in entered:
            returns.append(f"{caller} -> {module}")
        else:
            entered.append(module)
        if caller is not None and _layer(module) > _layer(caller):
            climbs.append(f"{caller} -> {module}")
    return entered, returns, climbs


def test_the_path_follower_counts_files_returns_and_climbs():
    edges = [
        (None, "experiments.x"), ("experiments.x", "data.a"), ("data.a", "data.b"),
        ("data.a", "data.b"), ("experiments.x", "data.b"), ("data.b", "engine.loop"),
    ]  # fmt: skip
    entered, returns, climbs = _follow(edges)
    assert entered == ["experiments.x", "data.a", "data.b", "engine.loop"]
    assert returns == ["experiments.x -> data.b"] and climbs == ["data.b -> engine.loop"]
    import structattn.data.base as base

    calls = _calls(lambda: base.split_indices(10, [0.5, 0.5], 0))
    assert calls[0] == (None, "data.base")


def _tiny_glfusion(tmp_path):
    import types

    from helpers import tiny_glfusion_models, write_wordnet

    from structattn.experiments.glfusion import build_glfusion_config
    from structattn.experiments.glfusion.run import NodeClassification

    write_wordnet(tmp_path / "data" / "wordnet" / "data.noun")
    llm, encoder = tiny_glfusion_models(tmp_path)
    cfg = build_glfusion_config({
        "dataset": "wordnet", "data_dir": tmp_path / "data", "run_dir": tmp_path / "run",
        "max_train": 6, "max_val": 3, "max_test": 3, "train": {"max_steps": 1},
    })  # fmt: skip
    run = NodeClassification(cfg, llm=llm, encoder=encoder, progress=False)
    run.engine = types.SimpleNamespace(is_main=True)
    return run


def _check_path(run, model_package: str, max_files: int, max_returns: int) -> list[str]:
    """Follow ``run`` from its data preparation to its model: at most ``max_files`` modules
    outside ``model_package`` (whose own modules build the model), ``max_returns`` returns and
    no climb. Returns those modules."""
    entered, returns, climbs = _follow(_calls(lambda: (run.build_data(), run.build_model())))
    data = [m for m in entered if not m.startswith(model_package + ".")]
    assert len(data) <= max_files, data
    assert len(returns) <= max_returns, returns
    assert not climbs, climbs
    return data


def test_glfusion_data_path_is_short_and_never_climbs(tmp_path):
    """From a node-classification run's data preparation (graph, targets, prompts, encodings) to
    its model: the data modules entered stay few, the path seldom goes back to a file it left
    and never calls up a layer."""
    data = _check_path(_tiny_glfusion(tmp_path), "glfusion", max_files=12, max_returns=4)
    assert "data.graphs.sampling" in data and "experiments.glfusion.prompts" in data


def test_hkt_data_path_is_short_and_never_climbs(lra_data_dir, tmp_path):
    """The same for an LRA run (the path GL-Fusion's is held to)."""
    from helpers import tiny_listops

    from structattn.experiments.lra.experiment import SequenceClassification

    run = SequenceClassification(tiny_listops(lra_data_dir, tmp_path / "run"), progress=False)
    assert "data.listops" in _check_path(run, "hkt", max_files=8, max_returns=2)

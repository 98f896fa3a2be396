"""``structattn glfusion train | predict | ablate``: one dataclass per command, its fields the
flags (parsed by ``tyro``), ``.run()`` what it does."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal, Union

import tyro

from structattn.engine.config import build_dataclass, load_preset
from structattn.engine.rundir import RunDir
from structattn.errors import ConfigError
from structattn.glfusion.loading import quiet_library_warnings

from ..commands import (
    SAVED_PRESET,
    check_sampling,
    parse_command,
    preset_command,
    refuse_other_kind,
    run_config_values,
)
from .ablate import GLFUSION_ABLATIONS
from .config import GLFusionTrainConfig

__all__ = [
    "COMMANDS",
    "Ablate",
    "Baselines",
    "Generate",
    "Predict",
    "Train",
    "main",
]

USAGE = (
    "usage: structattn glfusion train [--config PATH] [--preset quick|recipe|paper] ... "
    "| structattn glfusion predict RUN_DIR --nodes NODE [NODE ...] [--graph DIR] "
    "| structattn glfusion generate RUN_DIR --node N --prompt TEXT [--graph DIR] "
    "| structattn glfusion ablate [--preset recipe] [--seeds 0 1 2] "
    "| structattn glfusion baselines [train's flags | --run-dir RUN] [--seeds 0 1 2] "
    "[--against RUN | ablations.json]"
)


Variant = Literal[tuple(GLFUSION_ABLATIONS)]  # type: ignore[valid-type]


@dataclass
class Train(preset_command("glfusion", GLFusionTrainConfig)):
    """Train GL-Fusion on a text-attributed graph: --config and --preset choose the defaults
    below, every other flag overrides them; prints the results table."""

    @classmethod
    def adopt_saved(cls, values: dict) -> dict:
        """A graph of one's own is read from ``graph_path``, so the saved ``data_dir`` is only
        where that run cached encodings: a run folder resumed alone caches in the caller's data
        folder (``--data-dir`` or the default), never where a handed run's config points."""
        if values.get("dataset") == "file":
            values["data_dir"] = None
        return values

    def run(self) -> None:
        from .report import results_table
        from .run import train_glfusion

        results = train_glfusion(self.experiment)
        print(json.dumps(results) if "paused_at" in results else results_table(results))


@dataclass
class Predict:
    """Classify nodes of a run's graph with its best weights (one JSON line per node)."""

    run_dir: tyro.conf.Positional[Path]  # a GL-Fusion run directory (with best/)
    nodes: tuple[str, ...]  # node indices or node ids (of --graph when given)
    graph: Path | None = None  # a graph folder (TextAttributedGraph.save) with new nodes
    top_k: int = 3  # labels listed per head, most probable first
    # your cache for node-text encodings (default $STRUCTATTN_DATA_DIR or ~/.cache/structattn);
    # never the folder a run's config names
    data_dir: Path | None = None

    def run(self) -> None:
        from .predict import predict_nodes

        with quiet_library_warnings():  # peft's, while it loads the run's adapter
            rows = predict_nodes(self.run_dir, list(self.nodes), graph=_graph(self.graph),
                                 top_k=self.top_k, data_dir=self.data_dir)  # fmt: skip
        for row in rows:
            print(json.dumps(row))


@dataclass
class Ablate:
    """GL-Fusion's ablations and the baselines, every seed, one table (results/glfusion)."""

    preset: str = "recipe"  # the preset every variant trains on: quick | recipe | paper
    config: str = "glfusion"  # experiment file: a shipped name or a YAML path
    seeds: tuple[int, ...] = (0, 1, 2)  # seeds per variant
    variants: tuple[Variant, ...] = tuple(GLFUSION_ABLATIONS)  # "full" is always trained
    out_dir: Path = Path("results/glfusion")  # runs and tables go to <out_dir>/<preset>/
    progress: Annotated[bool, tyro.conf.FlagCreatePairsOff] = True  # tqdm bars per run
    # train nothing: table the finished runs
    summary_only: Annotated[bool, tyro.conf.FlagCreatePairsOff] = False

    def run(self) -> None:
        from .ablate import ablate_glfusion

        load_preset(self.config, self.preset)  # a bad preset stops before anything trains
        out = ablate_glfusion(
            self.preset,
            self.seeds,
            self.out_dir,
            self.variants,
            progress=self.progress,
            config=self.config,
            train_missing=not self.summary_only,
        )
        print(out["table"])


@dataclass
class Generate:
    """Free text about a node: its subgraph in the prompt, your question after it, the run's
    best model continuing until its tokenizer's end token."""

    run_dir: tyro.conf.Positional[Path]  # a GL-Fusion run directory (with best/)
    node: str  # the node the text is about: an index or a node id (of --graph when given)
    prompt: str = "Describe this node."  # the text after the graph
    graph: Path | None = None  # a graph folder (TextAttributedGraph.save) with new nodes
    max_new_tokens: int = 40  # tokens to generate at most
    greedy: bool = False  # the most likely token every step instead of sampling
    temperature: float = 0.8  # sampling temperature
    top_k: int = 40  # sample from the k most likely tokens
    seed: int = 0  # sampling seed
    data_dir: Path | None = None  # your encodings cache (default $STRUCTATTN_DATA_DIR or ~/.cache)

    def run(self) -> None:
        from .generate import generate_about_node

        check_sampling(self.max_new_tokens, self.temperature, self.top_k)
        with quiet_library_warnings():  # peft's, while it loads the run's adapter
            text = generate_about_node(self.run_dir, self.node, self.prompt, _graph(self.graph),
                                       max_new_tokens=self.max_new_tokens,
                                       do_sample=not self.greedy, temperature=self.temperature,
                                       top_k=self.top_k, seed=self.seed,
                                       data_dir=self.data_dir)  # fmt: skip
        print(text if text.strip() else EMPTY_CONTINUATION)


#: Printed instead of a blank line when the model's first new token ends the text.
EMPTY_CONTINUATION = "(no text: the model's first new token was a stop token)"


def _graph(path: Path | None):
    """The graph folder a command names, or ``None``; a folder that is not a graph is one line."""
    if path is None:
        return None
    from structattn.data.graphs import TextAttributedGraph

    try:
        return TextAttributedGraph.load(path)
    except (ValueError, OSError) as err:
        raise ConfigError(f"--graph {path}: {err}") from None


def _run_config(args: list[str]) -> tuple[Path, dict] | None:
    """``(path, values)`` of the ``config.yaml`` of the run that ``--run-dir X`` names when
    neither ``--config`` nor ``--preset`` is given (else None). Its ``data_dir`` is left out:
    the graph is read and the encodings cached in your own data folder (``--data-dir``, default
    ``$STRUCTATTN_DATA_DIR`` or ``~/.cache/structattn``), never where a run's config points; a
    run folder that moved reads its own copy of the graph (``graph/``)."""
    import argparse

    pre = argparse.ArgumentParser(add_help=False)
    for flag in ("--run-dir", "--config", "--preset"):
        pre.add_argument(flag)
    known, _ = pre.parse_known_args(args)
    if not known.run_dir or known.config or known.preset:
        return None
    run = RunDir(known.run_dir)
    if not run.config.is_file():
        raise ConfigError(
            f"--run-dir {known.run_dir} holds no config.yaml (not a GL-Fusion run folder): give "
            "a run folder, or train's data and target flags"
        )
    values = run_config_values(run)
    values["data_dir"] = None
    saved = run.file("graph")  # where a run keeps a graph given from Python
    graph = values.get("graph_path")
    if values.get("dataset") == "file" and saved.is_dir() and not Path(str(graph)).is_dir():
        values["graph_path"] = str(saved)
    return run.config, values


def _run_folder_key(run_dir) -> str:
    """A folder name of its own for each run folder (``mine-seed0-1a2b3c4d``): two runs whose
    folders end alike (``.../full/seed0``) never share a table."""
    import hashlib

    path = Path(run_dir).resolve()
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:8]
    return f"{path.parent.name}-{path.name}-{digest}"


@dataclass
class Baselines(preset_command("glfusion", GLFusionTrainConfig)):
    """Every baseline on the targets, prompts and encodings that a GL-Fusion run of the same
    config uses, without training GL-Fusion: --config, --preset and train's flags choose the
    config as they do for train, or --run-dir RUN alone reads that run's config.yaml. The table
    says which nodes each seed scored; --against a finished run (or an ablations.json) adds its
    ensemble minus each label-aware baseline, paired by seed, and is refused when that run
    scored other nodes."""

    seeds: tuple[int, ...] | None = None  # seeds, each drawing its own targets (default: --seed)
    against: Path | None = None  # a finished run folder (or its final.json), or an ablations.json
    out_dir: Path = Path("results/glfusion")  # the table goes to <out_dir>/<preset or run name>/

    @classmethod
    def defaults(cls, args: list[str]):
        """The command whose defaults are the run's own config (``--run-dir RUN`` without
        ``--config`` or ``--preset``), else the preset ``args`` choose, as for train."""
        saved = _run_config(args)
        if saved is not None:
            path, values = saved
            return cls(str(path), SAVED_PRESET, build_dataclass(cls.config_class, values))
        return super().defaults(args)

    def run(self) -> None:
        from structattn.engine import json_safe

        from .label_baselines import baselines_over_seeds, baselines_table

        self.announce()
        cfg = self.experiment
        saved = self.preset == SAVED_PRESET
        described = f"`{self.config}`" if saved else f"preset `{self.preset}` of {self.config}"
        seeds = self.seeds if self.seeds is not None else (cfg.seed,)
        out = baselines_over_seeds(self.preset, seeds, self.config, self.against, base=cfg,
                                   described=described)  # fmt: skip
        table = baselines_table(out)
        root = self.out_dir / (_run_folder_key(cfg.resolved_run_dir()) if saved else self.preset)
        root.mkdir(parents=True, exist_ok=True)
        (root / "baselines.md").write_text(table + "\n")
        (root / "baselines.json").write_text(json.dumps(json_safe(out), indent=2) + "\n")
        print(table)


COMMANDS = {"train": Train, "predict": Predict, "generate": Generate, "ablate": Ablate,
            "baselines": Baselines}  # fmt: skip


def _names_code_names(args: list[str]) -> bool:
    """``--dataset code-names`` among ``args``: the spelling of the code-names commands before
    they became their own group (refused with the new command, never routed)."""
    pairs = zip(args, [*args[1:], None])
    return "--dataset=code-names" in args or ("--dataset", "code-names") in pairs


def main(argv: list[str]) -> None:
    """``structattn glfusion COMMAND ...``: parse and run one command."""
    if not argv or argv[0] not in (*COMMANDS, "-h", "--help"):
        raise ConfigError(USAGE)
    if _names_code_names(argv[1:]):
        raise ConfigError(
            "code-names is a command group of its own: structattn code-names "
            f"{argv[0] if argv[0] in ('train', 'ablate', 'generate') else 'train'} ..."
        )
    if argv[0] == "train":  # --run-dir X --resume alone: a run of another kind is named
        refuse_other_kind(argv[1:], "glfusion")
    train = Train.defaults(argv[1:]) if argv[0] == "train" else Train()
    # baselines: the config as train would build it from the same flags
    baselines = {"default": Baselines.defaults(argv[1:])} if argv[0] == "baselines" else {}
    choices = Union[  # noqa: UP007 (tyro reads the subcommands from a typing.Union)
        Annotated[Train, tyro.conf.subcommand("train", default=train)],
        Annotated[Predict, tyro.conf.subcommand("predict")],
        Annotated[Generate, tyro.conf.subcommand("generate")],
        Annotated[Ablate, tyro.conf.subcommand("ablate")],
        Annotated[Baselines, tyro.conf.subcommand("baselines", **baselines)],
    ]
    command = parse_command(choices, argv, prog="structattn glfusion",
                            description="GL-Fusion on a text-attributed graph.")  # fmt: skip
    command.run()

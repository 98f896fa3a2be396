"""``structattn glfusion train | predict | ablate``: one dataclass per command, its fields the
flags (parsed by ``tyro``), ``.run()`` what it does."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, ClassVar, Literal, Union

import tyro

from structattn.engine.config import load_preset, preset_names
from structattn.errors import ConfigError

from ..commands import PresetCommand, parse_command
from .ablate import GLFUSION_ABLATIONS
from .config import GLFusionTrainConfig, load_glfusion

__all__ = ["COMMANDS", "Ablate", "Predict", "Train", "main"]

USAGE = (
    "usage: structattn glfusion train [--config PATH] [--preset quick|recipe|paper] ... "
    "| structattn glfusion predict RUN_DIR --nodes ID [ID ...] "
    "| structattn glfusion ablate [--preset recipe] [--seeds 0 1 2]"
)


def _presets(config: str = "glfusion") -> str:
    return " | ".join(preset_names(config))


Variant = Literal[tuple(GLFUSION_ABLATIONS)]  # type: ignore[valid-type]


@dataclass
class Train(PresetCommand):
    """Train GL-Fusion on a text-attributed graph: --config and --preset choose the defaults
    below, every other flag overrides them; prints the results table."""

    config: Annotated[str, tyro.conf.arg(help="experiment file: a shipped name or a YAML path")] = (
        "glfusion"
    )
    preset: Annotated[
        str, tyro.conf.arg(help=f"a preset of --config (shipped glfusion: {_presets()})")
    ] = "quick"
    experiment: Annotated[GLFusionTrainConfig, tyro.conf.arg(name="")] = field(
        default_factory=lambda: load_glfusion("glfusion", "quick")
    )

    default_config: ClassVar[str] = "glfusion"
    config_class: ClassVar[type] = GLFusionTrainConfig

    def run(self) -> None:
        from .report import results_table
        from .run import train_glfusion

        results = train_glfusion(self.experiment)
        print(json.dumps(results) if "paused_at" in results else results_table(results))


@dataclass
class Predict:
    """Classify nodes of a run's graph with its best weights (one JSON line per node)."""

    run_dir: tyro.conf.Positional[Path]  # a GL-Fusion run directory (with best/)
    nodes: tuple[int, ...]  # node ids

    def run(self) -> None:
        from .predict import predict_nodes

        for row in predict_nodes(self.run_dir, list(self.nodes)):
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


COMMANDS = {"train": Train, "predict": Predict, "ablate": Ablate}


def main(argv: list[str]) -> None:
    """``structattn glfusion COMMAND ...``: parse and run one command."""
    if not argv or argv[0] not in (*COMMANDS, "-h", "--help"):
        raise ConfigError(USAGE)
    train = Train.defaults(argv[1:]) if argv[0] == "train" else Train()
    choices = Union[  # noqa: UP007 (tyro reads the subcommands from a typing.Union)
        Annotated[Train, tyro.conf.subcommand("train", default=train)],
        Annotated[Predict, tyro.conf.subcommand("predict")],
        Annotated[Ablate, tyro.conf.subcommand("ablate")],
    ]
    command = parse_command(choices, argv, prog="structattn glfusion",
                            description="GL-Fusion on a text-attributed graph.")  # fmt: skip
    command.run()

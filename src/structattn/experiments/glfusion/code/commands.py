"""``structattn code-names train | ablate | generate``: naming Python functions from their
syntax trees (a graph-level task built like ogbg-code2), one dataclass per command, its fields
the flags (parsed by ``tyro``), ``.run()`` what it does."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal, Union

import tyro

from structattn.engine.config import load_preset
from structattn.errors import ConfigError

from ...commands import parse_command, preset_command, refuse_other_kind
from .config import CodeNamesConfig
from .table import ROWS as CODE_ROWS

__all__ = ["COMMANDS", "CodeAblate", "CodeGenerate", "CodeTrain", "main"]

USAGE = (
    "usage: structattn code-names train [--preset quick|cpu|llm-quick] [--model M] "
    "| structattn code-names ablate [--preset cpu-llm] [--rows ...] "
    "| structattn code-names generate RUN_DIR --file F.py --function NAME"
)


@dataclass
class CodeTrain(preset_command("glfusion-code", CodeNamesConfig)):
    """Train one model to name Python functions from their syntax trees (code-names, built like
    ogbg-code2): --config and --preset choose the defaults below, every other flag overrides
    them; prints the validation and test scores."""

    def run(self) -> None:
        from .experiment import train_code_names
        from .report import run_table

        results = train_code_names(self.experiment)
        print(json.dumps(results) if "paused_at" in results else run_table(results))


CodeRow = Literal[tuple(CODE_ROWS)]  # type: ignore[valid-type]


@dataclass
class CodeAblate:
    """code-names: OGB's GNNs, the LLM reading the tree or the code, GL-Fusion and its
    ablations, every seed on the same examples, one table with shallow baselines and GL-Fusion's
    paired differences (results/glfusion-code/<preset>/table.md)."""

    preset: str = "cpu-llm"  # the preset of the LLM rows (glfusion-code)
    gnn_preset: str = "cpu-gnn"  # the preset of the GNN rows (the same example draw)
    config: str = "glfusion-code"  # experiment file: a shipped name or a YAML path
    seeds: tuple[int, ...] = (0, 1, 2)  # seeds per row
    rows: tuple[CodeRow, ...] = tuple(CODE_ROWS)  # the rows to train and table
    lr_sweep: tuple[float, ...] = ()  # tune each GNN's lr on validation first (one seed)
    llm_lr_sweep: tuple[float, ...] = ()  # the same for the LLM models (ablations inherit)
    out_dir: Path = Path("results/glfusion-code")  # runs and the table go to <out_dir>/<preset>/
    threads: int | None = None  # torch threads (default: torch's choice)
    progress: Annotated[bool, tyro.conf.FlagCreatePairsOff] = True  # tqdm bars per run
    # train nothing: table the finished runs
    summary_only: Annotated[bool, tyro.conf.FlagCreatePairsOff] = False
    # change preset keys of every run: KEY=VALUE, dotted keys, YAML values (e.g.
    # train.max_steps=2 max_train=8); shrinks the table to seconds
    set: tuple[str, ...] = ()

    def run(self) -> None:
        from structattn.engine.overrides import parse_settings

        from .table import code_names_table, table_markdown

        if self.threads:
            import torch

            torch.set_num_threads(self.threads)
        load_preset(self.config, self.preset)  # a bad preset stops before anything trains
        load_preset(self.config, self.gnn_preset)
        out = code_names_table(self.preset, self.gnn_preset, self.seeds, self.rows,
                               self.out_dir, self.lr_sweep or None, self.llm_lr_sweep or None,
                               config=self.config, progress=self.progress,
                               train_missing=not self.summary_only,
                               **parse_settings(self.set))  # fmt: skip
        print(table_markdown(out))


@dataclass
class CodeGenerate:
    """code-names: the name a finished run predicts for one function of a Python file (its tree
    built as the dataset builds it, the name masked), beside the true name (one JSON line)."""

    run_dir: tyro.conf.Positional[Path]  # a code-names run directory (with best.safetensors)
    file: Path  # a Python source file
    function: str  # the function's name, or Class.method
    head: Literal["lm", "gnn"] | None = None  # GL-Fusion's head (default: the run's choice)
    data_dir: Path | None = None  # your encodings cache (default $STRUCTATTN_DATA_DIR or ~/.cache)

    def run(self) -> None:
        from .generate import name_function

        try:
            source = self.file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(f"--file {self.file}: cannot read it as UTF-8 text ({err})") from None
        print(json.dumps(name_function(self.run_dir, source, self.function, str(self.file),
                                       head=self.head, data_dir=self.data_dir)))  # fmt: skip


COMMANDS = {"train": CodeTrain, "ablate": CodeAblate, "generate": CodeGenerate}


def main(argv: list[str]) -> None:
    """``structattn code-names COMMAND ...``: parse and run one command."""
    if not argv or argv[0] not in (*COMMANDS, "-h", "--help"):
        raise ConfigError(USAGE)
    if argv[0] == "train":  # --run-dir X --resume alone: a run of another kind is named
        refuse_other_kind(argv[1:], "code-names")
    train = CodeTrain.defaults(argv[1:]) if argv[0] == "train" else CodeTrain()
    choices = Union[  # noqa: UP007 (tyro reads the subcommands from a typing.Union)
        Annotated[CodeTrain, tyro.conf.subcommand("train", default=train)],
        Annotated[CodeAblate, tyro.conf.subcommand("ablate")],
        Annotated[CodeGenerate, tyro.conf.subcommand("generate")],
    ]
    about = "Name Python functions from their syntax trees."
    command = parse_command(choices, argv, prog="structattn code-names", description=about)
    command.run()

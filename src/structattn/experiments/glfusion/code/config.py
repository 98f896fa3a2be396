"""The config of a ``code-names`` run (method naming from syntax trees): which model, which
examples, and each model's settings; ``optim`` and ``train`` are the engine's sections."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from structattn.data.base import default_data_dir
from structattn.engine.config import OptimConfig, RunConfig, TrainConfig, load_config

__all__ = ["MODELS", "CodeNamesConfig", "load_code_config"]

#: The models of the table: OGB's two GNN baselines (:mod:`.gnn`).
MODELS = ("gcn", "gin")


def _default_optim() -> OptimConfig:
    return OptimConfig(lr=1e-3, weight_decay=0.0, beta2=0.999, warmup_steps=0,
                       schedule="constant", grad_clip=0.0)  # fmt: skip


def _default_train() -> TrainConfig:
    return TrainConfig(max_steps=3000, batch_size=128, eval_every=250, log_every=50)


@dataclass
class CodeNamesConfig(RunConfig):
    """One model trained to name functions from their trees (``structattn glfusion train
    --dataset code-names``)."""

    name: str = "code-names"  # run name
    optim: OptimConfig = field(default_factory=_default_optim)
    train: TrainConfig = field(default_factory=_default_train)

    dataset: str = "code-names"  # the only dataset of this experiment (selects it on the CLI)
    model: str = "gcn"  # gcn | gin (OGB's ogbg-code2 baselines, with a virtual node)
    data_dir: Path | None = None  # data cache (default $STRUCTATTN_DATA_DIR or ~/.cache/...)
    dataset_path: Path | None = None  # a built dataset folder (default <data>/code-names/dataset)
    # examples per split (None: all); a fixed draw, the same for every model and seed
    max_train: int | None = None
    max_val: int | None = None
    max_test: int | None = None
    eval_batch_size: int = 256  # examples per evaluation batch
    # GNN (OGB's defaults for ogbg-code2)
    gnn_layers: int = 5  # message-passing layers
    emb_dim: int = 300  # node embedding width
    virtual_node: bool = True  # a per-graph virtual node joined to every node
    dropout: float = 0.0  # dropout after each layer (OGB's drop_ratio)
    num_vocab: int = 5000  # most frequent training sub-tokens predicted (others: __UNK__)
    num_attributes: int = 10000  # most frequent training node attributes embedded
    max_depth: int = 20  # depths above are embedded as this one

    def __post_init__(self) -> None:
        if self.dataset != "code-names":
            raise ValueError(f"dataset must be code-names here, got {self.dataset!r}")
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {MODELS}, got {self.model!r}")
        for key in ("max_train", "max_val", "max_test"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"{key} must be >= 1 or None, got {value}")
        for key in ("eval_batch_size", "gnn_layers", "emb_dim", "num_vocab", "num_attributes",
                    "max_depth"):  # fmt: skip
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    def resolved_dataset(self) -> Path:
        if self.dataset_path is not None:
            return Path(self.dataset_path)
        root = Path(self.data_dir) if self.data_dir is not None else default_data_dir()
        return root / "code-names" / "dataset"


def load_code_config(name_or_path: str | Path = "glfusion-code", preset: str = "quick",
                     **overrides) -> CodeNamesConfig:  # fmt: skip
    """One preset of a code-names experiment file (the shipped ``glfusion-code``)."""
    return load_config(CodeNamesConfig, name_or_path, preset, **overrides)

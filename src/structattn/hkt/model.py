"""Sequence models on HKT attention or its flat multi-head-attention baseline.

One pre-norm transformer stack, ``x + Attn(LN(x))`` then ``x + MLP(LN(x))``, with the attention
chosen by ``ModelConfig.attention`` from :data:`ATTENTIONS`: ``"hkt"`` (:class:`HKTAttention`)
or ``"mha"`` (standard multi-head attention through SDPA). Everything else is identical, so the
baseline is the same model with flat attention. A new attention is a module whose layer takes
``(x (B, T, D), key_padding_mask, right_padded, cache)`` as these two do, plus one line
``ATTENTIONS["name"] = Layer.from_config`` (see ``tests/test_attention_registry.py``).

* :class:`SequenceClassifier`: token + learned position embeddings, the stack, final LayerNorm,
  pooling (mean over real tokens, or the last real token), linear head.
* :class:`CausalLM`: the same stack, causal, with a tied next-token head.

Shapes: ``tokens (B, T)`` int64 (0 = padding), ``mask (B, T)`` bool (True = real token).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NoReturn

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from structattn.compat import nest_flat_hkt_keys
from structattn.utils.checks import require_positive

from .attention import EMPTY, HKTAttention, HKTConfig, check_input_dtype
from .decoding.cache import (
    KVLayerCache,
    LMCache,
    check_made_for,
    decode_attention,
    grow,
    one_length,
    prompt_lengths,
)
from .kernels.sdpa import masked_sdpa
from .levels import is_right_padded

__all__ = [
    "ATTENTIONS",
    "CausalLM",
    "ModelOutput",
    "ModelConfig",
    "MultiHeadAttention",
    "SequenceClassifier",
    "count_parameters",
]

#: HKTConfig fields that ModelConfig sets from its own (so no option of a ModelConfig's ``hkt``).
FROM_MODEL = ("d_model", "n_heads", "causal")


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
            known = ", ".join(ATTENTIONS)
            raise ValueError(f"attention must be one of {known}, got {self.attention!r}")
        if self.pooling not in ("mean", "last"):
            raise ValueError(f"pooling must be 'mean' or 'last', got {self.pooling!r}")
        require_positive(self, ("vocab_size", "num_classes", "max_len", "d_model", "n_layers",
                                "n_heads", "mlp_ratio"))  # fmt: skip
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

    @classmethod
    def from_config_values(cls, values: dict, where: str) -> dict:
        """A ``model`` mapping of an experiment file as this class's fields (the flat HKT keys
        of earlier versions' files moved under ``hkt``); ``hkt.d_model`` / ``n_heads`` /
        ``causal`` accepted only where they agree with the model's own (``config.yaml`` of
        older runs has them)."""
        from structattn.errors import ConfigError

        values = nest_flat_hkt_keys(values)  # files of earlier versions (structattn.compat)
        hkt_values = values.get("hkt") or {}
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        shared = sorted(
            k for k in FROM_MODEL if k in hkt_values and hkt_values[k] != values.get(k, defaults[k])
        )
        if shared:
            raise ConfigError(
                f"{', '.join(f'{where}.hkt.{k}' for k in shared)}: set {where}.{shared[0]} "
                "(the attention takes width, heads and causality from the model)"
            )
        if isinstance(values.get("hkt"), dict):
            values["hkt"] = {k: v for k, v in values["hkt"].items() if k not in FROM_MODEL}
        return values

    def to_config_values(self, out: dict) -> dict:
        """The plain form without ``hkt``'s copies of the model's width, heads and causality."""
        out["hkt"] = {k: v for k, v in out["hkt"].items() if k not in FROM_MODEL}
        return out

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
        self.scale = (d_model // n_heads) ** -0.5
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.o_proj = nn.Linear(d_model, d_model, bias=bias)

    def forward(
        self,
        x: Tensor,
        key_padding_mask: Tensor | None = None,
        cache: KVLayerCache | None | object = None,
        right_padded: bool | None = None,
    ) -> Tensor | tuple[Tensor, KVLayerCache]:
        """``x (B, T, D) -> (B, T, D)``; with ``cache`` as for :class:`HKTAttention`: ``EMPTY``
        runs the (right-padded) prompt and returns ``(y, cache)``, a :class:`KVLayerCache`
        takes ``x`` as the next tokens and returns ``(y, cache)``. ``right_padded``: as for
        :func:`~structattn.hkt.masked_sdpa`."""
        if x.dim() != 3 or x.shape[-1] != self.qkv.in_features:
            raise ValueError(
                f"x must have shape (B, T, d_model={self.qkv.in_features}), got {tuple(x.shape)}"
            )
        check_input_dtype(x, self.qkv.weight, "layer")
        if cache is not None and not self.causal:
            raise ValueError("a bidirectional attention layer cannot decode (causal=False)")
        if isinstance(cache, KVLayerCache):
            return self._decode(x, cache), cache
        B, T, D = x.shape
        if T == 0 and cache is not None:
            raise ValueError("cannot prefill a cache with an empty prompt (T = 0)")
        H = self.n_heads
        q, k, v = self.qkv(x).view(B, T, 3, H, D // H).permute(2, 0, 3, 1, 4)
        o = masked_sdpa(
            q, k, v, causal=self.causal, key_padding_mask=key_padding_mask,
            right_padded=right_padded,
        )  # fmt: skip
        y = self.o_proj(o.transpose(1, 2).reshape(B, T, D))  # (B, T, D)
        if key_padding_mask is not None:
            y = y.masked_fill(~key_padding_mask[..., None], 0.0)
        if cache is None:
            return y
        lengths = prompt_lengths(key_padding_mask, B, T, x.device)
        made_for = (self.qkv.weight.dtype, self.qkv.weight.device)
        return y, KVLayerCache(k.clone(), v.clone(), lengths, made_for=made_for)

    def _decode(self, x: Tensor, cache: KVLayerCache) -> Tensor:
        check_made_for(cache.made_for, self.qkv.weight)
        B, T, D = x.shape
        if B != cache.lengths.shape[0]:
            raise ValueError(
                f"the cache holds {cache.lengths.shape[0]} sequences, got a batch of {B}"
            )
        outs = []
        for t in range(T):
            q, k, v = (
                self.qkv(x[:, t]).view(B, 3, self.n_heads, 1, D // self.n_heads).unbind(1)
            )  # (B, H, 1, d)
            pos = cache.lengths
            n = pos + 1
            n_max = int(n.max())
            cache.keys = grow(cache.keys, n_max)
            cache.values = grow(cache.values, n_max)
            if one_length(n, n_max):  # one length (as HKT's step): no mask
                cache.keys[:, :, n_max - 1] = k[:, :, 0]
                cache.values[:, :, n_max - 1] = v[:, :, 0]
                n_used: Tensor | int = n_max
            else:
                bidx = torch.arange(B, device=x.device)
                cache.keys[bidx, :, pos] = k[:, :, 0]
                cache.values[bidx, :, pos] = v[:, :, 0]
                n_used = n
            q = q * self.scale  # the scale on d numbers, not on n_max scores
            scores = (q @ cache.keys[:, :, :n_max].transpose(-1, -2)).squeeze(-2)
            o = decode_attention(scores, n_used, cache.values[:, :, :n_max])  # (B, H, d)
            cache.lengths = n
            outs.append(self.o_proj(o.reshape(B, D)))
        return torch.stack(outs, dim=1) if outs else x.new_zeros(x.shape)


#: The attention layers a model can be built on: name -> ``factory(config: ModelConfig)``.
ATTENTIONS: dict[str, Callable[[ModelConfig], nn.Module]] = {
    "hkt": lambda config: HKTAttention(config.hkt_config()),
    "mha": lambda config: MultiHeadAttention(config.d_model, config.n_heads, config.causal),
}


class Block(nn.Module):
    """Pre-norm transformer block: attention then MLP, each residual."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        D = config.d_model
        self.norm1 = nn.LayerNorm(D)
        self.attn = ATTENTIONS[config.attention](config)
        self.norm2 = nn.LayerNorm(D)
        self.mlp = nn.Sequential(
            nn.Linear(D, config.mlp_ratio * D),
            nn.GELU(),
            nn.Dropout(config.dropout),
            nn.Linear(config.mlp_ratio * D, D),
        )
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, mask: Tensor | None, cache=None, right_padded=None):
        """``(B, T, D) -> (B, T, D)``; with ``cache`` (see the attention layers) also the
        layer's cache: ``(y, cache)``. ``right_padded``: the mask's layout, when known."""
        if cache is None:
            a = self.attn(self.norm1(x), key_padding_mask=mask, right_padded=right_padded)
            x = x + self.drop(a)
            return x + self.drop(self.mlp(self.norm2(x)))
        a, cache = self.attn(self.norm1(x), key_padding_mask=mask, cache=cache,
                             right_padded=right_padded)  # fmt: skip
        x = x + self.drop(a)
        return x + self.drop(self.mlp(self.norm2(x))), cache


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

    def signature(self) -> tuple:
        """What a decoding cache must match: every option that shapes its tensors."""
        c, h = self.config, self.config.hkt
        return (
            c.attention, c.vocab_size, c.max_len, c.d_model, c.n_layers, c.n_heads, c.causal,
            h.n_levels, h.stride, h.downsample_kernel, h.conv_kernel, h.hybrid,
        )  # fmt: skip

    def new_cache(self) -> LMCache:
        """An empty decoding cache for this model (filled by the prompt's forward pass)."""
        if not self.config.causal:
            raise ValueError("only a causal model can decode (causal=False)")
        return LMCache(self.signature(), self.config.n_layers)

    def forward(
        self, tokens: Tensor, mask: Tensor | None = None, cache: LMCache | None = None
    ) -> Tensor:
        """``tokens (B, T) -> (B, T, D)``.

        Padding may sit on either side: a left-padded row (padding, then one block of real
        tokens, as in batched generation) is run left-aligned, so every row gives the outputs
        it gives alone. With ``cache`` (an :class:`LMCache` from :meth:`new_cache`): an empty
        cache is filled from this pass (the prompt); a filled one takes ``tokens`` as the next
        tokens of every sequence (``mask`` then must be None or all True).

        Token ids outside ``0 .. vocab_size - 1`` are refused (one min/max pass): always for
        CPU tensors, on other devices within the one host read the pass makes anyway (the
        mask's layout, a decoding step's positions), so without a mask nothing is read back
        there.
        """
        ids_checked = self._check_tokens(tokens, mask)
        T = tokens.shape[1]
        if cache is not None:
            self._check_cache(cache)
            if not cache.is_empty:
                return self._decode(tokens, mask, cache, ids_checked)
        if T > self.config.max_len:
            raise ValueError(f"sequence length {T} exceeds max_len={self.config.max_len}")
        right = self._padding_layout(tokens, mask, ids_checked)
        tokens, mask, right, shift = self._left_aligned(tokens, mask, right, cache)
        pos = torch.arange(T, device=tokens.device)
        x = self.drop(self.tok(tokens) + self.pos(pos))  # (B, T, D)
        for i, block in enumerate(self.blocks):
            if cache is None:
                x = block(x, mask, right_padded=right)
            else:
                x, cache.layers[i] = block(x, mask, cache=EMPTY, right_padded=right)
        x = self.norm(x)
        return x if shift is None else _roll_rows(x, -shift)

    def _check_tokens(self, tokens: Tensor, mask: Tensor | None) -> bool:
        """Check the tokens' shape and dtype and the mask's; refuse out-of-range ids now where
        they are read at once (CPU); return whether they were checked."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must have shape (B, T), got {tuple(tokens.shape)}")
        if tokens.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"tokens must be integer token ids (int64), got {tokens.dtype}")
        B, T = tokens.shape
        if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (B, T)):
            raise ValueError(
                f"mask must be bool (B, T) = {(B, T)}, got {mask.dtype} {tuple(mask.shape)}"
            )
        ids_checked = _read_ids_at_once(tokens)  # else with the host read made below
        if ids_checked and bool(_ids_outside(tokens, self.config.vocab_size)):
            _refuse_ids(tokens, self.config.vocab_size)
        return ids_checked

    def _check_cache(self, cache: LMCache) -> None:
        """Refuse a cache that is not an :class:`LMCache` of this model's configuration."""
        if not isinstance(cache, LMCache):
            raise ValueError(f"cache must be an LMCache, got {type(cache).__name__}")
        if cache.signature != self.signature():
            raise ValueError(
                "this cache belongs to a model with another configuration "
                f"({cache.signature} != {self.signature()})"
            )

    def _padding_layout(
        self, tokens: Tensor, mask: Tensor | None, ids_checked: bool
    ) -> bool | None:
        """Whether every mask row is right-padded (None without a mask), read once here (one host
        read per forward pass, none inside the layers); off the CPU the same read brings the
        ids' check."""
        if mask is None:
            return None
        if ids_checked:
            return is_right_padded(mask)
        # is_right_padded's test and the ids' flag, read back together
        holes = (mask[:, 1:] & ~mask[:, :-1]).any()
        outside = _ids_outside(tokens, self.config.vocab_size)
        holes, bad = torch.stack([holes, outside]).tolist()
        if bad:
            _refuse_ids(tokens, self.config.vocab_size)
        return not holes

    @staticmethod
    def _left_aligned(
        tokens: Tensor, mask: Tensor | None, right: bool | None, cache: LMCache | None
    ) -> tuple[Tensor, Tensor | None, bool | None, Tensor | None]:
        """``(tokens, mask, right, shift)`` with left-padded rows rolled left-aligned (``shift
        (B,)``: each row's leading padding, to roll the outputs back; None when nothing moved)."""
        shift = None
        if mask is not None and not right:
            shift = (~mask).long().cumprod(1).sum(1)  # (B,) leading padding per row
            rolled = _roll_rows(mask, shift)
            if is_right_padded(rolled):  # left padding: run the rows left-aligned
                tokens, mask, right = _roll_rows(tokens, shift), rolled, True
            elif cache is not None:
                raise ValueError("prompt rows must be one block of real tokens (no holes)")
            else:
                shift = None
        return tokens, mask, right, shift

    def _decode(
        self, tokens: Tensor, mask: Tensor | None, cache: LMCache, ids_checked: bool
    ) -> Tensor:
        B, T = tokens.shape
        if B != cache.lengths.shape[0]:
            raise ValueError(
                f"the cache holds {cache.lengths.shape[0]} sequences, got a batch of {B}"
            )
        if mask is not None and not bool(mask.all()):
            raise ValueError("tokens decoded with a cache must all be real (mask all True)")
        if B == 0:  # an empty batch: nothing to cache, an empty output
            return self.norm(self.tok(tokens))
        pos = cache.lengths[:, None] + torch.arange(T, device=tokens.device)  # (B, T)
        if T:  # one host read: the last position (and the ids' flag, when not yet checked)
            flags = [pos.max()]
            if not ids_checked:
                flags.append(_ids_outside(tokens, self.config.vocab_size).long())
            last, *bad = torch.stack(flags).tolist()
            if any(bad):
                _refuse_ids(tokens, self.config.vocab_size)
            if last >= self.config.max_len:
                raise ValueError(
                    f"cannot decode past max_len={self.config.max_len} (position {last} requested)"
                )
        x = self.drop(self.tok(tokens) + self.pos(pos))
        for i, block in enumerate(self.blocks):
            x, cache.layers[i] = block(x, None, cache=cache.layers[i])
        return self.norm(x)

    def hkt_layers(self) -> list[HKTAttention]:
        return [b.attn for b in self.blocks if isinstance(b.attn, HKTAttention)]


def _read_ids_at_once(tokens: Tensor) -> bool:
    """Whether the ids' range check reads its flag back on its own: for CPU tensors (no
    device synchronisation); elsewhere the flag rides on a read the pass makes anyway."""
    return tokens.device.type == "cpu"


def _ids_outside(tokens: Tensor, vocab_size: int) -> Tensor:
    """``()`` bool: some id of ``tokens`` lies outside ``0 .. vocab_size - 1`` (one min/max
    pass; nothing is read back)."""
    if tokens.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=tokens.device)
    lo, hi = torch.aminmax(tokens)
    return (lo < 0) | (hi >= vocab_size)


def _refuse_ids(tokens: Tensor, vocab_size: int) -> NoReturn:
    """Raise the ValueError naming the range and the first id of ``tokens`` outside it."""
    b, t = ((tokens < 0) | (tokens >= vocab_size)).nonzero()[0].tolist()
    raise ValueError(
        f"token ids must be in 0 .. {vocab_size - 1} (vocab_size={vocab_size}), "
        f"got {int(tokens[b, t])} at tokens[{b}, {t}]"
    )


def _roll_rows(x: Tensor, shift: Tensor) -> Tensor:
    """Row ``b`` of ``x (B, T, ...)`` rotated left by ``shift[b]``."""
    B, T = x.shape[:2]
    idx = (torch.arange(T, device=x.device)[None, :] + shift[:, None]) % max(T, 1)  # (B, T)
    idx = idx.view(B, T, *([1] * (x.dim() - 2))).expand_as(x)
    return x.gather(1, idx)


@dataclass
class ModelOutput:
    """What the models return, in the transformers convention: ``logits``, ``loss`` when
    ``labels`` were given (``None`` otherwise) and the decoding ``cache`` when one was used."""

    logits: Tensor
    loss: Tensor | None = None
    cache: LMCache | None = None


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
    transformers; ``-100`` is ignored, and so is any target whose predicting position is
    padding (the first real token of a left-padded row).
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config.replace(causal=True)
        self.encoder = Encoder(self.config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.lm_head.weight = self.encoder.tok.weight

    def new_cache(self) -> LMCache:
        """An empty decoding cache (see :meth:`forward`)."""
        return self.encoder.new_cache()

    def forward(
        self,
        tokens: Tensor,
        mask: Tensor | None = None,
        labels: Tensor | None = None,
        cache: LMCache | None = None,
    ) -> ModelOutput:
        """Next-token logits ``(B, T, vocab)``. With ``cache`` from :meth:`new_cache`, the
        first call runs the prompt (left- or right-padded) and fills it, each later call takes
        the next tokens of every sequence; the logits equal those of one forward pass over
        the whole text, and the cache is returned as ``.cache``."""
        logits = self.lm_head(self.encoder(tokens, mask, cache=cache))
        loss = None
        if labels is not None:
            shifted = logits[:, :-1].float()
            targets = labels[:, 1:]
            if mask is not None:  # a padded position predicts nothing (left padding)
                targets = targets.masked_fill(~mask[:, :-1], -100)
            loss = F.cross_entropy(
                shifted.reshape(-1, shifted.shape[-1]),
                targets.reshape(-1),
                ignore_index=-100,
            )
        return ModelOutput(logits=logits, loss=loss, cache=cache)

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

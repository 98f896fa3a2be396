"""The HKT attention layer: levels, per-level bilinear forms, convex fusion, hybrid head.

Hierarchical Kernel Transformer (arXiv 2604.08829) as specified in this project's design notes:

    X^0 = X,  X^l = GELU(LayerNorm(DWConv_l(X^{l-1})))               (causal, stride s)
    Q^l = X^l W_Q^l,  K^l = X^l W_K^l,  V = X W_V                     (per-level Q/K projections)
    lambda_h = softmax(theta_h)                                       (convex level weights)
    O_h = hkt_attention(Q_h, K_h, V_h, lambda_h)
    Y_h = beta_h O_h + (1 - beta_h) C_h,  C = CausalDWConv(V),  beta_h = sigmoid(b_h)
    Y = concat_h(Y_h) W_O

Special cases (Prop. 3.4): ``n_levels=1, hybrid=False`` is standard multi-head attention;
``beta = 0`` is the causal convolution ``W_O(CausalDWConv(X W_V))``.

Shapes: ``x (B, T, D) -> (B, T, D)``; per head ``d = D / H``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .decoding.cache import HKTLayerCache
from .decoding.step import decode, prefill
from .downsample import CausalDepthwiseConv, CausalDownsample, autocast_copy
from .interface import ATTENTION_IMPLS, hkt_attention

__all__ = ["EMPTY", "HKTConfig", "HKTAttention"]


class _EmptySlot:
    """The cache argument of a layer's prefill: fill a new cache from this forward pass."""

    def __repr__(self) -> str:
        return "EMPTY"


#: Pass as ``cache=`` to a layer to run the prompt and get a new cache back.
EMPTY = _EmptySlot()


@dataclass
class HKTConfig:
    """Configuration of one :class:`HKTAttention` layer."""

    d_model: int = 256  # model width D (inside a ModelConfig: the model's)
    n_heads: int = 4  # heads H; head dim d = D / H (inside a ModelConfig: the model's)
    n_levels: int = 3  # resolution levels L (1 = flat attention)
    stride: int = 2  # length ratio s >= 2 between consecutive levels
    causal: bool = True  # causal or bidirectional attention (inside a ModelConfig: the model's)
    hybrid: bool = True  # Y = beta*attention + (1-beta)*causal conv; False: attention only
    impl: str = "auto"  # any key of ATTENTION_IMPLS: "auto" (fastest exact path), "sdpa", ...
    downsample_kernel: int = 3  # kernel of the causal depthwise conv between levels
    conv_kernel: int = 3  # kernel of the hybrid head's causal depthwise conv over V
    beta_init: float = 0.9  # initial beta of the hybrid head (fraction of attention)
    learn_beta: bool = True  # False: beta stays at beta_init (which may then be exactly 0 or 1)
    level_logits_init: float = 0.0  # theta init for levels >= 1 (level 0 at 0); 0 = uniform
    learn_levels: bool = True  # False: lambda stays at its init (uniform by default), an ablation
    bias: bool = True  # biases in the Q, K, V and output projections
    attn_dropout: float = 0.0  # dropout on attention probabilities (training only)
    dropout: float = 0.0  # dropout after the output projection (training only)
    recompute_levels: bool = True  # recompute coarse levels in backward (less memory, same values)

    def __post_init__(self) -> None:
        if self.d_model < 1 or self.n_heads < 1:
            raise ValueError(
                f"d_model and n_heads must be >= 1, got d_model={self.d_model}, "
                f"n_heads={self.n_heads}"
            )
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        if self.n_levels < 1:
            raise ValueError(f"n_levels must be >= 1, got {self.n_levels}")
        if isinstance(self.stride, bool) or not isinstance(self.stride, int):
            raise ValueError(f"stride must be an integer >= 2, got {self.stride!r}")
        if self.stride < 2:
            raise ValueError(f"stride must be >= 2, got {self.stride}")
        if not isinstance(self.causal, bool):
            raise ValueError(f"causal must be True or False, got {self.causal!r}")
        if self.impl not in ATTENTION_IMPLS:
            raise ValueError(f"impl must be one of {sorted(ATTENTION_IMPLS)}, got {self.impl!r}")
        if self.downsample_kernel < 1:
            raise ValueError(f"downsample_kernel must be >= 1, got {self.downsample_kernel}")
        if self.conv_kernel < 1:
            raise ValueError(f"conv_kernel must be >= 1, got {self.conv_kernel}")
        if self.learn_beta and not 0.0 < self.beta_init < 1.0:
            raise ValueError(
                f"beta_init must be in (0, 1) when learn_beta=True, got {self.beta_init}"
            )
        if not 0.0 <= self.beta_init <= 1.0:
            raise ValueError(f"beta_init must be in [0, 1], got {self.beta_init}")
        for name in ("attn_dropout", "dropout"):
            p = getattr(self, name)
            if not 0.0 <= p < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {p}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def check_input_dtype(x: Tensor, weight: Tensor, owner: str) -> None:
    """Refuse an ``x`` that is not floating point or not in the parameters' dtype (that of
    ``weight``); under autocast, which casts per operation, float32 parameters also take
    bfloat16 / float16 input. ``owner`` names the module in the message."""
    if not torch.is_floating_point(x):
        raise ValueError(f"x must be a floating-point tensor, got {x.dtype}")
    if x.dtype == weight.dtype:
        return
    kind = x.device.type
    reduced = weight.dtype == torch.float32 and x.dtype in (torch.bfloat16, torch.float16)
    if not (reduced and torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind)):
        raise ValueError(
            f"x is {x.dtype} but the {owner}'s parameters are {weight.dtype}: cast the input "
            f"(x.to({weight.dtype})) or the {owner} ({owner}.to({x.dtype}))"
        )


class HKTAttention(nn.Module):
    """Hierarchical kernel attention layer with a hybrid attention/convolution head.

    Args:
        config: an :class:`HKTConfig`.
        cpp_decode: decoding steps without gradients or dropout, every sequence at one
            position, run the compiled step (``kernels/csrc/hkt_decode.cpp``) on the CPU in
            float32 / float64 (default True); False: always the PyTorch step (the reference the
            compiled one is tested against). See also
            :func:`~structattn.hkt.decoding.use_compiled_step`.

    Forward:
        x: ``(B, T, D)``, floating point, in the parameters' dtype (``layer.to(dtype)``; under
            autocast float32 parameters also take bfloat16 / float16).
        key_padding_mask: ``(B, T)`` bool, True = real token, or None. Outputs at padded
            positions are 0; real positions never depend on padding (everything is causal
            along T except the attention itself, which masks padded keys).

    Returns ``(B, T, D)``.

    ``torch.jit.trace`` and ``torch.compile`` run the layer; TorchScript scripting
    (``torch.jit.script``) does not and is refused.
    """

    def __init__(self, config: HKTConfig, *, cpp_decode: bool = True):
        super().__init__()
        self.config = config
        self.cpp_decode = bool(cpp_decode)
        D, H, L = config.d_model, config.n_heads, config.n_levels
        self.downsample = nn.ModuleList(
            CausalDownsample(D, config.downsample_kernel, config.stride) for _ in range(L - 1)
        )
        self.q_proj = nn.ModuleList(nn.Linear(D, D, bias=config.bias) for _ in range(L))
        self.k_proj = nn.ModuleList(nn.Linear(D, D, bias=config.bias) for _ in range(L))
        self.v_proj = nn.Linear(D, D, bias=config.bias)
        self.o_proj = nn.Linear(D, D, bias=config.bias)
        theta = torch.full((H, L), config.level_logits_init)
        theta[:, 0] = 0.0
        if config.learn_levels:
            self.level_logits = nn.Parameter(theta)  # theta (H, L); lambda = softmax(theta)
        else:
            self.register_buffer("level_logits", theta)  # fixed lambda (the ablation)
        if config.hybrid:
            self.conv = CausalDepthwiseConv(D, config.conv_kernel)
            if config.learn_beta:
                b = math.log(config.beta_init / (1.0 - config.beta_init))
                self.beta_logits = nn.Parameter(torch.full((H,), b))  # beta = sigmoid(b)
            else:
                self.register_buffer("beta_fixed", torch.full((H,), config.beta_init))
        self.out_dropout = nn.Dropout(config.dropout)

    def __prepare_scriptable__(self) -> HKTAttention:
        # torch.jit.script calls this on every module it scripts, before compiling anything
        raise NotImplementedError(
            "HKTAttention does not support TorchScript scripting (torch.jit.script): "
            "use torch.jit.trace or torch.compile"
        )

    def level_weights(self) -> Tensor:
        """Convex level weights ``lambda = softmax(theta)``, shape ``(H, L)``."""
        return torch.softmax(self.level_logits, dim=-1)

    def attn_drop_p(self) -> float:
        """Attention dropout in effect now (0 in eval mode)."""
        return self.config.attn_dropout if self.training else 0.0

    def beta(self) -> Tensor:
        """Attention share of the hybrid head per head, shape ``(H,)`` (ones if not hybrid)."""
        if not self.config.hybrid:
            return torch.ones(self.config.n_heads, device=self.level_logits.device)
        if self.config.learn_beta:
            return torch.sigmoid(self.beta_logits)
        return self.beta_fixed

    def _heads(self, x: Tensor) -> Tensor:
        B, T, width = x.shape
        H = self.config.n_heads
        return x.view(B, T, H, width // H).transpose(1, 2)  # (B, H, T, d); B = 0 works too

    def levels(self, x: Tensor) -> list[Tensor]:
        """Inputs of every level ``[X^0, ..., X^{L-1}]``, level ``l`` of shape ``(B, T_l, D)``.

        When gradients are recorded and :attr:`HKTConfig.recompute_levels` is set, the coarse
        levels are recomputed in the backward pass (``torch.utils.checkpoint``) instead of
        keeping every convolution, LayerNorm and GELU output alive: the same values and
        gradients, bit for bit, for a few percent more work on ``T / s + T / s^2 + ...`` rows.
        """
        if not self.downsample:
            return [x]
        if self.config.recompute_levels and torch.is_grad_enabled() and not torch.jit.is_tracing():
            return [x, *checkpoint(self._coarse_levels, x, use_reentrant=False)]
        return [x, *self._coarse_levels(x)]

    def _coarse_levels(self, x: Tensor) -> list[Tensor]:
        out = [x]
        for down in self.downsample:
            out.append(down(out[-1]))
        return out[1:]

    def forward(
        self,
        x: Tensor,
        key_padding_mask: Tensor | None = None,
        cache: HKTLayerCache | None | _EmptySlot = None,
        right_padded: bool | None = None,
    ) -> Tensor | tuple[Tensor, HKTLayerCache]:
        """``x (B, T, D) -> (B, T, D)``. ``right_padded``: the caller's word on the mask's
        layout (see :func:`~structattn.hkt.hkt_attention`); the forward and backward passes read
        nothing back from a non-CPU device.

        With ``cache`` (causal layers only): an empty slot (:data:`EMPTY`) runs the prompt (the
        prefill; padding must be on the right) and returns ``(y, cache)``; an
        :class:`HKTLayerCache` takes ``x`` as the next ``T`` tokens of every sequence and
        returns ``(y, cache)`` with the cache extended, each output equal to the full forward
        pass's at that position.
        """
        cfg = self.config
        self._check_input(x, key_padding_mask, cache)
        B, T, D = x.shape
        if isinstance(cache, HKTLayerCache):
            return decode(self, x, cache), cache
        if T == 0:  # an empty sequence: an empty output, connected to the parameters
            if cache is not None:
                raise ValueError("cannot prefill a cache with an empty prompt (T = 0)")
            return self.o_proj(self.v_proj(x))
        x_proj, x_levels = autocast_copy(x)  # under autocast: one bfloat16 copy for both
        xs = self.levels(x_levels)
        q, k, v_flat = self._project([x_proj, *xs[1:]])
        lam = self.level_weights().to(x.dtype)  # (H, L)
        o = hkt_attention(
            q,
            k,
            self._heads(v_flat),
            lam,
            stride=cfg.stride,
            causal=cfg.causal,
            key_padding_mask=key_padding_mask,
            impl=cfg.impl,
            dropout_p=cfg.attn_dropout if self.training else 0.0,
            right_padded=right_padded,
            zero_padded=False,  # y's padded rows are zeroed below
        )  # (B, H, T, d)
        conv = self.conv(v_flat) if cfg.hybrid else None
        y = self._output(o.transpose(1, 2).reshape(B, T, D), conv)
        if key_padding_mask is not None:
            y = y.masked_fill(~key_padding_mask[..., None], 0.0)
        if cache is None:
            return y
        return y, prefill(self, xs, q, k, v_flat, key_padding_mask)

    def _check_input(
        self,
        x: Tensor,
        key_padding_mask: Tensor | None,
        cache: HKTLayerCache | None | _EmptySlot,
    ) -> None:
        """Check :meth:`forward`'s input: ``x``'s shape and dtype, the mask's shape and that a
        cache is asked of a causal layer only."""
        cfg = self.config
        if x.dim() != 3 or x.shape[-1] != cfg.d_model:
            raise ValueError(
                f"x must have shape (B, T, d_model={cfg.d_model}), got {tuple(x.shape)}"
            )
        check_input_dtype(x, self.v_proj.weight, "layer")
        B, T, D = x.shape
        if key_padding_mask is not None and tuple(key_padding_mask.shape) != (B, T):
            raise ValueError(
                f"key_padding_mask must have shape (B, T) = {(B, T)}, "
                f"got {tuple(key_padding_mask.shape)}"
            )
        if cache is not None and not cfg.causal:
            raise ValueError("a bidirectional HKT layer cannot decode (causal=False)")

    def _project(self, xs: list[Tensor]) -> tuple[list[Tensor], list[Tensor], Tensor]:
        """Per-level queries and keys ``(B, H, T_l, d)`` and the values ``(B, T, D)``: one GEMM
        for level 0's Q, K and V, one per coarse level for its Q and K (the weights are
        concatenated per call; parameters and checkpoints stay per projection). The outputs are
        strided views of the GEMM results, which the kernels read in place."""
        D = self.config.d_model

        def fused(linears: list[nn.Linear], x: Tensor) -> tuple[Tensor, ...]:
            weight = torch.cat([m.weight for m in linears])
            bias = None if linears[0].bias is None else torch.cat([m.bias for m in linears])
            return F.linear(x, weight, bias).split(D, dim=-1)

        q0, k0, v_flat = fused([self.q_proj[0], self.k_proj[0], self.v_proj], xs[0])
        q, k = [self._heads(q0)], [self._heads(k0)]
        for l in range(1, len(xs)):
            q_l, k_l = fused([self.q_proj[l], self.k_proj[l]], xs[l])
            q.append(self._heads(q_l))
            k.append(self._heads(k_l))
        return q, k, v_flat

    def _output(self, attn: Tensor, conv: Tensor | None) -> Tensor:
        """Hybrid head and output projection: ``attn (..., D)``, ``conv (..., D)`` or None."""
        if conv is not None:
            beta = self.beta().to(attn.dtype).repeat_interleave(self.config.head_dim)  # (D,)
            attn = torch.lerp(conv, attn, beta)  # beta * attn + (1 - beta) * conv, one pass
        return self.out_dropout(self.o_proj(attn))

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"d_model={c.d_model}, n_heads={c.n_heads}, n_levels={c.n_levels}, "
            f"stride={c.stride}, causal={c.causal}, hybrid={c.hybrid}, impl={c.impl!r}"
        )

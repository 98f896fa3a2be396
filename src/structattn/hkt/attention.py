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

from .cache import DecodeWeights, HKTLayerCache, decode_attention, grow, one_length, prompt_lengths
from .cpu_kernel import cpu_kernel_for
from .downsample import CausalDepthwiseConv, CausalDownsample
from .functional import ATTENTION_IMPLS, hkt_attention

__all__ = ["EMPTY", "HKTConfig", "HKTAttention"]


class _EmptySlot:
    """The cache argument of a layer's prefill: fill a new cache from this forward pass."""

    def __repr__(self) -> str:
        return "EMPTY"


#: Pass as ``cache=`` to a layer to run the prompt and get a new cache back.
EMPTY = _EmptySlot()


def _tail(x: Tensor, lengths: Tensor, width: int) -> Tensor:
    """Rows ``lengths[b] - width .. lengths[b] - 1`` of ``x[b]`` (zeros before row 0):
    ``x (B, T, D) -> (B, width, D)``."""
    B, T, D = x.shape
    idx = lengths[:, None] - width + torch.arange(width, device=x.device)  # (B, width)
    rows = x.gather(1, idx.clamp(0, max(T - 1, 0))[..., None].expand(B, width, D))
    return rows.masked_fill((idx < 0)[..., None], 0.0)


def _decode_kernel(x: Tensor):
    """The compiled decoding step for ``x``'s device and dtype (CPU, float32 or float64), or
    None: then the PyTorch step runs (and always while :attr:`HKTAttention.cpp_decode` is
    False)."""
    return cpu_kernel_for(x) if HKTAttention.cpp_decode else None


def _depthwise_last(inputs: Tensor, conv: nn.Conv1d) -> Tensor:
    """The causal depthwise convolution's output for the last of ``inputs (B, k, D)``, which
    hold the inputs ``t - k + 1 .. t`` it reads: ``(B, D)``."""
    w = conv.weight[:, 0, :].transpose(0, 1)  # (k, D)
    out = (inputs * w).sum(1)
    return out if conv.bias is None else out + conv.bias


@dataclass
class HKTConfig:
    """Configuration of one :class:`HKTAttention` layer."""

    d_model: int = 256  # model width D
    n_heads: int = 4  # heads H; head dim d = D / H
    n_levels: int = 3  # resolution levels L (1 = flat attention)
    stride: int = 2  # length ratio s >= 2 between consecutive levels
    causal: bool = True  # causal (decoder) or bidirectional (encoder) attention
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


class HKTAttention(nn.Module):
    """Hierarchical kernel attention layer with a hybrid attention/convolution head.

    Args:
        config: an :class:`HKTConfig`.

    Forward:
        x: ``(B, T, D)``.
        key_padding_mask: ``(B, T)`` bool, True = real token, or None. Outputs at padded
            positions are 0; real positions never depend on padding (everything is causal
            along T except the attention itself, which masks padded keys).

    Returns ``(B, T, D)``.
    """

    #: Decoding steps without gradients or dropout, every sequence at one position, run the
    #: compiled step (``csrc/hkt_decode.cpp``) on the CPU in float32 / float64; False: always
    #: the PyTorch step (the reference the compiled one is tested against).
    cpp_decode: bool = True

    def __init__(self, config: HKTConfig):
        super().__init__()
        self.config = config
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
        B, T, _ = x.shape
        H = self.config.n_heads
        return x.view(B, T, H, -1).transpose(1, 2)  # (B, H, T, d)

    def levels(self, x: Tensor) -> list[Tensor]:
        """Inputs of every level ``[X^0, ..., X^{L-1}]``, level ``l`` of shape ``(B, T_l, D)``."""
        out = [x]
        for down in self.downsample:
            out.append(down(out[-1]))
        return out

    def forward(
        self,
        x: Tensor,
        key_padding_mask: Tensor | None = None,
        cache: HKTLayerCache | None | _EmptySlot = None,
    ) -> Tensor | tuple[Tensor, HKTLayerCache]:
        """``x (B, T, D) -> (B, T, D)``.

        With ``cache`` (causal layers only): an empty slot (:data:`EMPTY`) runs the prompt (the
        prefill; padding must be on the right) and returns ``(y, cache)``; an
        :class:`HKTLayerCache` takes ``x`` as the next ``T`` tokens of every sequence and
        returns ``(y, cache)`` with the cache extended, each output equal to the full forward
        pass's at that position.
        """
        cfg = self.config
        if x.dim() != 3 or x.shape[-1] != cfg.d_model:
            raise ValueError(
                f"x must have shape (B, T, d_model={cfg.d_model}), got {tuple(x.shape)}"
            )
        B, T, D = x.shape
        if key_padding_mask is not None and tuple(key_padding_mask.shape) != (B, T):
            raise ValueError(
                f"key_padding_mask must have shape (B, T) = {(B, T)}, "
                f"got {tuple(key_padding_mask.shape)}"
            )
        if cache is not None and not cfg.causal:
            raise ValueError("a bidirectional HKT layer cannot decode (causal=False)")
        if isinstance(cache, HKTLayerCache):
            return self._decode(x, cache), cache
        if T == 0:  # an empty sequence: an empty output, connected to the parameters
            if cache is not None:
                raise ValueError("cannot prefill a cache with an empty prompt (T = 0)")
            return self.o_proj(self.v_proj(x))
        xs = self.levels(x)
        q, k, v_flat = self._project(xs)
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
        )  # (B, H, T, d)
        conv = self.conv(v_flat) if cfg.hybrid else None
        y = self._output(o.transpose(1, 2).reshape(B, T, D), conv)
        if key_padding_mask is not None:
            y = y.masked_fill(~key_padding_mask[..., None], 0.0)
        if cache is None:
            return y
        return y, self._prefill(xs, q, k, v_flat, key_padding_mask)

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

    # -- decoding ---------------------------------------------------------------------------

    def _prefill(
        self,
        xs: list[Tensor],
        q: list[Tensor],
        k: list[Tensor],
        v_flat: Tensor,
        key_padding_mask: Tensor | None,
    ) -> HKTLayerCache:
        """The cache after the prompt: rows past each sequence's length are left as computed
        (they are never read before being overwritten)."""
        cfg = self.config
        B, T, D = v_flat.shape
        s = cfg.stride
        lengths = prompt_lengths(key_padding_mask, B, T, v_flat.device)
        bidx = torch.arange(B, device=v_flat.device)
        queries, windows = [], []
        for l in range(cfg.n_levels):
            last_block = (lengths - 1) // s**l  # (B,) the current block of level l
            queries.append(q[l][bidx, :, last_block])  # (B, H, d)
            if l < cfg.n_levels - 1:  # inputs c*s - k + 1 .. c*s - 1 of level l+1's next token
                windows.append(_tail(xs[l], -(-lengths // s**l), cfg.downsample_kernel - 1))
        conv_window = _tail(v_flat, lengths, cfg.conv_kernel - 1) if cfg.hybrid else None
        return HKTLayerCache(
            keys=[t.clone(memory_format=torch.contiguous_format) for t in k],
            queries=queries,
            windows=windows,
            values=self._heads(v_flat).clone(memory_format=torch.contiguous_format),
            conv_window=conv_window,
            lengths=lengths.clone(),
            scores=[None] * cfg.n_levels,
        )

    def _decode(self, x: Tensor, cache: HKTLayerCache) -> Tensor:
        """The next ``T`` tokens of every sequence, one at a time: ``x (B, T, D)``."""
        if x.shape[0] != cache.lengths.shape[0]:
            raise ValueError(
                f"the cache holds {cache.lengths.shape[0]} sequences, got a batch of {x.shape[0]}"
            )
        outs = [self._step(x[:, t], cache) for t in range(x.shape[1])]
        if not outs:
            return x.new_zeros(x.shape)
        return torch.stack(outs, dim=1)

    def _step(self, x: Tensor, cache: HKTLayerCache) -> Tensor:
        """One token per sequence at positions ``cache.lengths``: ``x (B, D) -> (B, D)``.

        Level ``l`` gets a new coarse token where ``pos % s^l == 0``; its query then replaces
        the block's query and its key is written at row ``pos // s^l``."""
        cfg = self.config
        B, D = x.shape
        H, d, s, L = cfg.n_heads, cfg.head_dim, cfg.stride, cfg.n_levels
        pos = cache.lengths  # (B,) index of the new token
        n = pos + 1
        n_max = int(n.max())
        # Read keys 0 .. T0 - 1 with T0 a multiple of s^(L-1): every level then holds exactly
        # T0 / s^l rows and the coarse-to-fine sum is a reshape (rows past n are masked).
        span = s ** (L - 1)
        T0 = -(-n_max // span) * span
        # The concatenated weights are made once per cache (the keys it holds were made with
        # these parameters too), and every step while a gradient may flow to them.
        live = torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters())
        params = cache.params
        if live or params is None or params.weight.dtype != x.dtype:
            params = self._decode_params(x.dtype)
            cache.params = None if live else params
        qkv = F.linear(x, params.weight, params.bias)  # level 0's Q, K, V: one GEMM
        aligned = one_length(n, n_max)
        if aligned and not torch.is_grad_enabled() and self.attn_drop_p() == 0:
            kernel = _decode_kernel(x)
            if kernel is not None:
                return self._step_cpp(kernel, x, qkv, cache, n, n_max - 1, T0, params)
        coarse, w, beta = params.coarse, params.w, params.beta
        q0, k0, v = qkv.split(D, dim=-1)
        values = grow(cache.values, T0)
        if aligned:
            p = n_max - 1
            top = self._new_coarse_tokens_aligned(x, q0, k0, cache, p, T0, coarse)
            values[:, :, p] = v.view(B, H, d)
            n_used: Tensor | int = n_max  # one length: rows past it are sliced off, not masked
        else:
            top = self._new_coarse_tokens(x, q0, k0, cache, pos, T0, coarse)
            values[torch.arange(B, device=x.device), :, pos] = v.view(B, H, d)
            n_used = n
        cache.values = values

        # Scores of the new query against keys 0 .. pos, levels summed coarse to fine:
        # acc_l[c] = lambda_l q_l . K_l[c] + acc_{l+1}[c // s], S[j] = acc_0[j]; lambda and the
        # scale (w) go on the queries (d numbers each instead of T). Levels above ``top`` kept
        # their query and keys since the last step, so their acc_l is the cached one: a step
        # reads level l's keys once per s^l tokens, not every token.
        acc = None
        for l in reversed(range(L)):
            kept = cache.scores[l]
            if l > top and kept is not None and kept.shape[-1] == T0 // s**l:
                acc = kept
                continue
            q_l = (cache.queries[l] * w[:, l, None])[:, :, None, :]  # (B, H, 1, d)
            s_l = (q_l @ cache.keys[l][:, :, : T0 // s**l].transpose(-1, -2)).squeeze(-2)
            if acc is not None:  # (B, H, T_l) += upsampled (B, H, T_l / s), in place
                s_l.unflatten(-1, (-1, s)).add_(acc[..., None])
            if l > 0:
                cache.scores[l] = s_l
            acc = s_l
        o = decode_attention(acc, n_used, cache.values[:, :, :T0], self.attn_drop_p())
        o = o.reshape(B, D)

        if cfg.hybrid:
            inputs = torch.cat([cache.conv_window, v[:, None]], dim=1)  # (B, k_conv, D)
            cache.conv_window = inputs[:, 1:]
            conv = _depthwise_last(inputs, self.conv.conv)
            o = torch.lerp(conv, o, beta)
        cache.lengths = n
        return self.out_dropout(self.o_proj(o))

    def _step_cpp(
        self,
        kernel,
        x: Tensor,
        qkv: Tensor,
        cache: HKTLayerCache,
        n: Tensor,
        pos: int,
        T0: int,
        params: DecodeWeights,
    ) -> Tensor:
        """:meth:`_step` for sequences at one position, without gradients or dropout, as one
        call of the compiled step (``csrc/hkt_decode.cpp``, the same updates and sums)."""
        cfg = self.config
        L, s = cfg.n_levels, cfg.stride
        if params.kernel_args is None:  # first compiled step with these weights: once
            params.kernel_args = self._kernel_params(params.coarse, x.dtype)
        coarse_w, coarse_b, down_w, down_b, ln_w, ln_b, eps, conv_w, conv_b, empty = (
            params.kernel_args
        )
        cache.values = grow(cache.values, T0)
        cache.keys = [grow(t, T0 // s**l) for l, t in enumerate(cache.keys)]
        hybrid = cache.conv_window is not None
        out = kernel.decode_step(
            x,
            qkv,
            pos,
            T0,
            s,
            cache.keys,
            cache.queries,
            cache.windows,
            cache.values,
            cache.conv_window if hybrid else empty,
            [empty if t is None else t for t in cache.scores],
            coarse_w,
            coarse_b,
            down_w,
            down_b,
            ln_w,
            ln_b,
            eps,
            params.w,
            params.beta if hybrid else empty,
            conv_w,
            conv_b,
        )
        cache.queries = out[1 : 1 + L]
        cache.windows = out[1 + L : 2 * L]
        if hybrid:
            cache.conv_window = out[2 * L]
        cache.scores = [None, *out[2 * L + 2 :]]
        cache.lengths = n
        return self.out_dropout(self.o_proj(out[0]))

    def _decode_params(self, dtype: torch.dtype) -> DecodeWeights:
        """Level 0's Q, K, V weights and biases concatenated, every coarse level's Q and K
        weights and biases concatenated, the level weights times the score scale ``(H, L)``
        and beta per channel ``(D,)``."""
        cfg = self.config

        def fused(group: list[nn.Linear]) -> tuple[Tensor, Tensor | None]:
            weight = torch.cat([m.weight for m in group]).to(dtype)
            if group[0].bias is None:
                return weight, None
            return weight, torch.cat([m.bias for m in group]).to(dtype)

        weight, bias = fused([self.q_proj[0], self.k_proj[0], self.v_proj])
        coarse = [fused([self.q_proj[l], self.k_proj[l]]) for l in range(1, cfg.n_levels)]
        w = self.level_weights().to(dtype) * (1.0 / math.sqrt(cfg.head_dim))
        beta = self.beta().to(dtype).repeat_interleave(cfg.head_dim)
        return DecodeWeights(weight, bias, coarse, w, beta)

    def _kernel_params(self, coarse: list[tuple[Tensor, Tensor | None]], dtype: torch.dtype):
        """The compiled step's arguments beyond :meth:`_decode_params`: the coarse weights and
        biases as lists, per downsampling level its conv weight ``(D, k)``, conv bias,
        LayerNorm weight, bias and eps, then the hybrid head's conv weight ``(D, k)`` and bias,
        and an empty tensor (which stands for every absent one)."""
        hybrid = self.config.hybrid
        empty = torch.empty(0, dtype=dtype, device=self.v_proj.weight.device)

        def vector(t: Tensor | None) -> Tensor:
            return empty if t is None else t.detach().to(dtype).contiguous()

        def conv_weight(conv: nn.Conv1d) -> Tensor:
            return conv.weight.detach()[:, 0, :].to(dtype).contiguous()  # (D, k)

        downs = list(self.downsample)
        return (
            [c[0] for c in coarse],
            [empty if c[1] is None else c[1] for c in coarse],
            [conv_weight(m.conv.conv) for m in downs],
            [vector(m.conv.conv.bias) for m in downs],
            [vector(m.norm.weight) for m in downs],
            [vector(m.norm.bias) for m in downs],
            [float(m.norm.eps) for m in downs],
            conv_weight(self.conv.conv) if hybrid else empty,
            vector(self.conv.conv.bias) if hybrid else empty,
            empty,
        )

    def _new_coarse_tokens(
        self,
        x: Tensor,
        q0: Tensor,
        k0: Tensor,
        cache: HKTLayerCache,
        pos: Tensor,
        T0: int,
        coarse: list[tuple[Tensor, Tensor | None]],
    ) -> int:
        """Queries, keys and windows of every level for tokens at positions ``pos (B,)``:
        level ``l`` gets a coarse token where ``pos % s^l == 0`` (per sequence). Returns the
        highest level where some sequence got a new query."""
        cfg = self.config
        B, _ = x.shape
        H, d, s, L = cfg.n_heads, cfg.head_dim, cfg.stride, cfg.n_levels
        bidx = torch.arange(B, device=x.device)
        tok, new = x, torch.ones(B, dtype=torch.bool, device=x.device)
        for l in range(L):
            if l > 0:
                down = self.downsample[l - 1]
                inputs = torch.cat([cache.windows[l - 1], tok[:, None]], dim=1)  # (B, k, D)
                keep = new[:, None, None]
                cache.windows[l - 1] = torch.where(keep, inputs[:, 1:], cache.windows[l - 1])
                new = new & (pos % s**l == 0)
                if not bool(new.any()):
                    for m in range(l, L):  # no new coarse token: only make room
                        cache.keys[m] = grow(cache.keys[m], T0 // s**m)
                    return l - 1
                tok = _depthwise_last(inputs, down.conv.conv)  # (B, D)
                tok = F.gelu(down.norm(tok))
            if l > 0:
                q_l, k_l = F.linear(tok, *coarse[l - 1]).chunk(2, dim=-1)
            else:
                q_l, k_l = q0, k0
            q_l, k_l = q_l.reshape(B, H, d), k_l.reshape(B, H, d)
            keys = grow(cache.keys[l], T0 // s**l)
            rows = pos // s**l
            keys[bidx, :, rows] = torch.where(new[:, None, None], k_l, keys[bidx, :, rows])
            cache.keys[l] = keys
            cache.queries[l] = torch.where(new[:, None, None], q_l, cache.queries[l])
        return L - 1

    def _new_coarse_tokens_aligned(
        self,
        x: Tensor,
        q0: Tensor,
        k0: Tensor,
        cache: HKTLayerCache,
        pos: int,
        T0: int,
        coarse: list[tuple[Tensor, Tensor | None]],
    ) -> int:
        """:meth:`_new_coarse_tokens` when every sequence is at the same position ``pos``
        (batch of one, or equal prompt lengths): the same updates without per-row selects."""
        cfg = self.config
        B, _ = x.shape
        H, d, s, L = cfg.n_heads, cfg.head_dim, cfg.stride, cfg.n_levels
        tok = x
        for l in range(L):
            if l > 0:
                down = self.downsample[l - 1]
                inputs = torch.cat([cache.windows[l - 1], tok[:, None]], dim=1)  # (B, k, D)
                cache.windows[l - 1] = inputs[:, 1:]
                if pos % s**l:  # no new coarse token from here up: only make room
                    for m in range(l, L):
                        cache.keys[m] = grow(cache.keys[m], T0 // s**m)
                    return l - 1
                tok = F.gelu(down.norm(_depthwise_last(inputs, down.conv.conv)))  # (B, D)
            q_l, k_l = (q0, k0) if l == 0 else F.linear(tok, *coarse[l - 1]).chunk(2, dim=-1)
            keys = grow(cache.keys[l], T0 // s**l)
            keys[:, :, pos // s**l] = k_l.reshape(B, H, d)
            cache.keys[l] = keys
            cache.queries[l] = q_l.reshape(B, H, d)
        return L - 1

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"d_model={c.d_model}, n_heads={c.n_heads}, n_levels={c.n_levels}, "
            f"stride={c.stride}, causal={c.causal}, hybrid={c.hybrid}, impl={c.impl!r}"
        )

"""HKT attention as one ``scaled_dot_product_attention`` call (``impl="sdpa"``), and the
padding-aware SDPA call it shares with the multi-head-attention baseline.

Nearest upsampling ``U_l`` is linear and ``lambda >= 0``, so

    sum_l lambda_l U_l S^l U_l^T = Q~ K~^T,   Q~ = [lambda_0 U_0 Q^0, ..., lambda_{L-1} U Q^{L-1}]
                                              K~ = [U_0 K^0, ..., U K^{L-1}]     (head dim L*d)

and one SDPA call (flash kernels on CPU and GPU) computes HKT attention exactly without ever
holding a ``T x T`` matrix. The weights are applied to the query side only, so gradients with
respect to lambda stay finite at lambda = 0. Shapes as in :mod:`structattn.hkt.interface`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..levels import attendable_keys, is_right_padded, upsample_levels

__all__ = ["masked_sdpa", "sdpa_attention"]


def masked_sdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    right_padded: bool | None = None,
) -> Tensor:
    """``scaled_dot_product_attention`` with a ``(B, T)`` key padding mask, in O(T) memory for
    right-padded batches (and for any mask when bidirectional).

    Shapes: ``q, k (B, H, T, E)``, ``v (B, H, T, E_v)``, mask ``(B, T)`` bool (True = real),
    returns ``(B, H, T, E_v)``. Rows of padded queries hold finite values that callers discard;
    :func:`~structattn.hkt.hkt_attention` zeroes them.

    ``right_padded`` (causal calls with a mask): whether every row is real tokens followed by
    padding, as the caller knows it. None: read from a CPU mask
    (:func:`~structattn.hkt.levels.is_right_padded`, no device involved); on any other device
    it is never read back (that would synchronise the device), and the call takes the path
    that is exact for any padding, a ``(B, 1, T, T)`` bool mask.
    """
    B, _, T, _ = q.shape
    attn_mask = None
    is_causal = causal
    if key_padding_mask is not None:
        if causal and right_padded is None:
            right_padded = key_padding_mask.device.type == "cpu" and is_right_padded(
                key_padding_mask
            )
        if causal and right_padded:
            # Real queries sit before every padded key, so the causal mask already hides the
            # padding from them; padded query rows are discarded by the caller.
            pass
        else:
            keys = attendable_keys(key_padding_mask)
            attn_mask = keys.view(B, 1, 1, T)  # broadcast over queries: O(T) memory
            if causal:
                # A hole inside a sequence under a causal mask: the only case that needs a
                # materialised (B, 1, T, T) bool mask.
                tril = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
                attn_mask = attn_mask & tril.view(1, 1, T, T)
                attn_mask = attn_mask | ~attn_mask.any(-1, keepdim=True)
                is_causal = False
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale
    )


def _concat_last(parts: list[Tensor]) -> Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def _pad_last(x: Tensor, width: int) -> Tensor:
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def sdpa_attention(
    q, k, v, lam, stride, causal, key_padding_mask, scale, dropout_p, right_padded=None
):
    """Registered as ``impl="sdpa"``; the contract of the other implementations
    (``right_padded``: see :func:`masked_sdpa`)."""
    B, H, T, d_v = v.shape
    n_levels = len(q)
    d = q[0].shape[-1]
    q_cat = _concat_last(
        [upsample_levels(q[l], stride**l, T) * lam[:, l].view(1, H, 1, 1) for l in range(n_levels)]
    )  # (B, H, T, L*d)
    k_cat = _concat_last([upsample_levels(k[l], stride**l, T) for l in range(n_levels)])
    # The flash kernels need one head dim for q, k and v; zero columns change no score.
    width = max(n_levels * d, d_v)
    q_cat = _pad_last(q_cat, width)
    k_cat = _pad_last(k_cat, width)  # (B, H, T, width)
    v_pad = _pad_last(v, width)  # (B, H, T, width)

    out = masked_sdpa(
        q_cat,
        k_cat,
        v_pad,
        causal=causal,
        key_padding_mask=key_padding_mask,
        scale=scale,
        dropout_p=dropout_p,
        right_padded=right_padded,
    )  # (B, H, T, width)
    return out if width == d_v else out[..., :d_v]

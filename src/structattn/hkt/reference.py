"""The readable reference of HKT attention: every level's scores materialised as ``T x T``.

For each head ``h``, with level weights ``lambda_h`` on the simplex,

    S^l_h      = Q^l_h K^l_h^T * scale                                   (T_l x T_l)
    S_h[i, j]  = sum_l lambda_{h,l} S^l_h[floor(i / s^l), floor(j / s^l)]
    A_h        = softmax(S_h + mask),     O_h = A_h V_h

(``impl="reference"``; the other implementations are tested against it). Shapes as in
:mod:`structattn.hkt.interface`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["hkt_scores", "reference_attention"]


def hkt_scores(
    q: Sequence[Tensor],
    k: Sequence[Tensor],
    level_weights: Tensor,
    *,
    stride: int = 2,
    scale: float | None = None,
) -> Tensor:
    """Fused HKT scores ``S_h = sum_l lambda_{h,l} U_l S^l_h U_l^T``, materialised.

    Shapes: ``q[l], k[l] (B, H, T_l, d)``; ``level_weights (H, L)`` or ``(L,)``;
    returns ``(B, H, T, T)`` (no mask applied). Meant for tests and diagnostics.
    """
    B, H, T, d = q[0].shape
    n_levels = len(q)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    lam = level_weights if level_weights.dim() == 2 else level_weights.expand(H, n_levels)
    scores = q[0].new_zeros(B, H, T, T)
    for l in range(n_levels):
        s_l = (q[l] @ k[l].transpose(-1, -2)) * scale  # (B, H, T_l, T_l)
        idx = torch.arange(T, device=s_l.device) // stride**l  # fine position -> coarse index
        s_up = s_l[:, :, idx][:, :, :, idx]  # (B, H, T, T)
        scores = scores + lam[:, l].view(1, H, 1, 1) * s_up
    return scores


def reference_attention(q, k, v, lam, stride, causal, key_padding_mask, scale, dropout_p):
    """Registered as ``impl="reference"``; the contract of the other implementations."""
    B, H, T, _ = v.shape
    scores = hkt_scores(q, k, lam, stride=stride, scale=scale)  # (B, H, T, T)
    allowed = torch.ones(T, T, dtype=torch.bool, device=v.device)
    if causal:
        allowed = allowed.tril()
    allowed = allowed.view(1, 1, T, T)
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask.view(B, 1, 1, T)
    # A row with no admissible key is a padded query (a real query always sees itself); let it
    # attend anywhere to stay finite, its output is zeroed below.
    allowed = allowed | ~allowed.any(-1, keepdim=True)
    attn = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    if dropout_p > 0:
        attn = F.dropout(attn, p=dropout_p)
    return attn @ v  # (B, H, T, d_v)

"""The paper's theory as measurements: pure functions on tensors (arXiv 2604.08829, §3-4).

Definitions used here (the paper's text beyond its abstract is not available to us; where it
leaves a term open, the choice below is this project's and is stated precisely).

Bilinear forms (Props. 3.5-3.6). For layer, level ``l`` and head ``h`` with query/key weights
``W_Q^l[h], W_K^l[h]`` (``d x D`` row blocks of the projections), the score of tokens ``x, y`` is
``x^T M y`` with ``M = W_Q^l[h]^T W_K^l[h] / sqrt(d)`` (``D x D``, biases excluded). ``M`` splits
uniquely into ``M_s = (M + M^T)/2`` (reciprocal attention) and ``M_a = (M - M^T)/2`` (directional
attention); the two are Frobenius-orthogonal, so the shares ``||M_s||^2/||M||^2`` and
``||M_a||^2/||M||^2`` sum to 1. The same split applies to any square score matrix.

PSD condition (Prop. 3.1). Every ``M_s`` positive semidefinite is sufficient for the fused
symmetric kernel to be PSD; we report the smallest eigenvalue of each ``M_s``, whether all are
``>= -tol``, and the smallest eigenvalue of the fused symmetric score matrix ``(S + S^T)/2`` on
real inputs.

Non-Gaussianity. A *score vector* is, for a head and an admissible (query, key) pair ``(i, j)``,
the vector of its per-level scores ``(S^0[i, j], S^1[i//s, j//s], ..., S^{L-1}[...])``, so
``p = L``. Mardia's skewness ``b1 = mean_{a,b} (z_a^T S^-1 z_b)^3`` and kurtosis
``b2 = mean_a (z_a^T S^-1 z_a)^2`` (``z`` centred, ``S`` the maximum-likelihood covariance), the
Gaussian expectation ``p(p+2)`` of ``b2``, the index ``kappa = b2 / (p(p+2))`` (1 for a Gaussian),
and Mardia's kurtosis statistic ``z = (b2 - p(p+2)) / sqrt(8 p (p+2) / n)``. Univariate excess
kurtosis (``m4 / m2^2 - 3``) of the fused scores per head.

Approximation error (Thm. 4.3, Prop. 4.4). For a trained layer on inputs ``X``, per head:

* ``Xbar^l``: level ``l``'s features *without decimation*: the same causal convolutions, norms and
  activations applied at every fine position (stride 1, dilation ``s^(l-1)``, the "a trous"
  form). On the coarse grid it equals the downsampled features exactly:
  ``Xbar^l[c * s^l] = X^l[c]``;
* ``Sbar^l = (Xbar^l W_Q^l)(Xbar^l W_K^l)^T / sqrt(d)``: level ``l``'s kernel at full resolution;
* target ``K* = sum_l lambda_l Sbar^l``: the multi-scale kernel with no decimation at all;
* ``A_l = U_l S^l U_l^T``: what HKT uses for level ``l``, which is ``Sbar^l`` sampled at the
  first position of every ``s^l x s^l`` block and held over the block;
* ``P_l``: the orthogonal projection that replaces every ``s^l x s^l`` block by its mean.

With ``e(mu) = ||sum_l mu_l A_l - K*||^2 / ||K*||^2`` and ``mu* = argmin_{mu in simplex} e(mu)``:

* hierarchical approximation ``= ||sum_l mu*_l P_l Sbar^l - K*||^2 / ||K*||^2``: what any
  hierarchy with these block resolutions loses, even with perfect block summaries;
* quantisation ``= e(mu*) - hierarchical``: the extra loss of holding one sample per block
  instead of the block mean (information lost by decimation); a signed difference, it can be
  slightly negative when held samples happen to suit the combination of levels better;
* optimisation ``= e(lambda) - e(mu*) >= 0``: the trained level weights against the best ones;

and ``total = e(lambda) = hierarchical + quantisation + optimisation`` exactly. The error as a
function of the number of levels is ``e_L = min over the first L levels' simplex of e``,
non-increasing in ``L`` by construction; geometric decay means ``e_{L+1} / e_L`` stays below a
constant ``rho < 1``, which :func:`decay_ratios` reports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .attention import HKTAttention
from .cost import hkt_cost
from .levels import upsample_levels

__all__ = [
    "ApproximationError",
    "MardiaResult",
    "approximation_error",
    "bilinear_forms",
    "decay_ratios",
    "excess_kurtosis",
    "KURTOSIS_CANDIDATES",
    "kurtosis",
    "kurtosis_candidates",
    "layer_scores",
    "mardia",
    "psd_report",
    "score_vectors",
    "shares",
    "split_symmetric",
    "undecimated_levels",
    "cost_summary",
]


# ----------------------------------------------------------------------------- bilinear forms


def bilinear_forms(layer: HKTAttention) -> Tensor:
    """``M^l_h = W_Q^l[h]^T W_K^l[h] / sqrt(d)`` for every level and head: ``(L, H, D, D)``."""
    cfg = layer.config
    H, d, D = cfg.n_heads, cfg.head_dim, cfg.d_model
    forms = []
    for q_proj, k_proj in zip(layer.q_proj, layer.k_proj):
        wq = q_proj.weight.detach().view(H, d, D)
        wk = k_proj.weight.detach().view(H, d, D)
        forms.append(wq.transpose(1, 2) @ wk / math.sqrt(d))  # (H, D, D)
    return torch.stack(forms)


def split_symmetric(m: Tensor) -> tuple[Tensor, Tensor]:
    """The unique split ``m = sym + anti`` of square matrices (last two dims)."""
    mt = m.transpose(-1, -2)
    return (m + mt) / 2, (m - mt) / 2


def shares(m: Tensor) -> tuple[Tensor, Tensor]:
    """Reciprocity ``||M_s||^2/||M||^2`` and directionality ``||M_a||^2/||M||^2`` (sum to 1)."""
    sym, anti = split_symmetric(m)
    total = m.square().sum((-1, -2)).clamp_min(torch.finfo(m.dtype).tiny)
    return sym.square().sum((-1, -2)) / total, anti.square().sum((-1, -2)) / total


def psd_report(forms: Tensor, tol: float = 1e-6) -> dict:
    """Smallest eigenvalue of each symmetric part and whether all are ``>= -tol * scale``.

    ``forms (..., D, D)``; ``scale`` is the largest absolute eigenvalue, so ``tol`` is relative.
    """
    sym, _ = split_symmetric(forms.double())
    eig = torch.linalg.eigvalsh(sym)  # (..., D) ascending
    scale = eig.abs().amax().clamp_min(1e-300)
    min_eig = eig[..., 0]
    return {
        "min_eigenvalue": min_eig,
        "holds": bool((min_eig >= -tol * scale).all()),
        "max_abs_eigenvalue": float(scale),
    }


# ----------------------------------------------------------------------------- scores


@dataclass
class LayerScores:
    """Per-level scores of one layer on one sequence (single batch element)."""

    levels: list[Tensor]  # S^l (H, T_l, T_l) from the downsampled tokens
    full_res: list[Tensor]  # Sbar^l (H, T, T): level l's kernel without decimation
    level_weights: Tensor  # lambda (H, L)
    stride: int
    causal: bool

    @property
    def seq_len(self) -> int:
        return self.full_res[0].shape[-1]

    def upsampled(self, l: int) -> Tensor:
        """``A_l = U_l S^l U_l^T``: ``(H, T, T)``."""
        T, f = self.seq_len, self.stride**l
        rows = upsample_levels(self.levels[l], f, T)  # (H, T, T_l)
        return upsample_levels(rows.transpose(-1, -2), f, T).transpose(-1, -2)

    def fused(self, weights: Tensor | None = None) -> Tensor:
        lam = self.level_weights if weights is None else weights
        return sum(lam[:, l, None, None] * self.upsampled(l) for l in range(len(self.levels)))

    def admissible(self) -> Tensor:
        """``(T, T)`` bool: pairs the attention may use (lower triangle when causal)."""
        ones = torch.ones(self.seq_len, self.seq_len, dtype=torch.bool)
        return ones.tril() if self.causal else ones


def undecimated_levels(layer: HKTAttention, x: Tensor) -> list[Tensor]:
    """``[Xbar^0, ..., Xbar^{L-1}]``, each ``(B, T, D)``: the downsampling path evaluated at every
    fine position (stride 1, dilation ``s^(l-1)``), so ``Xbar^l[:, c * s^l] == X^l[:, c]``."""
    out = [x]
    for l, down in enumerate(layer.downsample, start=1):
        conv = down.conv.conv
        dilation = layer.config.stride ** (l - 1)
        pad = (down.conv.kernel_size - 1) * dilation
        h = torch.nn.functional.pad(out[-1].transpose(1, 2), (pad, 0))
        h = torch.nn.functional.conv1d(
            h, conv.weight, conv.bias, dilation=dilation, groups=conv.groups
        )
        out.append(torch.nn.functional.gelu(down.norm(h.transpose(1, 2))))
    return out


@torch.no_grad()
def layer_scores(layer: HKTAttention, x: Tensor) -> LayerScores:
    """Scores of ``layer`` on one sequence ``x (T, D)``, in the layer's dtype (use float64)."""
    x = x.to(layer.level_logits.dtype).unsqueeze(0)  # (1, T, D)
    cfg = layer.config
    H, d = cfg.n_heads, cfg.head_dim
    xs = layer.levels(x)
    xbar = undecimated_levels(layer, x)
    levels, full = [], []
    for l, (q_proj, k_proj) in enumerate(zip(layer.q_proj, layer.k_proj)):
        q = q_proj(xs[l])[0].view(-1, H, d).transpose(0, 1)  # (H, T_l, d)
        k = k_proj(xs[l])[0].view(-1, H, d).transpose(0, 1)
        levels.append(q @ k.transpose(-1, -2) / math.sqrt(d))
        qf = q_proj(xbar[l])[0].view(-1, H, d).transpose(0, 1)  # (H, T, d) undecimated
        kf = k_proj(xbar[l])[0].view(-1, H, d).transpose(0, 1)
        full.append(qf @ kf.transpose(-1, -2) / math.sqrt(d))
    return LayerScores(levels, full, layer.level_weights(), cfg.stride, cfg.causal)


def score_vectors(scores: LayerScores, head: int) -> Tensor:
    """Per-level score vectors of the admissible pairs of one head: ``(n_pairs, L)``."""
    mask = scores.admissible()
    cols = [scores.upsampled(l)[head][mask] for l in range(len(scores.levels))]
    return torch.stack(cols, dim=-1)


# ----------------------------------------------------------------------------- non-Gaussianity


@dataclass
class MardiaResult:
    n: int  # samples
    p: int  # dimension
    skewness: float  # b_{1,p}
    kurtosis: float  # b_{2,p}
    gaussian_kurtosis: float  # p (p + 2)
    kappa: float  # b_{2,p} / (p (p + 2)); 1 for a Gaussian
    z: float  # (b_{2,p} - p(p+2)) / sqrt(8 p (p+2) / n)
    skewness_statistic: float  # n b_{1,p} / 6, ~ chi2 with p(p+1)(p+2)/6 dof for a Gaussian


def mardia(samples: Tensor, max_skew_samples: int = 4000, seed: int = 0) -> MardiaResult:
    """Mardia's multivariate skewness and kurtosis of ``samples (n, p)``.

    Skewness needs all ``n^2`` pairs; above ``max_skew_samples`` it is computed on a seeded
    random subset of that size (kurtosis always uses every sample).
    """
    x = samples.double()
    if x.dim() != 2 or x.shape[0] <= x.shape[1]:
        raise ValueError(f"samples must be (n, p) with n > p, got {tuple(x.shape)}")
    n, p = x.shape
    z = x - x.mean(0)
    cov = z.T @ z / n
    inv = torch.linalg.pinv(cov, hermitian=True)
    d_diag = ((z @ inv) * z).sum(-1)  # z_a^T S^-1 z_a
    b2 = d_diag.square().mean().item()
    zs = z
    if n > max_skew_samples:
        g = torch.Generator().manual_seed(seed)
        zs = z[torch.randperm(n, generator=g)[:max_skew_samples]]
    b1 = ((zs @ inv @ zs.T) ** 3).mean().item()
    gauss = p * (p + 2)
    return MardiaResult(
        n=n,
        p=p,
        skewness=b1,
        kurtosis=b2,
        gaussian_kurtosis=float(gauss),
        kappa=b2 / gauss,
        z=(b2 - gauss) / math.sqrt(8 * gauss / n),
        skewness_statistic=len(zs) * b1 / 6,
    )


def excess_kurtosis(values: Tensor, dim: int = -1) -> Tensor:
    """Univariate excess kurtosis ``m4 / m2^2 - 3`` (biased, as ``scipy.stats.kurtosis``)."""
    v = values.double()
    c = v - v.mean(dim, keepdim=True)
    m2 = c.square().mean(dim)
    m4 = c.pow(4).mean(dim)
    return m4 / m2.square() - 3.0


def kurtosis(values: Tensor, dim: int = -1) -> Tensor:
    """Univariate (Pearson) kurtosis ``m4 / m2^2`` (biased moments; 3 for a Gaussian)."""
    return excess_kurtosis(values, dim) + 3.0


#: Every reading of the paper's score kurtosis this project measures: name -> (what it is, its
#: Gaussian value). The paper reports "kappa ~ 33 after training" (Gaussian 1); its definition
#: is not in the text we have, so each plausible population and normalisation is reported.
KURTOSIS_CANDIDATES: dict[str, tuple[str, float | None]] = {
    "levels_mardia": (
        "Mardia b2,p / p(p+2) of the per-level score vectors of the admissible pairs (p = L)",
        1.0,
    ),
    # the paper's kappa by its value: about 33 after training at T = 512 (Gaussian 15 at L = 3)
    "levels_mardia_b2": (
        "Mardia b2,p itself of the same vectors (Gaussian p(p+2), 15 at L = 3)",
        None,  # p(p+2): depends on L
    ),
    "fused_pairs": (
        "kurtosis m4/m2^2 of the fused pre-softmax scores over all admissible pairs of a head",
        3.0,
    ),
    "fused_pairs_index": ("fused_pairs / 3 (Mardia's index with p = 1)", 1.0),
    "fused_rows": (
        "kurtosis of the fused pre-softmax scores over one query's admissible keys, "
        "mean over queries",
        3.0,
    ),
    "level0_pairs": (
        "kurtosis of the level-0 (full-resolution) scores over all admissible pairs",
        3.0,
    ),
    "softmax_pairs": (
        "kurtosis of the attention weights (post-softmax) over all admissible pairs",
        3.0,
    ),
    "softmax_rows": (
        "kurtosis of the attention weights over one query's admissible keys, mean over queries",
        3.0,
    ),
}


def kurtosis_candidates(scores: list[LayerScores], min_keys: int = 8) -> dict[str, Tensor]:
    """Each univariate reading of :data:`KURTOSIS_CANDIDATES` per head, ``(H,)`` each, pooled
    over the sequences of ``scores``: pair readings pool every admissible pair of every
    sequence; row readings average over the queries with at least ``min_keys`` admissible
    keys (a causal row's first keys are too few for a fourth moment). ``levels_mardia`` is
    :func:`mardia` of :func:`score_vectors` and is computed by the caller."""
    pairs: dict[str, list[Tensor]] = {"fused_pairs": [], "level0_pairs": [], "softmax_pairs": []}
    rows: dict[str, list[Tensor]] = {"fused_rows": [], "softmax_rows": []}
    for sc in scores:
        mask = sc.admissible()
        fused = sc.fused()  # (H, T, T)
        probs = torch.softmax(fused.masked_fill(~mask, float("-inf")), dim=-1)
        pairs["fused_pairs"].append(fused[:, mask])
        pairs["level0_pairs"].append(sc.levels[0][:, mask])
        pairs["softmax_pairs"].append(probs[:, mask])
        keep = mask.sum(-1) >= min_keys  # (T,) queries with enough keys
        if not keep.any():
            continue
        # A row's masked keys are left out of its moments: mean and moments over mask only.
        for name, m in (("fused_rows", fused), ("softmax_rows", probs)):
            w = mask[keep].to(m.dtype)  # (R, T)
            x = m[:, keep]  # (H, R, T)
            n = w.sum(-1)
            mean = (x * w).sum(-1, keepdim=True) / n[:, None]
            c = (x - mean) * w
            m2 = c.square().sum(-1) / n
            m4 = c.pow(4).sum(-1) / n
            rows[name].append(m4 / m2.square())  # (H, R)
    out = {name: kurtosis(torch.cat(v, dim=-1)) for name, v in pairs.items()}
    out["fused_pairs_index"] = out["fused_pairs"] / 3.0
    for name, v in rows.items():
        if v:
            out[name] = torch.cat(v, dim=-1).nanmean(-1)
    return out


# ----------------------------------------------------------------------------- approximation error


def _block_mean(m: Tensor, factor: int) -> Tensor:
    """``P``: replace every ``factor x factor`` block (floor-indexed; ragged at the end) of the
    last two dims by its mean."""
    if factor == 1:
        return m
    T = m.shape[-1]
    idx = torch.arange(T) // factor
    nb = int(idx[-1]) + 1
    onehot = torch.zeros(T, nb, dtype=m.dtype)
    onehot[torch.arange(T), idx] = 1.0
    counts = onehot.sum(0)
    means = onehot.T @ m @ onehot / (counts[:, None] * counts[None, :])  # (..., nb, nb)
    return onehot @ means @ onehot.T


def _project_simplex(v: Tensor) -> Tensor:
    """Euclidean projection of each row of ``v`` onto the probability simplex."""
    u, _ = torch.sort(v, dim=-1, descending=True)
    css = u.cumsum(-1) - 1
    k = torch.arange(1, v.shape[-1] + 1, dtype=v.dtype)
    cond = u - css / k > 0
    rho = cond.to(torch.long).cumsum(-1).argmax(-1, keepdim=True)  # last index where True
    theta = css.gather(-1, rho) / (rho + 1).to(v.dtype)
    return (v - theta).clamp_min(0)


def _min_quadratic_on_simplex(gram: Tensor, lin: Tensor, steps: int = 2000) -> Tensor:
    """``argmin_mu mu^T G mu - 2 c^T mu`` over the simplex (projected gradient), per head."""
    H, L = lin.shape
    mu = torch.full((H, L), 1.0 / L, dtype=gram.dtype)
    lipschitz = torch.linalg.eigvalsh(gram)[..., -1].clamp_min(1e-300)  # (H,)
    step = (1.0 / (2 * lipschitz))[:, None]
    for _ in range(steps):
        grad = 2 * (torch.einsum("hab,hb->ha", gram, mu) - lin)
        mu = _project_simplex(mu - step * grad)
    return mu


@dataclass
class ApproximationError:
    """Per head (tensors of shape ``(H,)``) and the per-L curve ``(H, L)``."""

    total: Tensor  # e(lambda)
    hierarchical: Tensor
    quantisation: Tensor
    optimisation: Tensor
    best_weights: Tensor  # mu* (H, L)
    error_vs_levels: Tensor  # e_L for L = 1..L_max (H, L_max)


@torch.no_grad()
def approximation_error(scores: LayerScores) -> ApproximationError:
    """The three-term decomposition and the error against the number of levels (see module)."""
    L = len(scores.levels)
    lam = scores.level_weights  # (H, L)
    target = sum(lam[:, l, None, None] * scores.full_res[l] for l in range(L))  # (H, T, T)
    norm2 = target.square().sum((-1, -2)).clamp_min(1e-300)  # (H,)
    A = torch.stack([scores.upsampled(l) for l in range(L)], 1)  # (H, L, T, T)
    gram = torch.einsum("hatu,hbtu->hab", A, A)
    lin = torch.einsum("hatu,htu->ha", A, target)

    def err(mu: Tensor) -> Tensor:  # e(mu), (H,)
        quad = torch.einsum("ha,hab,hb->h", mu, gram, mu)
        return (quad - 2 * (mu * lin).sum(-1) + norm2) / norm2

    best = _min_quadratic_on_simplex(gram, lin)
    projected = torch.stack(
        [_block_mean(scores.full_res[l], scores.stride**l) for l in range(L)], 1
    )  # (H, L, T, T)
    ideal = (best[:, :, None, None] * projected).sum(1)
    hierarchical = (ideal - target).square().sum((-1, -2)) / norm2
    e_best, e_trained = err(best), err(lam)
    curve = []
    for n in range(1, L + 1):
        mu = _min_quadratic_on_simplex(gram[:, :n, :n], lin[:, :n])
        curve.append(err(torch.nn.functional.pad(mu, (0, L - n))))
    return ApproximationError(
        total=e_trained,
        hierarchical=hierarchical,
        quantisation=e_best - hierarchical,
        optimisation=e_trained - e_best,
        best_weights=best,
        error_vs_levels=torch.stack(curve, -1),
    )


def decay_ratios(curve: Tensor) -> Tensor:
    """``e_{L+1} / e_L`` along the last dim; all ``< rho < 1`` means geometric decay."""
    return curve[..., 1:] / curve[..., :-1].clamp_min(1e-300)


def cost_summary(n_levels: int, stride: int, seq_len: int) -> dict:
    """The paper's FLOP ratio and the executed ones, from :func:`hkt_cost`."""
    c = hkt_cost(n_levels, stride, seq_len=seq_len)
    return {
        "paper_score_ratio": c.paper_score_ratio,
        "paper_bound": c.paper_bound,
        "fast_total_ratio": c.fast_total_ratio,
        "fused_total_ratio": c.fused_total_ratio,
    }

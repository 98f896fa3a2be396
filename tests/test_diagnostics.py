"""Theory diagnostics: exact identities, PSD check, Mardia against NumPy, error decomposition."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.stats
import torch

from structattn.hkt import HKTAttention, HKTConfig
from structattn.hkt import diagnostics as dg


def _layer(seed=0, **kw):
    cfg = dict(d_model=16, n_heads=2, n_levels=3, stride=2, bias=False)
    cfg.update(kw)
    torch.manual_seed(seed)
    layer = HKTAttention(HKTConfig(**cfg)).double().eval()
    with torch.no_grad():
        layer.level_logits.normal_()
    return layer


def test_symmetric_split_reconstructs_and_is_orthogonal():
    m = torch.randn(5, 7, 7, dtype=torch.float64)
    sym, anti = dg.split_symmetric(m)
    rounding = 4 * torch.finfo(m.dtype).eps * m.abs().max().item()  # (a+b)/2 + (a-b)/2 rounds
    torch.testing.assert_close(sym + anti, m, rtol=0, atol=rounding)
    torch.testing.assert_close(sym, sym.transpose(-1, -2), rtol=0, atol=0)
    torch.testing.assert_close(anti, -anti.transpose(-1, -2), rtol=0, atol=0)
    inner = (sym * anti).sum((-1, -2))
    torch.testing.assert_close(inner, torch.zeros(5, dtype=torch.float64), rtol=0, atol=1e-12)
    r, a = dg.shares(m)
    torch.testing.assert_close(r + a, torch.ones(5, dtype=torch.float64))
    r_sym, _ = dg.shares(sym)
    torch.testing.assert_close(r_sym, torch.ones(5, dtype=torch.float64))


def test_bilinear_forms_reproduce_the_layer_scores():
    layer = _layer()
    x = torch.randn(9, 16, dtype=torch.float64)
    forms = dg.bilinear_forms(layer)  # (L, H, D, D)
    scores = dg.layer_scores(layer, x)
    xbar = dg.undecimated_levels(layer, x[None])
    for level in range(3):
        for h in range(2):
            feats = xbar[level][0]  # (T, D): level l's features at every fine position
            expected = feats @ forms[level, h] @ feats.T
            torch.testing.assert_close(scores.full_res[level][h], expected)
    torch.testing.assert_close(scores.upsampled(0), scores.levels[0])  # level 0: no resampling


def test_psd_check_accepts_psd_and_rejects_indefinite():
    a = torch.randn(3, 6, 4, dtype=torch.float64)
    psd = a @ a.transpose(-1, -2)  # rank 4 of 6: PSD with zero eigenvalues
    antisym = torch.randn(6, 6, dtype=torch.float64)
    report = dg.psd_report(psd + (antisym - antisym.T))  # an antisymmetric part does not matter
    assert report["holds"] and (report["min_eigenvalue"] > -1e-9).all()
    indefinite = torch.diag(torch.tensor([2.0, 1.0, -0.5], dtype=torch.float64))
    bad = dg.psd_report(torch.stack([torch.eye(3, dtype=torch.float64), indefinite]))
    assert not bad["holds"]
    torch.testing.assert_close(
        bad["min_eigenvalue"], torch.tensor([1.0, -0.5], dtype=torch.float64)
    )


def _mardia_numpy(x):
    n, p = x.shape
    z = x - x.mean(0)
    s = z.T @ z / n
    d = z @ np.linalg.inv(s) @ z.T
    return (d**3).sum() / n**2, (np.diag(d) ** 2).sum() / n


def test_mardia_matches_numpy():
    rng = np.random.default_rng(0)
    x = rng.standard_t(5, size=(300, 3)) @ rng.normal(size=(3, 3))
    b1, b2 = _mardia_numpy(x)
    res = dg.mardia(torch.from_numpy(x))
    assert res.skewness == pytest.approx(b1, rel=1e-9)
    assert res.kurtosis == pytest.approx(b2, rel=1e-9)
    assert res.gaussian_kurtosis == 15 and res.kappa == pytest.approx(b2 / 15)
    assert res.z == pytest.approx((b2 - 15) / np.sqrt(8 * 15 / 300))


def test_mardia_gaussian_and_heavy_tails():
    g = torch.Generator().manual_seed(1)
    gauss = dg.mardia(torch.randn(20000, 4, generator=g, dtype=torch.float64))
    assert gauss.kappa == pytest.approx(1.0, abs=0.03) and abs(gauss.z) < 4
    heavy = torch.from_numpy(np.random.default_rng(2).standard_t(3, size=(20000, 4)))
    assert dg.mardia(heavy).kappa > 1.5
    with pytest.raises(ValueError, match="n > p"):
        dg.mardia(torch.randn(3, 5))


def test_excess_kurtosis_matches_scipy():
    x = np.random.default_rng(3).laplace(size=(4, 500))
    ours = dg.excess_kurtosis(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(ours, scipy.stats.kurtosis(x, axis=-1), rtol=1e-10)


def test_block_mean_is_an_orthogonal_projection():
    m = torch.randn(2, 11, 11, dtype=torch.float64)
    p = dg._block_mean(m, 4)
    torch.testing.assert_close(dg._block_mean(p, 4), p)
    torch.testing.assert_close(
        (p * (m - p)).sum(), torch.tensor(0.0, dtype=torch.float64), rtol=0, atol=1e-10
    )
    assert torch.equal(p[:, 0, 0], p[:, 3, 2])  # one block, one value


def test_simplex_projection_and_quadratic_minimum():
    v = torch.tensor([[0.3, 2.0, -1.0], [0.2, 0.3, 0.5]], dtype=torch.float64)
    proj = dg._project_simplex(v)
    torch.testing.assert_close(proj.sum(-1), torch.ones(2, dtype=torch.float64))
    torch.testing.assert_close(proj[1], v[1])  # already on the simplex
    assert torch.equal(proj[0], torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64))
    a = torch.randn(1, 2, 5, dtype=torch.float64)
    gram, lin = a @ a.transpose(-1, -2), (a @ torch.randn(5, dtype=torch.float64))
    mu = dg._min_quadratic_on_simplex(gram, lin)
    grid = torch.linspace(0, 1, 2001, dtype=torch.float64)
    cands = torch.stack([grid, 1 - grid], -1)
    vals = torch.einsum("na,ab,nb->n", cands, gram[0], cands) - 2 * cands @ lin[0]
    best = vals.min()
    got = mu[0] @ gram[0] @ mu[0] - 2 * mu[0] @ lin[0]
    assert got <= best + 1e-9


def _held(full, f):
    """``A_l`` by hand: the full-resolution kernel at each block's first position, held."""
    idx = (torch.arange(full.shape[-1]) // f) * f
    return full[:, idx][:, :, idx]


def _block_means(full, f):
    """``P_l Sbar^l`` by hand: a loop over the (ragged) ``f x f`` blocks."""
    out, T = torch.empty_like(full), full.shape[-1]
    for i in range(0, T, f):
        for j in range(0, T, f):
            block = full[:, i : i + f, j : j + f]
            out[:, i : i + f, j : j + f] = block.mean((-1, -2), keepdim=True)
    return out


def test_approximation_terms_match_a_direct_computation():
    layer = _layer(n_levels=3)
    scores = dg.layer_scores(layer, torch.randn(37, 16, dtype=torch.float64))
    err = dg.approximation_error(scores)
    lam, full, L = scores.level_weights, scores.full_res, 3
    target = sum(lam[:, l, None, None] * full[l] for l in range(L))
    held = [_held(full[l], 2**l) for l in range(L)]

    def e(mu):  # (H, L) -> (H,): ||sum mu_l A_l - K*||^2 / ||K*||^2, summed explicitly
        approx = sum(mu[:, l, None, None] * held[l] for l in range(L))
        return (approx - target).square().sum((-1, -2)) / target.square().sum((-1, -2))

    mu = err.best_weights
    torch.testing.assert_close(err.total, e(lam))
    ideal = sum(mu[:, l, None, None] * _block_means(full[l], 2**l) for l in range(L))
    hier = (ideal - target).square().sum((-1, -2)) / target.square().sum((-1, -2))
    torch.testing.assert_close(err.hierarchical, hier)
    torch.testing.assert_close(err.quantisation, e(mu) - hier)
    torch.testing.assert_close(err.optimisation, e(lam) - e(mu))
    # mu* is the minimum over the simplex: no vertex or random point of it does better
    torch.manual_seed(0)
    points = torch.cat([torch.eye(L), torch.distributions.Dirichlet(torch.ones(L)).sample((500,))])
    for h in range(2):
        cand = points.to(torch.float64)[:, None, :].expand(-1, 2, -1)
        assert e(mu)[h] <= torch.stack([e(c)[h] for c in cand]).min() + 1e-9
    curve = err.error_vs_levels  # (H, L): e_1 is level 0 alone, e_L the full minimum
    torch.testing.assert_close(curve[:, 0], e(torch.eye(L, dtype=torch.float64)[[0, 0]]))
    torch.testing.assert_close(curve[:, -1], e(mu))
    assert (curve[:, 1:] <= curve[:, :-1] + 1e-9).all()


def test_decay_ratios_of_known_curves():
    geometric = torch.tensor([[8.0, 4.0, 2.0, 1.0], [1.0, 0.25, 0.0625, 0.015625]])
    torch.testing.assert_close(
        dg.decay_ratios(geometric), torch.tensor([[0.5, 0.5, 0.5], [0.25, 0.25, 0.25]])
    )
    exact = dg.decay_ratios(torch.tensor([0.3, 0.0, 0.0], dtype=torch.float64))
    assert exact.tolist() == [0.0, 0.0]  # an exact fit stays at ratio 0, not NaN


def test_single_level_has_no_approximation_error():
    layer = _layer(n_levels=1)
    err = dg.approximation_error(dg.layer_scores(layer, torch.randn(20, 16, dtype=torch.float64)))
    for term in (err.total, err.hierarchical, err.quantisation, err.optimisation):
        torch.testing.assert_close(term, torch.zeros(2, dtype=torch.float64), rtol=0, atol=1e-12)


def test_score_vectors_have_one_column_per_level_and_causal_pairs():
    layer = _layer()
    scores = dg.layer_scores(layer, torch.randn(10, 16, dtype=torch.float64))
    vec = dg.score_vectors(scores, head=1)
    assert vec.shape == (55, 3)  # 10 * 11 / 2 causal pairs
    torch.testing.assert_close(vec[:, 0], scores.levels[0][1][torch.ones(10, 10).tril() > 0])


def test_undecimated_levels_equal_the_downsampled_ones_on_the_coarse_grid():
    layer = _layer(n_levels=4, stride=3, downsample_kernel=4)
    x = torch.randn(2, 50, 16, dtype=torch.float64)
    decimated = layer.levels(x)
    full = dg.undecimated_levels(layer, x)
    for l in range(4):
        assert full[l].shape == x.shape
        torch.testing.assert_close(full[l][:, :: 3**l], decimated[l], rtol=1e-12, atol=1e-12)
    # so the held samples HKT uses are the full-resolution kernel at each block's first position
    scores = dg.layer_scores(layer, x[0])
    idx = (torch.arange(50) // 9) * 9
    torch.testing.assert_close(scores.upsampled(2), scores.full_res[2][:, idx][:, :, idx])


def test_kurtosis_candidates_match_a_direct_computation():
    """Each univariate reading of the paper's kappa against scipy on the same populations:
    fused pre-softmax scores and level-0 scores over the admissible pairs, attention weights
    after softmax, and the row-wise readings (one query's admissible keys, queries with at
    least ``min_keys`` of them)."""
    torch.manual_seed(0)
    layer = HKTAttention(HKTConfig(d_model=16, n_heads=2, n_levels=3, causal=True)).double()
    xs = [torch.randn(24, 16, dtype=torch.float64), torch.randn(17, 16, dtype=torch.float64)]
    scores = [dg.layer_scores(layer, x) for x in xs]
    got = dg.kurtosis_candidates(scores, min_keys=8)
    assert set(got) | {"levels_mardia", "levels_mardia_b2"} == set(dg.KURTOSIS_CANDIDATES)
    pooled = {"fused_pairs": [], "level0_pairs": [], "softmax_pairs": []}
    rows = {"fused_rows": [], "softmax_rows": []}
    for sc in scores:
        T = sc.seq_len
        fused = sc.fused().numpy()
        s0 = sc.levels[0].numpy()
        for h in range(2):
            pairs = [(i, j) for i in range(T) for j in range(i + 1)]
            f = np.array([fused[h, i, j] for i, j in pairs])
            pooled["fused_pairs"].append((h, f))
            pooled["level0_pairs"].append((h, np.array([s0[h, i, j] for i, j in pairs])))
            probs = []
            for i in range(T):
                row = fused[h, i, : i + 1]
                p = np.exp(row - row.max())
                p /= p.sum()
                probs.extend(p)
                if i + 1 >= 8:
                    rows["fused_rows"].append((h, scipy.stats.kurtosis(row, fisher=False)))
                    rows["softmax_rows"].append((h, scipy.stats.kurtosis(p, fisher=False)))
            pooled["softmax_pairs"].append((h, np.array(probs)))
    for name, items in pooled.items():
        for h in range(2):
            values = np.concatenate([v for hh, v in items if hh == h])
            want = scipy.stats.kurtosis(values, fisher=False)
            np.testing.assert_allclose(got[name][h].item(), want, rtol=1e-9)
    np.testing.assert_allclose(got["fused_pairs_index"], got["fused_pairs"] / 3)
    for name, items in rows.items():
        for h in range(2):
            want = np.mean([v for hh, v in items if hh == h])
            np.testing.assert_allclose(got[name][h].item(), want, rtol=1e-9)


def test_kurtosis_of_a_gaussian_is_three():
    x = torch.from_numpy(np.random.default_rng(4).normal(size=200000))
    assert abs(dg.kurtosis(x).item() - 3.0) < 0.05

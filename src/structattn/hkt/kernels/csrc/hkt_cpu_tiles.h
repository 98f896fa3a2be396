// Shared by the blockwise HKT CPU kernels (hkt_cpu.cpp: float32 / float64 through BLAS;
// hkt_cpu_lowp.cpp: bfloat16 / float16 through oneDNN's batch-reduce GEMM): the tile geometry,
// the coarse-level score tile, the online-softmax row pass and the work schedule.
#pragma once

#include "hkt_cpu_common.h"

namespace {

// ---- geometry -----------------------------------------------------------------------------------

struct Geom {
  int64_t B, H, T, d, dv, L, s, tile_q, tile_k;
  bool causal;
  double scale;
  std::vector<int64_t> Tl, f;  // level lengths and factors s^l

  // coarse index range of level l covering fine [a0, a1): start and count
  int64_t c0(int64_t l, int64_t a0) const { return a0 / f[l]; }
  int64_t cn(int64_t l, int64_t a0, int64_t a1) const { return (a1 - 1) / f[l] + 1 - a0 / f[l]; }
};

// A (B, H, T, x) tensor the kernel can read through its strides: each row of x values
// contiguous, rows at least x apart (any batch / head / row order, e.g. a (B, T, H, x) tensor
// seen as (B, H, T, x), which needs no copy).
bool rows_ok(const at::Tensor& x) {
  return x.dim() == 4 && (x.size(3) <= 1 || x.stride(3) == 1) && x.stride(2) >= x.size(3) &&
         x.stride(0) >= 0 && x.stride(1) >= 0;
}

// Checks every shape against (B, H, T, d) and T_l = ceil(T_{l-1} / s): the kernel indexes raw
// pointers, so a wrong shape must be an error, never an out-of-bounds read.
Geom make_geom(const std::vector<at::Tensor>& q, const std::vector<at::Tensor>& k,
               const at::Tensor& v, const at::Tensor& lam, int64_t stride, bool causal,
               double scale, int64_t tile_q, int64_t tile_k) {
  TORCH_CHECK(!q.empty() && q.size() == k.size(), "q and k need the same number of levels");
  TORCH_CHECK(v.dim() == 4 && v.device().is_cpu() && rows_ok(v),
              "v must be a CPU tensor (B, H, T, dv) with contiguous rows");
  TORCH_CHECK(stride >= 2, "stride must be >= 2");
  Geom g;
  g.B = v.size(0);
  g.H = v.size(1);
  g.T = v.size(2);
  g.dv = v.size(3);
  g.d = q[0].dim() == 4 ? q[0].size(3) : 0;
  g.L = static_cast<int64_t>(q.size());
  g.s = stride;
  g.causal = causal;
  g.scale = scale;
  int64_t f = 1, Tl = g.T;
  for (int64_t l = 0; l < g.L; ++l) {
    for (const at::Tensor* x : {&q[l], &k[l]}) {
      TORCH_CHECK(x->dim() == 4 && x->size(0) == g.B && x->size(1) == g.H && x->size(2) == Tl &&
                      x->size(3) == g.d,
                  "level ", l, " queries and keys must have shape (B, H, T_l, d) = (", g.B, ", ",
                  g.H, ", ", Tl, ", ", g.d, "), got ", x->sizes());
      TORCH_CHECK(rows_ok(*x) && x->scalar_type() == v.scalar_type(),
                  "q and k must have contiguous rows and v's dtype");
    }
    g.Tl.push_back(Tl);
    g.f.push_back(f);
    f *= stride;
    Tl = (Tl + stride - 1) / stride;
  }
  const bool reduced = v.scalar_type() == at::kBFloat16 || v.scalar_type() == at::kHalf;
  TORCH_CHECK(lam.dim() == 2 && lam.size(0) == g.H && lam.size(1) == g.L &&
                  lam.scalar_type() == (reduced ? at::kFloat : v.scalar_type()),
              "lam must be (H, L) in v's dtype (float32 for bfloat16 / float16 inputs)");
  const int64_t block = g.f[g.L - 1];
  TORCH_CHECK(tile_q > 0 && tile_k > 0 && tile_q % block == 0 && tile_k % block == 0,
              "tiles must be positive multiples of stride^(L-1) = ", block);
  g.tile_q = tile_q;
  g.tile_k = tile_k;
  return g;
}

// Rows of one head of a strided tensor: row i starts at p + i * ld.
template <typename Ptr>
struct Rows {
  Ptr p = nullptr;
  int64_t ld = 0;
  Ptr row(int64_t i) const { return p + i * ld; }
};

// 0 for a real key, -inf for a padded one; returns whether any key of the tile is padded.
template <typename T>
bool key_bias_of(const bool* km, int64_t j0, int64_t nj, T* out) {
  const T ninf = -std::numeric_limits<T>::infinity();
  bool padded = false;
  for (int64_t j = 0; j < nj; ++j) {
    const bool real = km == nullptr || km[j0 + j];
    out[j] = real ? T(0) : ninf;
    padded |= !real;
  }
  return padded;
}

// Per work item, one (query tile, key tile) pair at a time: the fine scores, the coarse scores
// C_l (scale included, lam excluded), the folded level-1 bias G_1 = sum_{l>=1} lam_l expand(C_l)
// at level-1 resolution, and the fused bias of each fine row (coarse levels plus key padding).
// Shared by the forward and the backward pass, which must see the same scores.
template <typename T>
struct CoarseTile {
  std::vector<std::vector<T>> C, G;
  std::vector<int64_t> rows, cols;
  std::vector<T> bias, key_bias;  // (tile_k,): the current row's fused bias, the key padding
  bool masked = false;  // the loaded key tile has a padded key
  int64_t nj = 0;

  explicit CoarseTile(const Geom& g)
      : C(g.L), G(g.L), rows(g.L), cols(g.L), bias(g.tile_k), key_bias(g.tile_k) {
    for (int64_t l = 1; l < g.L; ++l) {
      const int64_t r = g.tile_q / g.f[l] + 1, c = g.tile_k / g.f[l] + 1;
      C[l].resize(r * c);
      G[l].resize(r * c);
    }
  }

  // Loads the tile of queries i0:i1 and keys j0:j1: fine = scale * Q0 K0^T (row stride nj),
  // the coarse levels and the key padding. keep_raw: also keep C_l (the backward pass needs it
  // for the level-weight gradient). scores(l, r0, nr, c0, nc, alpha, out, ld_out) writes
  // out = alpha * Q_l[r0 : r0 + nr] K_l[c0 : c0 + nc]^T (the kernel's GEMM).
  template <typename Scores>
  void load(const Geom& g, const Scores& scores, const T* lam_h, const bool* km, int64_t i0,
            int64_t i1, int64_t j0, int64_t j1, bool keep_raw, T* fine) {
    nj = j1 - j0;
    scores(int64_t(0), i0, i1 - i0, j0, nj, static_cast<T>(g.scale), fine, nj);
    fold_coarse(g, scores, lam_h, i0, i1, j0, j1, keep_raw, bias.data());
    masked = key_bias_of(km, j0, nj, key_bias.data());  // tiles without padding skip the add
  }

  // The fused bias of fine row i of the loaded tile; rows are visited in order.
  const T* row_bias(const Geom& g, int64_t i) {
    if (g.L == 1 ? i == 0 : i % g.s == 0) expand_row(g, i / g.s);
    return bias.data();
  }

 private:
  template <typename Scores>
  void fold_coarse(const Geom& g, const Scores& scores, const T* lam_h, int64_t i0, int64_t i1,
                   int64_t j0, int64_t j1, bool keep_raw, T* rowbuf) {
    for (int64_t l = g.L - 1; l >= 1; --l) {
      const int64_t ci0 = g.c0(l, i0), cj0 = g.c0(l, j0);
      const int64_t nr = g.cn(l, i0, i1), nc = g.cn(l, j0, j1);
      rows[l] = nr;
      cols[l] = nc;
      const T w = lam_h[l];
      T* Gl = G[l].data();
      if (keep_raw) {
        scores(l, ci0, nr, cj0, nc, static_cast<T>(g.scale), C[l].data(), nc);
        const T* Cl = C[l].data();
        for (int64_t a = 0; a < nr * nc; ++a) Gl[a] = w * Cl[a];
      } else {
        scores(l, ci0, nr, cj0, nc, w * static_cast<T>(g.scale), Gl, nc);
      }
      if (l < g.L - 1) {  // add the coarser levels, already folded into G_{l+1}
        const T* Gu = G[l + 1].data();
        const int64_t ncu = cols[l + 1];
        for (int64_t a = 0; a < nr; ++a) {
          if (a % g.s == 0) expand_cols<T>(rowbuf, Gu + (a / g.s) * ncu, nc, g.s);
          add_to<T>(Gl + a * nc, rowbuf, nc);
        }
      }
    }
  }

  // bias[j] = G_1[a, j / s] + key_bias[j], the fused bias of every fine row in level-1 row a.
  void expand_row(const Geom& g, int64_t a) {
    if (g.L == 1) {
      if (masked) std::copy(key_bias.begin(), key_bias.begin() + nj, bias.begin());
      else std::fill(bias.begin(), bias.begin() + nj, T(0));
      return;
    }
    expand_cols<T>(bias.data(), G[1].data() + a * cols[1], nj, g.s);
    if (masked) add_to<T>(bias.data(), key_bias.data(), nj);
  }
};

// An uninitialised (B, H, T, x) tensor shaped like v, laid out as (B, T, H, x) when v's heads
// are (a view of a projection's (B, T, H * x) output, whose rows need not be dense): the
// caller's transpose back to (B, T, H * x) is then a view, not a copy. Dense v keeps its own.
inline at::Tensor empty_heads_like(const at::Tensor& v) {
  if (v.is_non_overlapping_and_dense() || v.size(1) <= 1 || v.stride(1) >= v.stride(2))
    return at::empty_like(v);
  return at::empty({v.size(0), v.size(2), v.size(1), v.size(3)}, v.options()).transpose(1, 2);
}

// Head (b, h) of a (B, H, T, x) tensor: its first row and the distance between rows.
template <typename T, typename Ptr = const T*>
Rows<Ptr> head_rows(const at::Tensor& x, int64_t b, int64_t h) {
  return {x.data_ptr<T>() + b * x.stride(0) + h * x.stride(1), x.stride(2)};
}

// Head bh (of B*H) of each level's (B, H, T_l, d) tensor.
template <typename T, typename Ptr = const T*>
std::vector<Rows<Ptr>> head_levels(const Geom& g, const std::vector<at::Tensor>& xs, int64_t bh) {
  std::vector<Rows<Ptr>> p(g.L);
  for (int64_t l = 0; l < g.L; ++l) p[l] = head_rows<T, Ptr>(xs[l], bh / g.H, bh % g.H);
  return p;
}

// Number of admissible columns of fine row i (absolute) in the key tile starting at j0.
inline int64_t row_limit(const Geom& g, int64_t i, int64_t j0, int64_t nj) {
  if (!g.causal) return nj;
  return std::max<int64_t>(0, std::min<int64_t>(nj, i - j0 + 1));
}

struct NoGuard {};

// Runs fn(item) for items in `order` on all threads, taking them one by one (dynamic schedule).
// Each worker holds a Guard while it runs (the reduced-precision kernel's releases the GEMM's
// hardware context when the worker is done, also when fn throws).
template <typename Guard = NoGuard, typename Fn>
void run_dynamic(const std::vector<int64_t>& order, const Fn& fn) {
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(order.size());
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    [[maybe_unused]] Guard guard{};
    for (int64_t w = next++; w < n; w = next++) fn(order[w]);
  });
}

// The forward pass's work items, bh * n_query_tiles + t: the latest (causal: largest) query
// tiles first, so that the dynamic schedule ends balanced.
inline std::vector<int64_t> query_tile_order(const Geom& g) {
  const int64_t n_qt = (g.T + g.tile_q - 1) / g.tile_q;
  std::vector<int64_t> order;
  for (int64_t t = n_qt - 1; t >= 0; --t)
    for (int64_t bh = 0; bh < g.B * g.H; ++bh) order.push_back(bh * n_qt + t);
  return order;
}

// The backward pass's work items: one per head, 0 .. B*H - 1.
inline std::vector<int64_t> head_order(const Geom& g) {
  std::vector<int64_t> order(g.B * g.H);
  for (int64_t i = 0; i < g.B * g.H; ++i) order[i] = i;
  return order;
}

// The backward pass's own inputs: out and dout of v's shape and dtype with contiguous rows, the
// log-sum-exp a contiguous (B, H, T) tensor of lse_dtype.
inline void check_backward_inputs(const Geom& g, const at::Tensor& v, const at::Tensor& out,
                                  const at::Tensor& dout, const at::Tensor& lse,
                                  at::ScalarType lse_dtype) {
  TORCH_CHECK(out.sizes() == v.sizes() && dout.sizes() == v.sizes() && rows_ok(out) &&
                  rows_ok(dout) && out.scalar_type() == v.scalar_type() &&
                  dout.scalar_type() == v.scalar_type(),
              "out and dout must have v's shape and dtype and contiguous rows");
  TORCH_CHECK(lse.dim() == 3 && lse.size(0) == g.B && lse.size(1) == g.H && lse.size(2) == g.T &&
                  lse.is_contiguous() && lse.scalar_type() == lse_dtype,
              "lse must be a contiguous (B, H, T) tensor of dtype ", lse_dtype);
}

// The backward pass's result: (*dq, *dk, dv, dlam) with dlam summed over the batch.
inline std::vector<at::Tensor> gradient_list(const std::vector<at::Tensor>& dq,
                                             const std::vector<at::Tensor>& dk,
                                             const at::Tensor& dv, const at::Tensor& dlam_bh) {
  std::vector<at::Tensor> grads = dq;
  grads.insert(grads.end(), dk.begin(), dk.end());
  grads.push_back(dv);
  grads.push_back(dlam_bh.sum(0));
  return grads;
}


// ---- backward ----------------------------------------------------------------------------

// dst (nr_dst x nc_dst) = sums of src (nr x nc) over s x s blocks (ragged at the far edges):
// the rows of a block are added first (vectorised), then the column groups once per block.
template <typename T>
void block_sum(const T* src, int64_t nr, int64_t nc, int64_t s, T* dst, int64_t nc_dst,
               int64_t nr_dst, T* rowbuf) {
  std::fill(dst, dst + nr_dst * nc_dst, T(0));
  for (int64_t a0 = 0; a0 < nr; a0 += s) {
    const int64_t a1 = std::min(a0 + s, nr);
    std::copy(src + a0 * nc, src + a0 * nc + nc, rowbuf);
    for (int64_t a = a0 + 1; a < a1; ++a) add_to<T>(rowbuf, src + a * nc, nc);
    add_groups<T>(dst + (a0 / s) * nc_dst, rowbuf, nc, s);
  }
}

const bool* mask_ptr(const std::optional<at::Tensor>& key_mask, const Geom& g) {
  if (!key_mask.has_value()) return nullptr;
  const at::Tensor& m = *key_mask;
  TORCH_CHECK(m.scalar_type() == at::kBool && m.is_contiguous() && m.dim() == 2 &&
                  m.size(0) == g.B && m.size(1) == g.T,
              "key_mask must be a contiguous bool (B, T) tensor");
  return m.data_ptr<bool>();
}

// Scores of one head through the BLAS GEMM (float32 / float64 kernels): Q_l, K_l rows.
template <typename T>
struct BlasScores {
  const std::vector<Rows<const T*>>& Q;
  const std::vector<Rows<const T*>>& K;
  int64_t d;
  void operator()(int64_t l, int64_t r0, int64_t nr, int64_t c0, int64_t nc, T alpha, T* out,
                  int64_t ld) const {
    mm<T>(false, true, nr, nc, d, alpha, Q[l].row(r0), Q[l].ld, K[l].row(c0), K[l].ld, T(0),
          out, ld);
  }
};

// The online-softmax pass over the rows of a loaded tile (queries i0 : i0 + ni, keys
// j0 : j0 + nj): S holds the fine scores (row stride nj) and leaves holding the unnormalised
// probabilities (0 past each row's causal limit); the running maxima m, denominators den and
// accumulated outputs acc (ni x dv, rescaled) are updated. w0: the weight of the fine scores.
template <typename T>
void softmax_rows(const Geom& g, CoarseTile<T>& ct, T w0, int64_t i0, int64_t ni, int64_t j0,
                  int64_t nj, T* S, T* m, T* den, T* acc) {
  const T inf = std::numeric_limits<T>::infinity();
  for (int64_t i = 0; i < ni; ++i) {
    const T* e = ct.row_bias(g, i);
    T* row = S + i * nj;
    const int64_t lim = row_limit(g, i0 + i, j0, nj);
    const T rmax = axpy_max<T>(row, e, lim, w0);
    const T m_new = std::max(m[i], rmax);
    if (m_new == -inf) {  // nothing admissible yet in this row
      std::fill(row, row + nj, T(0));
      continue;
    }
    const T sum = exp_sum<T>(row, lim, m_new);
    std::fill(row + lim, row + nj, T(0));
    const T corr = std::exp(m[i] - m_new);
    den[i] = den[i] * corr + sum;
    if (corr != T(1)) {
      T* a = acc + i * g.dv;
      for (int64_t c = 0; c < g.dv; ++c) a[c] *= corr;
    }
    m[i] = m_new;
  }
}

// The outputs of query rows i0 : i0 + ni from their accumulators: out = acc / den and the
// log-sum-exp (+inf and zero outputs for a row without an admissible key, so that the
// recomputed probabilities are 0).
template <typename T, typename O>
void write_rows(const Geom& g, const Rows<O*>& Oh, int64_t i0, int64_t ni, const T* m,
                const T* den, const T* acc, T* lse_row) {
  for (int64_t i = 0; i < ni; ++i) {
    O* o = Oh.row(i0 + i);
    if (den[i] > T(0)) {
      const T r = T(1) / den[i];
      for (int64_t c = 0; c < g.dv; ++c) o[c] = static_cast<O>(acc[i * g.dv + c] * r);
      lse_row[i] = m[i] + std::log(den[i]);
    } else {
      std::fill(o, o + g.dv, O(0));
      lse_row[i] = std::numeric_limits<T>::infinity();
    }
  }
}

// The probabilities of a loaded tile recomputed from the saved log-sum-exp (backward pass):
// P = exp(w0 F + bias - lse), 0 past each row's causal limit.
template <typename T>
void recompute_rows(const Geom& g, CoarseTile<T>& ct, T w0, const T* LSE, int64_t i0, int64_t ni,
                    int64_t j0, int64_t nj, const T* F, T* P) {
  for (int64_t i = 0; i < ni; ++i) {
    const T* e = ct.row_bias(g, i);
    const int64_t lim = row_limit(g, i0 + i, j0, nj);
    T* p = P + i * nj;
    exp_affine<T>(p, F + i * nj, e, lim, w0, LSE[i0 + i]);
    std::fill(p + lim, p + nj, T(0));
  }
}

// Rows o : o + ni of dS = P (dP - delta) in place over dP; returns sum dS * F (the fine level
// weight's gradient before its scale).
template <typename T>
double ds_rows(T* dS, const T* P, const T* F, const T* delta, int64_t ni, int64_t nj) {
  double acc = 0.0;
  for (int64_t i = 0; i < ni; ++i) {
    const int64_t o = i * nj;
    acc += ds_dot<T>(dS + o, P + o, F + o, nj, delta[i]);
  }
  return acc;
}

// The coarse levels' score gradients of a tile: D_l = nested s x s block sums of dS (ni x nj),
// and each level weight's gradient sum D_l * C_l (before its scale) added to dlam_acc[l].
template <typename T>
void coarse_grads(const Geom& g, const CoarseTile<T>& ct, const T* dS, int64_t ni, int64_t nj,
                  std::vector<std::vector<T>>& D, T* rowbuf, std::vector<double>& dlam_acc) {
  for (int64_t l = 1; l < g.L; ++l) {
    const int64_t nr = ct.rows[l], nc = ct.cols[l];
    if (l == 1) {
      block_sum<T>(dS, ni, nj, g.s, D[1].data(), nc, nr, rowbuf);
    } else {
      block_sum<T>(D[l - 1].data(), ct.rows[l - 1], ct.cols[l - 1], g.s, D[l].data(), nc, nr,
                   rowbuf);
    }
    double dl = 0.0;  // per-row dot products (vectorised), summed in double
    const T* Dl = D[l].data();
    const T* Cl = ct.C[l].data();
    for (int64_t a = 0; a < nr; ++a) dl += dot<T>(Dl + a * nc, Cl + a * nc, nc);
    dlam_acc[l] += dl;
  }
}

}  // namespace

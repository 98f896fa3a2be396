// HKT attention on the CPU: blockwise online softmax with OpenMP (through at::parallel_for).
//
// Same mathematics as structattn/hkt/fused.py (the readable PyTorch tile loop), written so that
// the extra work over standard flash attention is small:
//   * the fine scores Q0 K0^T and A V are single-threaded BLAS calls per tile (the GEMM that
//     PyTorch's own CPU flash attention uses), so the FLOPs are those of standard attention;
//   * each coarse level's scores are one small GEMM per tile at coarse resolution (a 1/s^(2l)
//     share); the levels are folded coarse-to-fine into one level-1 bias (G_l = lam_l C_l +
//     expand(G_{l+1})), expanded once per level-1 row and added while taking the row maximum,
//     so L only costs one extra pass over the tile, whatever L is;
//   * key padding is folded into that bias (-inf), causality into the row length;
//   * backward recomputes each tile from the saved log-sum-exp; coarse score gradients are
//     nested block sums of the fine score gradient.
//
// Shapes: q[l], k[l] (B, H, T_l, d) contiguous; v (B, H, T, dv); lam (H, L); key_mask (B, T)
// bool (True = real token). Tiles are multiples of s^(L-1), so a coarse block never straddles
// two tiles. float32 is vectorised (ATen's AVX-512 or AVX2 vectors, whichever the compiler
// targets); float64 is scalar.
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
  TORCH_CHECK(lam.dim() == 2 && lam.size(0) == g.H && lam.size(1) == g.L &&
                  lam.scalar_type() == v.scalar_type(),
              "lam must be (H, L) in v's dtype");
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
  // for the level-weight gradient).
  void load(const Geom& g, const std::vector<Rows<const T*>>& Q,
            const std::vector<Rows<const T*>>& K,
            const T* lam_h, const bool* km, int64_t i0, int64_t i1, int64_t j0, int64_t j1,
            bool keep_raw, T* fine) {
    nj = j1 - j0;
    mm<T>(false, true, i1 - i0, nj, g.d, static_cast<T>(g.scale), Q[0].row(i0), Q[0].ld,
          K[0].row(j0), K[0].ld, T(0), fine, nj);
    fold_coarse(g, Q, K, lam_h, i0, i1, j0, j1, keep_raw, bias.data());
    masked = key_bias_of(km, j0, nj, key_bias.data());  // tiles without padding skip the add
  }

  // The fused bias of fine row i of the loaded tile; rows are visited in order.
  const T* row_bias(const Geom& g, int64_t i) {
    if (g.L == 1 ? i == 0 : i % g.s == 0) expand_row(g, i / g.s);
    return bias.data();
  }

 private:
  void fold_coarse(const Geom& g, const std::vector<Rows<const T*>>& Q,
                   const std::vector<Rows<const T*>>& K,
                   const T* lam_h, int64_t i0, int64_t i1, int64_t j0, int64_t j1, bool keep_raw,
                   T* rowbuf) {
    for (int64_t l = g.L - 1; l >= 1; --l) {
      const int64_t ci0 = g.c0(l, i0), cj0 = g.c0(l, j0);
      const int64_t nr = g.cn(l, i0, i1), nc = g.cn(l, j0, j1);
      rows[l] = nr;
      cols[l] = nc;
      const T w = lam_h[l];
      T* Gl = G[l].data();
      if (keep_raw) {
        mm<T>(false, true, nr, nc, g.d, static_cast<T>(g.scale), Q[l].row(ci0), Q[l].ld,
              K[l].row(cj0), K[l].ld, T(0), C[l].data(), nc);
        const T* Cl = C[l].data();
        for (int64_t a = 0; a < nr * nc; ++a) Gl[a] = w * Cl[a];
      } else {
        mm<T>(false, true, nr, nc, g.d, w * static_cast<T>(g.scale), Q[l].row(ci0), Q[l].ld,
              K[l].row(cj0), K[l].ld, T(0), Gl, nc);
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

// Runs fn(item) for items in `order` on all threads, taking them one by one (dynamic schedule).
template <typename Fn>
void run_dynamic(const std::vector<int64_t>& order, const Fn& fn) {
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(order.size());
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t w = next++; w < n; w = next++) fn(order[w]);
  });
}

// ---- forward -----------------------------------------------------------------------------

template <typename T>
void forward_impl(const Geom& g, const std::vector<at::Tensor>& q,
                  const std::vector<at::Tensor>& k, const at::Tensor& v, const at::Tensor& lam,
                  const bool* km, at::Tensor& out, at::Tensor& lse) {
  const int64_t n_qt = (g.T + g.tile_q - 1) / g.tile_q;
  // largest (causal: latest) query tiles first, so the dynamic schedule ends balanced
  std::vector<int64_t> order;
  for (int64_t t = n_qt - 1; t >= 0; --t)
    for (int64_t bh = 0; bh < g.B * g.H; ++bh) order.push_back(bh * n_qt + t);

  const T* lam_p = lam.data_ptr<T>();
  T* lse_p = lse.data_ptr<T>();
  const T inf = std::numeric_limits<T>::infinity();

  run_dynamic(order, [&](int64_t item) {
    const int64_t bh = item / n_qt, t = item % n_qt;
    const int64_t b = bh / g.H, h = bh % g.H;
    const int64_t i0 = t * g.tile_q, i1 = std::min(i0 + g.tile_q, g.T), ni = i1 - i0;
    const auto Q = head_levels<T>(g, q, bh), K = head_levels<T>(g, k, bh);
    const auto V = head_rows<T>(v, b, h);
    const bool* kmb = km == nullptr ? nullptr : km + b * g.T;
    const T* lam_h = lam_p + h * g.L;

    CoarseTile<T> ct(g);
    std::vector<T> S(g.tile_q * g.tile_k);
    std::vector<T> m(ni, -inf), den(ni, T(0)), acc(ni * g.dv, T(0));

    const int64_t jend = g.causal ? i1 : g.T;
    for (int64_t j0 = 0; j0 < jend; j0 += g.tile_k) {
      const int64_t j1 = std::min(j0 + g.tile_k, g.T), nj = j1 - j0;
      ct.load(g, Q, K, lam_h, kmb, i0, i1, j0, j1, false, S.data());
      for (int64_t i = 0; i < ni; ++i) {
        const T* e = ct.row_bias(g, i);
        T* row = S.data() + i * nj;
        const int64_t lim = row_limit(g, i0 + i, j0, nj);
        const T rmax = axpy_max<T>(row, e, lim, lam_h[0]);
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
          T* a = acc.data() + i * g.dv;
          for (int64_t c = 0; c < g.dv; ++c) a[c] *= corr;
        }
        m[i] = m_new;
      }
      mm<T>(false, false, ni, g.dv, nj, T(1), S.data(), nj, V.row(j0), V.ld, T(1), acc.data(),
            g.dv);
    }
    const auto Oh = head_rows<T, T*>(out, b, h);
    T* lse_row = lse_p + bh * g.T + i0;
    for (int64_t i = 0; i < ni; ++i) {
      if (den[i] > T(0)) {
        const T r = T(1) / den[i];
        T* o = Oh.row(i0 + i);
        for (int64_t c = 0; c < g.dv; ++c) o[c] = acc[i * g.dv + c] * r;
        lse_row[i] = m[i] + std::log(den[i]);
      } else {  // no admissible key: output 0, +inf makes the recomputed probabilities 0
        std::fill(Oh.row(i0 + i), Oh.row(i0 + i) + g.dv, T(0));
        lse_row[i] = inf;
      }
    }
  });
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

template <typename T>
void backward_impl(const Geom& g, const std::vector<at::Tensor>& q,
                   const std::vector<at::Tensor>& k, const at::Tensor& v, const at::Tensor& lam,
                   const bool* km, const at::Tensor& out, const at::Tensor& lse,
                   const at::Tensor& dout, std::vector<at::Tensor>& dq,
                   std::vector<at::Tensor>& dk, at::Tensor& dv, at::Tensor& dlam_bh) {
  std::vector<int64_t> order(g.B * g.H);
  for (int64_t i = 0; i < g.B * g.H; ++i) order[i] = i;
  const T* lam_p = lam.data_ptr<T>();

  run_dynamic(order, [&](int64_t bh) {
    const int64_t b = bh / g.H, h = bh % g.H;
    const auto Q = head_levels<T>(g, q, bh), K = head_levels<T>(g, k, bh);
    const auto dQ = head_levels<T, T*>(g, dq, bh), dK = head_levels<T, T*>(g, dk, bh);
    const auto V = head_rows<T>(v, b, h), O = head_rows<T>(out, b, h);
    const auto dO = head_rows<T>(dout, b, h);
    const T* LSE = lse.data_ptr<T>() + bh * g.T;
    const auto dV = head_rows<T, T*>(dv, b, h);
    T* dlam = dlam_bh.data_ptr<T>() + bh * g.L;
    const bool* kmb = km == nullptr ? nullptr : km + b * g.T;
    const T* lam_h = lam_p + h * g.L;
    const T lam0 = lam_h[0];

    std::vector<T> delta(g.T);
    for (int64_t i = 0; i < g.T; ++i) delta[i] = dot<T>(dO.row(i), O.row(i), g.dv);
    CoarseTile<T> ct(g);
    std::vector<std::vector<T>> D(g.L);
    for (int64_t l = 1; l < g.L; ++l) D[l].resize(ct.C[l].size());
    std::vector<T> F(g.tile_q * g.tile_k), P(g.tile_q * g.tile_k), dS(g.tile_q * g.tile_k);
    std::vector<T> rowbuf(g.tile_k);
    std::vector<double> dlam_acc(g.L, 0.0);

    for (int64_t i0 = 0; i0 < g.T; i0 += g.tile_q) {
      const int64_t i1 = std::min(i0 + g.tile_q, g.T), ni = i1 - i0;
      const int64_t jend = g.causal ? i1 : g.T;
      for (int64_t j0 = 0; j0 < jend; j0 += g.tile_k) {
        const int64_t j1 = std::min(j0 + g.tile_k, g.T), nj = j1 - j0;
        // recompute the probabilities of the tile from the saved log-sum-exp
        ct.load(g, Q, K, lam_h, kmb, i0, i1, j0, j1, true, F.data());
        for (int64_t i = 0; i < ni; ++i) {
          const T* e = ct.row_bias(g, i);
          const int64_t lim = row_limit(g, i0 + i, j0, nj);
          T* p = P.data() + i * nj;
          exp_affine<T>(p, F.data() + i * nj, e, lim, lam0, LSE[i0 + i]);
          std::fill(p + lim, p + nj, T(0));
        }
        // dV += P^T dO;  dP = dO V^T
        mm<T>(true, false, nj, g.dv, ni, T(1), P.data(), nj, dO.row(i0), dO.ld, T(1),
              dV.row(j0), dV.ld);
        mm<T>(false, true, ni, nj, g.dv, T(1), dO.row(i0), dO.ld, V.row(j0), V.ld, T(0),
              dS.data(), nj);
        // dS = P (dP - delta): the gradient of the fused score
        double dl0 = 0.0;
        for (int64_t i = 0; i < ni; ++i) {
          const int64_t o = i * nj;
          dl0 += ds_dot<T>(dS.data() + o, P.data() + o, F.data() + o, nj, delta[i0 + i]);
        }
        dlam_acc[0] += dl0;
        const T w0 = lam0 * static_cast<T>(g.scale);
        mm<T>(false, false, ni, g.d, nj, w0, dS.data(), nj, K[0].row(j0), K[0].ld, T(1),
              dQ[0].row(i0), dQ[0].ld);
        mm<T>(true, false, nj, g.d, ni, w0, dS.data(), nj, Q[0].row(i0), Q[0].ld, T(1),
              dK[0].row(j0), dK[0].ld);
        // coarse levels: nested block sums of dS
        for (int64_t l = 1; l < g.L; ++l) {
          const int64_t nr = ct.rows[l], nc = ct.cols[l];
          if (l == 1) {
            block_sum<T>(dS.data(), ni, nj, g.s, D[1].data(), nc, nr, rowbuf.data());
          } else {
            block_sum<T>(D[l - 1].data(), ct.rows[l - 1], ct.cols[l - 1], g.s, D[l].data(), nc,
                         nr, rowbuf.data());
          }
          double dl = 0.0;  // per-row dot products (vectorised), summed in double
          const T* Dl = D[l].data();
          const T* Cl = ct.C[l].data();
          for (int64_t a = 0; a < nr; ++a) dl += dot<T>(Dl + a * nc, Cl + a * nc, nc);
          dlam_acc[l] += dl;
          const T wl = lam_h[l] * static_cast<T>(g.scale);
          const int64_t ci0 = g.c0(l, i0), cj0 = g.c0(l, j0);
          mm<T>(false, false, nr, g.d, nc, wl, Dl, nc, K[l].row(cj0), K[l].ld, T(1),
                dQ[l].row(ci0), dQ[l].ld);
          mm<T>(true, false, nc, g.d, nr, wl, Dl, nc, Q[l].row(ci0), Q[l].ld, T(1),
                dK[l].row(cj0), dK[l].ld);
        }
      }
    }
    for (int64_t l = 0; l < g.L; ++l) dlam[l] = static_cast<T>(dlam_acc[l]);
  });
}

const bool* mask_ptr(const std::optional<at::Tensor>& key_mask, const Geom& g) {
  if (!key_mask.has_value()) return nullptr;
  const at::Tensor& m = *key_mask;
  TORCH_CHECK(m.scalar_type() == at::kBool && m.is_contiguous() && m.dim() == 2 &&
                  m.size(0) == g.B && m.size(1) == g.T,
              "key_mask must be a contiguous bool (B, T) tensor");
  return m.data_ptr<bool>();
}

}  // namespace

std::vector<at::Tensor> hkt_forward(std::vector<at::Tensor> q, std::vector<at::Tensor> k,
                                    at::Tensor v, at::Tensor lam,
                                    std::optional<at::Tensor> key_mask, bool causal,
                                    int64_t stride, double scale, int64_t tile_q,
                                    int64_t tile_k) {
  const Geom g = make_geom(q, k, v, lam, stride, causal, scale, tile_q, tile_k);
  const bool* km = mask_ptr(key_mask, g);
  at::Tensor out = at::empty_like(v);  // v's memory layout: a (B, T, H, dv) v gives one too
  at::Tensor lse = at::empty({g.B, g.H, g.T}, v.options());
  AT_DISPATCH_FLOATING_TYPES(v.scalar_type(), "hkt_forward", [&] {
    forward_impl<scalar_t>(g, q, k, v, lam.contiguous(), km, out, lse);
  });
  return {out, lse};
}

std::vector<at::Tensor> hkt_backward(std::vector<at::Tensor> q, std::vector<at::Tensor> k,
                                     at::Tensor v, at::Tensor lam,
                                     std::optional<at::Tensor> key_mask, bool causal,
                                     int64_t stride, double scale, int64_t tile_q,
                                     int64_t tile_k, at::Tensor out, at::Tensor lse,
                                     at::Tensor dout) {
  const Geom g = make_geom(q, k, v, lam, stride, causal, scale, tile_q, tile_k);
  TORCH_CHECK(out.sizes() == v.sizes() && dout.sizes() == v.sizes() && rows_ok(out) &&
                  rows_ok(dout) && out.scalar_type() == v.scalar_type() &&
                  dout.scalar_type() == v.scalar_type(),
              "out and dout must have v's shape and dtype and contiguous rows");
  TORCH_CHECK(lse.dim() == 3 && lse.size(0) == g.B && lse.size(1) == g.H && lse.size(2) == g.T &&
                  lse.is_contiguous() && lse.scalar_type() == v.scalar_type(),
              "lse must be a contiguous (B, H, T) tensor of v's dtype");
  const bool* km = mask_ptr(key_mask, g);
  std::vector<at::Tensor> dq, dk;
  for (int64_t l = 0; l < g.L; ++l) {
    dq.push_back(at::zeros_like(q[l]));
    dk.push_back(at::zeros_like(k[l]));
  }
  at::Tensor dv = at::zeros_like(v);
  at::Tensor dlam_bh = at::zeros({g.B, g.H, g.L}, v.options());
  AT_DISPATCH_FLOATING_TYPES(v.scalar_type(), "hkt_backward", [&] {
    backward_impl<scalar_t>(g, q, k, v, lam.contiguous(), km, out, lse, dout, dq, dk, dv,
                            dlam_bh);
  });
  std::vector<at::Tensor> grads = dq;
  grads.insert(grads.end(), dk.begin(), dk.end());
  grads.push_back(dv);
  grads.push_back(dlam_bh.sum(0));
  return grads;
}

// csrc/hkt_decode.cpp
std::vector<at::Tensor> hkt_decode_step(
    const at::Tensor& x, const at::Tensor& qkv, int64_t pos, int64_t T0, int64_t s,
    const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& queries,
    const std::vector<at::Tensor>& windows, const at::Tensor& values,
    const at::Tensor& conv_window, const std::vector<at::Tensor>& scores,
    const std::vector<at::Tensor>& coarse_w, const std::vector<at::Tensor>& coarse_b,
    const std::vector<at::Tensor>& down_w, const std::vector<at::Tensor>& down_b,
    const std::vector<at::Tensor>& ln_w, const std::vector<at::Tensor>& ln_b,
    const std::vector<double>& ln_eps, const at::Tensor& lam, const at::Tensor& beta,
    const at::Tensor& conv_w, const at::Tensor& conv_b);

// csrc/hkt_conv.cpp
at::Tensor causal_dwconv_forward(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                                 int64_t s);
std::vector<at::Tensor> causal_dwconv_backward(const at::Tensor& x, const at::Tensor& w,
                                               const at::Tensor& gy, int64_t s);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "HKT attention CPU kernel (blockwise online softmax, OpenMP)";
  m.def("forward", &hkt_forward, "HKT attention forward: returns (out, lse)");
  m.def("backward", &hkt_backward,
        "HKT attention backward: returns (*dq, *dk, dv, dlam)");
  m.def("decode_step", &hkt_decode_step,
        "one causal HKT decoding step, every sequence at the same position");
  m.def("causal_dwconv_forward", &causal_dwconv_forward,
        "causal depthwise convolution over time, (B, T, D) -> (B, ceil(T / s), D)");
  m.def("causal_dwconv_backward", &causal_dwconv_backward,
        "its backward: returns (grad_x, grad_w (D, k), grad_bias (D,))");
}

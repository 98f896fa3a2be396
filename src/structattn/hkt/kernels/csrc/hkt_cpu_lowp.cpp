// HKT attention on the CPU in bfloat16 / float16: the blockwise kernel of hkt_cpu.cpp with its
// tile GEMMs on oneDNN's batch-reduce GEMM (ATen's cpublas::brgemm: AMX tiles where the CPU has
// them, AVX-512 BF16 dot products otherwise; float16 only on AMX-FP16, the one float16 route
// that reads the VNNI-2 layout below), reduced-precision inputs and outputs, and float32
// accumulation, softmax, log-sum-exp and gradient accumulators.
//
// The GEMM's B operand is packed in the VNNI-2 layout (pairs of K rows interleaved), in column
// blocks of at most 64 (what AMX's packed B takes); K is padded to an even length with zeros.
// Packed once per head: K_l^T and V^T of every key tile (scores, dP), K_l and V's rows (dQ, the
// forward's P V); per query tile: Q_l^T and dO^T (dK^T, dV^T are accumulated transposed, so that
// P and dS are packed as B once instead of being transposed). The coarse levels, the key padding
// and causality are handled exactly as in the float32 kernel (CoarseTile, shared).
#include "hkt_cpu_tiles.h"

#include <ATen/native/CPUBlas.h>

#include <type_traits>

namespace {

constexpr int64_t NB = 64;  // column block of a packed B

inline int64_t even(int64_t x) { return (x + 1) / 2 * 2; }
inline int64_t up16(int64_t x) { return (x + 15) / 16 * 16; }

// Elements of a packed K x N matrix: ceil(N / NB) blocks of even(K) x NB.
inline int64_t packed_size(int64_t K, int64_t N) { return (N + NB - 1) / NB * even(K) * NB; }

// out[j] = alpha * in[j] in S, for j < n (vectorised, round to nearest even).
template <typename S>
inline void cvt_row(const float* in, int64_t n, float alpha, S* out) {
  const int64_t V = fVec::size();
  const fVec va(alpha);
  int64_t j = 0;
  for (; j + 2 * V <= n; j += 2 * V) {
    at::vec::convert_from_float<S>(fVec::loadu(in + j) * va, fVec::loadu(in + j + V) * va)
        .store(out + j);
  }
  for (; j < n; ++j) out[j] = static_cast<S>(alpha * in[j]);
}

// out[2 j] = alpha a[j], out[2 j + 1] = alpha b[j] in S, for j < n: one VNNI-2 row pair.
template <typename S>
inline void cvt_pair(const float* a, const float* b, int64_t n, float alpha, S* out) {
  const int64_t V = fVec::size();
  const fVec va(alpha);
  int64_t j = 0;
  for (; j + V <= n; j += V) {
    const auto ab = at::vec::interleave2<float>(fVec::loadu(a + j) * va, fVec::loadu(b + j) * va);
    at::vec::convert_from_float<S>(ab.first, ab.second).store(out + 2 * j);
  }
  for (; j < n; ++j) {
    out[2 * j] = static_cast<S>(alpha * a[j]);
    out[2 * j + 1] = static_cast<S>(alpha * b[j]);
  }
}

// Packs B (K x N), element (k, n) at src[k * sk + n * sn], as VNNI-2 column blocks (zero rows
// and columns past K and N), scaled by alpha. Row-major float sources (sn == 1: the tiles of P
// and dS) take the vectorised path.
template <typename S, typename Src>
void pack_b(const Src* src, int64_t sk, int64_t sn, int64_t K, int64_t N, S* dst,
            float alpha = 1.f) {
  const int64_t Ke = even(K);
  std::vector<float> zeros;
  for (int64_t b0 = 0; b0 < N; b0 += NB) {
    const int64_t w = std::min(NB, N - b0), ld = up16(w);
    S* blk = dst + b0 / NB * Ke * NB;
    for (int64_t p = 0; p < Ke / 2; ++p) {
      S* out = blk + p * ld * 2;
      if constexpr (std::is_same_v<Src, float>) {
        if (sn == 1) {
          const float* a = src + 2 * p * sk + b0;
          const float* b = a + sk;
          if (2 * p + 1 >= K) {
            zeros.assign(w, 0.f);
            b = zeros.data();
          }
          cvt_pair<S>(a, b, w, alpha, out);
          std::fill(out + 2 * w, out + 2 * ld, S(0));
          continue;
        }
      }
      for (int r = 0; r < 2; ++r) {
        const int64_t k = 2 * p + r;
        if (k >= K) {
          for (int64_t n = 0; n < ld; ++n) out[2 * n + r] = S(0);
          continue;
        }
        const Src* in = src + k * sk + b0 * sn;
        for (int64_t n = 0; n < w; ++n) out[2 * n + r] = static_cast<S>(alpha * float(in[n * sn]));
        for (int64_t n = w; n < ld; ++n) out[2 * n + r] = S(0);
      }
    }
  }
}

// Copies A (M x K), element (m, k) at src[m * sm + k * sk], into a row-major M x even(K) matrix
// (zero last column for odd K), scaled by alpha.
template <typename S, typename Src>
void stage_a(const Src* src, int64_t sm, int64_t sk, int64_t M, int64_t K, S* dst,
             float alpha = 1.f) {
  const int64_t Ke = even(K);
  for (int64_t m = 0; m < M; ++m) {
    S* out = dst + m * Ke;
    const Src* in = src + m * sm;
    if constexpr (std::is_same_v<Src, float>) {
      if (sk == 1) {
        cvt_row<S>(in, K, alpha, out);
        if (Ke > K) out[K] = S(0);
        continue;
      }
    }
    if (sk == 1 && alpha == 1.f && std::is_same_v<Src, S>) {
      std::copy(in, in + K, out);
    } else {
      for (int64_t k = 0; k < K; ++k) out[k] = static_cast<S>(alpha * float(in[k * sk]));
    }
    if (Ke > K) out[K] = S(0);
  }
}

// C (M x N, row stride ldc) (+)= A (M x even(K), row stride lda) B (packed K x N).
template <typename S>
void gemm_packed(int64_t M, int64_t N, int64_t K, const S* A, int64_t lda, const S* Bp, float* C,
                 int64_t ldc, bool add) {
  if (M <= 0 || N <= 0) return;
  const int64_t Ke = even(K);
  for (int64_t b0 = 0; b0 < N; b0 += NB) {
    const int64_t w = std::min(NB, N - b0);
    at::native::cpublas::brgemm(M, w, Ke, lda, up16(w), ldc, add, A, Bp + b0 / NB * Ke * NB,
                                C + b0, true);
  }
}

// A (M x K) operand of one head's rows: read in place when K is even and the rows contiguous,
// else staged (zero-padded) into buf.
template <typename S>
const S* a_rows(const Rows<const S*>& X, int64_t r0, int64_t M, int64_t K, std::vector<S>& buf,
                int64_t* lda) {
  if (K % 2 == 0) {
    *lda = X.ld;
    return X.row(r0);
  }
  buf.resize(M * even(K));
  stage_a<S>(X.row(r0), X.ld, 1, M, K, buf.data());
  *lda = even(K);
  return buf.data();
}

// Where level l's packed matrices of key tile kt sit in one head's buffer: K_l^T (d x nc_l)
// for the scores, and (backward) K_l's rows (nc_l x d) for dQ; V (nj x dv) or V^T (dv x nj).
struct KeyPacks {
  std::vector<int64_t> kt_off, krows_off;
  int64_t v_off = 0, per_tile = 0, n_kt = 0;

  KeyPacks(const Geom& g, bool backward) : kt_off(g.L), krows_off(g.L) {
    n_kt = (g.T + g.tile_k - 1) / g.tile_k;
    int64_t o = 0;
    for (int64_t l = 0; l < g.L; ++l) {
      const int64_t nc = g.tile_k / g.f[l];
      kt_off[l] = o;
      o += packed_size(g.d, nc);
      if (backward) {
        krows_off[l] = o;
        o += packed_size(nc, g.d);
      }
    }
    v_off = o;
    o += backward ? packed_size(g.dv, g.tile_k) : packed_size(g.tile_k, g.dv);
    per_tile = o;
  }
};

// Packs key tile kt of one head (all levels) at dst.
template <typename S>
void pack_key_tile(const Geom& g, const KeyPacks& kp, const std::vector<Rows<const S*>>& K,
                   const Rows<const S*>& V, int64_t kt, bool backward, S* dst) {
  const int64_t j0 = kt * g.tile_k, j1 = std::min(j0 + g.tile_k, g.T);
  for (int64_t l = 0; l < g.L; ++l) {
    const int64_t c0 = g.c0(l, j0), nc = g.cn(l, j0, j1);
    pack_b<S>(K[l].row(c0), 1, K[l].ld, g.d, nc, dst + kp.kt_off[l]);  // K_l^T
    if (backward) pack_b<S>(K[l].row(c0), K[l].ld, 1, nc, g.d, dst + kp.krows_off[l]);
  }
  if (backward) {
    pack_b<S>(V.row(j0), 1, V.ld, g.dv, j1 - j0, dst + kp.v_off);  // V^T
  } else {
    pack_b<S>(V.row(j0), V.ld, 1, j1 - j0, g.dv, dst + kp.v_off);  // V
  }
}

// The score GEMM of the reduced-precision kernels: out = alpha Q_l K_l^T for one (query tile,
// key tile), Q_l rows read in place (or staged), K_l^T from the key tile's packs.
template <typename S>
struct PackedScores {
  const Geom& g;
  const std::vector<const S*>& qa;     // per level: the A operand of the query tile's rows
  const std::vector<int64_t>& qa_ld;   // its row stride
  const std::vector<int64_t>& qa_r0;   // the level row it starts at
  const KeyPacks& kp;
  const S* tile = nullptr;  // the key tile's packs

  void operator()(int64_t l, int64_t r0, int64_t nr, int64_t c0, int64_t nc, float alpha,
                  float* out, int64_t ld) const {
    (void)c0;  // the key tile's packs start at its first coarse column
    gemm_packed<S>(nr, nc, g.d, qa[l] + (r0 - qa_r0[l]) * qa_ld[l], qa_ld[l], tile + kp.kt_off[l],
                   out, ld, false);
    if (alpha != 1.f) {
      const fVec va(alpha);
      for (int64_t a = 0; a < nr; ++a) {
        float* row = out + a * ld;
        int64_t j = 0;
        for (; j + fVec::size() <= nc; j += fVec::size()) (fVec::loadu(row + j) * va).store(row + j);
        for (; j < nc; ++j) row[j] *= alpha;
      }
    }
  }
};

// The query tile's A operands (levels' rows, staged when d is odd).
template <typename S>
struct QueryRows {
  std::vector<const S*> a;
  std::vector<int64_t> ld, r0;
  std::vector<std::vector<S>> bufs;

  explicit QueryRows(const Geom& g) : a(g.L), ld(g.L), r0(g.L), bufs(g.L) {}

  void load(const Geom& g, const std::vector<Rows<const S*>>& Q, int64_t i0, int64_t i1) {
    for (int64_t l = 0; l < g.L; ++l) {
      r0[l] = g.c0(l, i0);
      a[l] = a_rows<S>(Q[l], r0[l], g.cn(l, i0, i1), g.d, bufs[l], &ld[l]);
    }
  }
};

// Releases this thread's GEMM hardware context (AMX tile configuration) when it goes out of
// scope.
struct ReleaseOnExit {
  ReleaseOnExit() = default;
  ReleaseOnExit(const ReleaseOnExit&) = delete;
  ReleaseOnExit& operator=(const ReleaseOnExit&) = delete;
  ~ReleaseOnExit() { at::native::cpublas::brgemm_release(true); }
};

// Packs every key tile of every head (parallel over heads x tiles).
template <typename S>
std::vector<S> pack_all_keys(const Geom& g, const KeyPacks& kp, const std::vector<at::Tensor>& k,
                             const at::Tensor& v, bool backward) {
  std::vector<S> buf(g.B * g.H * kp.n_kt * kp.per_tile);
  std::vector<int64_t> order(g.B * g.H * kp.n_kt);
  for (int64_t i = 0; i < static_cast<int64_t>(order.size()); ++i) order[i] = i;
  run_dynamic(order, [&](int64_t item) {
    const int64_t bh = item / kp.n_kt, kt = item % kp.n_kt;
    const auto K = head_levels<S>(g, k, bh);
    const auto V = head_rows<S>(v, bh / g.H, bh % g.H);
    pack_key_tile<S>(g, kp, K, V, kt, backward, buf.data() + item * kp.per_tile);
  });
  return buf;
}

// ---- forward -----------------------------------------------------------------------------

template <typename S>
void forward_lowp(const Geom& g, const std::vector<at::Tensor>& q,
                  const std::vector<at::Tensor>& k, const at::Tensor& v, const at::Tensor& lam,
                  const bool* km, at::Tensor& out, at::Tensor& lse) {
  const KeyPacks kp(g, false);
  const std::vector<S> packs = pack_all_keys<S>(g, kp, k, v, false);
  const int64_t n_qt = (g.T + g.tile_q - 1) / g.tile_q;
  const std::vector<int64_t> order = query_tile_order(g);
  const float* lam_p = lam.data_ptr<float>();
  float* lse_p = lse.data_ptr<float>();
  const float inf = std::numeric_limits<float>::infinity();

  run_dynamic<ReleaseOnExit>(order, [&](int64_t item) {
    const int64_t bh = item / n_qt, t = item % n_qt;
    const int64_t b = bh / g.H, h = bh % g.H;
    const int64_t i0 = t * g.tile_q, i1 = std::min(i0 + g.tile_q, g.T), ni = i1 - i0;
    const auto Q = head_levels<S>(g, q, bh);
    QueryRows<S> qr(g);
    qr.load(g, Q, i0, i1);
    PackedScores<S> scores{g, qr.a, qr.ld, qr.r0, kp};
    const bool* kmb = km == nullptr ? nullptr : km + b * g.T;
    const float* lam_h = lam_p + h * g.L;

    CoarseTile<float> ct(g);
    std::vector<float> Sc(g.tile_q * g.tile_k), m(ni, -inf), den(ni, 0.f), acc(ni * g.dv, 0.f);
    std::vector<S> Pb(g.tile_q * even(g.tile_k));
    const int64_t jend = g.causal ? i1 : g.T;
    for (int64_t j0 = 0; j0 < jend; j0 += g.tile_k) {
      const int64_t j1 = std::min(j0 + g.tile_k, g.T), nj = j1 - j0;
      const S* tile = packs.data() + (bh * kp.n_kt + j0 / g.tile_k) * kp.per_tile;
      scores.tile = tile;
      ct.load(g, scores, lam_h, kmb, i0, i1, j0, j1, false, Sc.data());
      softmax_rows<float>(g, ct, lam_h[0], i0, ni, j0, nj, Sc.data(), m.data(), den.data(),
                          acc.data());
      stage_a<S>(Sc.data(), nj, 1, ni, nj, Pb.data());
      gemm_packed<S>(ni, g.dv, nj, Pb.data(), even(nj), tile + kp.v_off, acc.data(), g.dv, true);
    }
    write_rows<float, S>(g, head_rows<S, S*>(out, b, h), i0, ni, m.data(), den.data(),
                         acc.data(), lse_p + bh * g.T + i0);
  });
}

// ---- backward ----------------------------------------------------------------------------

// One head's float32 gradient accumulators: dQ_l (T_l x d), dK_l^T (d x T_l), dV^T (dv x T).
struct HeadGrads {
  std::vector<std::vector<float>> dq, dkt;
  std::vector<float> dvt;

  explicit HeadGrads(const Geom& g) : dq(g.L), dkt(g.L), dvt(g.dv * g.T, 0.f) {
    for (int64_t l = 0; l < g.L; ++l) {
      dq[l].assign(g.Tl[l] * g.d, 0.f);
      dkt[l].assign(g.d * g.Tl[l], 0.f);
    }
  }

  // Writes them into head bh of the (reduced-precision) gradient tensors; w[l] is level l's
  // weight times the score scale (the accumulators hold the unscaled products).
  template <typename S>
  void store(const Geom& g, int64_t bh, const std::vector<float>& w,
             std::vector<at::Tensor>& dq_t, std::vector<at::Tensor>& dk_t,
             at::Tensor& dv_t) const {
    for (int64_t l = 0; l < g.L; ++l) {
      const auto dQ = head_rows<S, S*>(dq_t[l], bh / g.H, bh % g.H);
      const auto dK = head_rows<S, S*>(dk_t[l], bh / g.H, bh % g.H);
      for (int64_t i = 0; i < g.Tl[l]; ++i) {
        for (int64_t c = 0; c < g.d; ++c) {
          dQ.row(i)[c] = static_cast<S>(w[l] * dq[l][i * g.d + c]);
          dK.row(i)[c] = static_cast<S>(w[l] * dkt[l][c * g.Tl[l] + i]);
        }
      }
    }
    const auto dV = head_rows<S, S*>(dv_t, bh / g.H, bh % g.H);
    for (int64_t j = 0; j < g.T; ++j)
      for (int64_t c = 0; c < g.dv; ++c) dV.row(j)[c] = static_cast<S>(dvt[c * g.T + j]);
  }
};

// The packed and staged operands of one query tile in the backward pass: Q_l^T (d x nr_l) as
// the A of dK_l^T, dO^T (dv x ni) as the A of dV^T, dO (ni x dv) as the A of dP.
template <typename S>
struct QueryTileOps {
  std::vector<std::vector<S>> qt;
  std::vector<S> dot, do_rows;
  const S* do_a = nullptr;
  int64_t do_ld = 0;

  explicit QueryTileOps(const Geom& g) : qt(g.L) {}

  void load(const Geom& g, const std::vector<Rows<const S*>>& Q, const Rows<const S*>& dO,
            int64_t i0, int64_t i1) {
    for (int64_t l = 0; l < g.L; ++l) {
      const int64_t r0 = g.c0(l, i0), nr = g.cn(l, i0, i1);
      qt[l].resize(g.d * even(nr));
      stage_a<S>(Q[l].row(r0), 1, Q[l].ld, g.d, nr, qt[l].data());
    }
    dot.resize(g.dv * even(i1 - i0));
    stage_a<S>(dO.row(i0), 1, dO.ld, g.dv, i1 - i0, dot.data());
    do_a = a_rows<S>(dO, i0, i1 - i0, g.dv, do_rows, &do_ld);
  }
};

// The gradients of one level from its score gradient G (nr x nc, float): dQ_l += G K_l and
// dK_l^T += Q_l^T G. The level's weight and the score scale are applied when the accumulators
// are stored, so that G is rounded to S unscaled (a small weight would push float16 values
// toward its subnormal range).
template <typename S>
void level_grads(const Geom& g, int64_t l, const float* G, int64_t nr, int64_t nc, int64_t ci0,
                 int64_t cj0, const S* krows, const S* qt, HeadGrads& acc, std::vector<S>& a_buf,
                 std::vector<S>& b_buf) {
  a_buf.resize(nr * even(nc));
  stage_a<S>(G, nc, 1, nr, nc, a_buf.data());
  gemm_packed<S>(nr, g.d, nc, a_buf.data(), even(nc), krows, acc.dq[l].data() + ci0 * g.d, g.d,
                 true);
  b_buf.resize(packed_size(nr, nc));
  pack_b<S>(G, nc, 1, nr, nc, b_buf.data());
  gemm_packed<S>(g.d, nc, nr, qt, even(nr), b_buf.data(), acc.dkt[l].data() + cj0, g.Tl[l], true);
}

template <typename S>
void backward_lowp(const Geom& g, const std::vector<at::Tensor>& q,
                   const std::vector<at::Tensor>& k, const at::Tensor& v, const at::Tensor& lam,
                   const bool* km, const at::Tensor& out, const at::Tensor& lse,
                   const at::Tensor& dout, std::vector<at::Tensor>& dq,
                   std::vector<at::Tensor>& dk, at::Tensor& dv, at::Tensor& dlam_bh) {
  const KeyPacks kp(g, true);
  const std::vector<S> packs = pack_all_keys<S>(g, kp, k, v, true);
  const std::vector<int64_t> order = head_order(g);
  const float* lam_p = lam.data_ptr<float>();

  run_dynamic<ReleaseOnExit>(order, [&](int64_t bh) {
    const int64_t b = bh / g.H, h = bh % g.H;
    const auto Q = head_levels<S>(g, q, bh);
    const auto O = head_rows<S>(out, b, h), dO = head_rows<S>(dout, b, h);
    const float* LSE = lse.data_ptr<float>() + bh * g.T;
    const bool* kmb = km == nullptr ? nullptr : km + b * g.T;
    const float* lam_h = lam_p + h * g.L;
    const float lam0 = lam_h[0];

    std::vector<float> delta(g.T);
    for (int64_t i = 0; i < g.T; ++i) {
      float acc = 0.f;
      for (int64_t c = 0; c < g.dv; ++c) acc += float(dO.row(i)[c]) * float(O.row(i)[c]);
      delta[i] = acc;
    }
    HeadGrads grads(g);
    QueryRows<S> qr(g);
    QueryTileOps<S> qo(g);
    PackedScores<S> scores{g, qr.a, qr.ld, qr.r0, kp};
    CoarseTile<float> ct(g);
    std::vector<std::vector<float>> D(g.L);
    for (int64_t l = 1; l < g.L; ++l) D[l].resize(ct.C[l].size());
    const int64_t tile = g.tile_q * g.tile_k;
    std::vector<float> F(tile), P(tile), dS(tile), rowbuf(g.tile_k);
    std::vector<S> a_buf, b_buf;
    std::vector<double> dlam_acc(g.L, 0.0);

    for (int64_t i0 = 0; i0 < g.T; i0 += g.tile_q) {
      const int64_t i1 = std::min(i0 + g.tile_q, g.T), ni = i1 - i0;
      qr.load(g, Q, i0, i1);
      qo.load(g, Q, dO, i0, i1);
      const int64_t jend = g.causal ? i1 : g.T;
      for (int64_t j0 = 0; j0 < jend; j0 += g.tile_k) {
        const int64_t j1 = std::min(j0 + g.tile_k, g.T), nj = j1 - j0;
        const S* kt = packs.data() + (bh * kp.n_kt + j0 / g.tile_k) * kp.per_tile;
        scores.tile = kt;
        ct.load(g, scores, lam_h, kmb, i0, i1, j0, j1, true, F.data());
        recompute_rows<float>(g, ct, lam0, LSE, i0, ni, j0, nj, F.data(), P.data());
        // dV^T += dO^T P;  dP = dO V^T
        b_buf.resize(packed_size(ni, nj));
        pack_b<S>(P.data(), nj, 1, ni, nj, b_buf.data());
        gemm_packed<S>(g.dv, nj, ni, qo.dot.data(), even(ni), b_buf.data(), grads.dvt.data() + j0,
                       g.T, true);
        gemm_packed<S>(ni, nj, g.dv, qo.do_a, qo.do_ld, kt + kp.v_off, dS.data(), nj, false);
        // dS = P (dP - delta): the gradient of the fused score
        dlam_acc[0] += ds_rows<float>(dS.data(), P.data(), F.data(), delta.data() + i0, ni, nj);
        coarse_grads<float>(g, ct, dS.data(), ni, nj, D, rowbuf.data(), dlam_acc);
        for (int64_t l = 0; l < g.L; ++l) {
          const float* G = l == 0 ? dS.data() : D[l].data();
          const int64_t nr = l == 0 ? ni : ct.rows[l], nc = l == 0 ? nj : ct.cols[l];
          level_grads<S>(g, l, G, nr, nc, g.c0(l, i0), g.c0(l, j0), kt + kp.krows_off[l],
                         qo.qt[l].data(), grads, a_buf, b_buf);
        }
      }
    }
    std::vector<float> w(g.L);
    for (int64_t l = 0; l < g.L; ++l) w[l] = lam_h[l] * static_cast<float>(g.scale);
    grads.store<S>(g, bh, w, dq, dk, dv);
    float* dlam = dlam_bh.data_ptr<float>() + bh * g.L;
    for (int64_t l = 0; l < g.L; ++l) dlam[l] = static_cast<float>(dlam_acc[l]);
  });
}

// One product through the packed GEMM against its float32 answer (small integers: exact in
// S), computed twice with accumulation on the second call.
template <typename S>
bool brgemm_case(int64_t M, int64_t N, int64_t K) {
  std::vector<float> a(M * K), bm(K * N), ref(M * N, 0.f), c(M * N, 0.f);
  for (int64_t i = 0; i < M * K; ++i) a[i] = float(i % 5) - 2.f;
  for (int64_t i = 0; i < K * N; ++i) bm[i] = float(i % 3) - 1.f;
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j)
      for (int64_t x = 0; x < K; ++x) ref[i * N + j] += 2.f * a[i * K + x] * bm[x * N + j];
  std::vector<S> A(M * even(K)), B(packed_size(K, N));
  stage_a<S>(a.data(), K, 1, M, K, A.data());
  pack_b<S>(bm.data(), N, 1, K, N, B.data());
  const ReleaseOnExit release;
  gemm_packed<S>(M, N, K, A.data(), even(K), B.data(), c.data(), N, false);
  gemm_packed<S>(M, N, K, A.data(), even(K), B.data(), c.data(), N, true);
  for (int64_t i = 0; i < M * N; ++i)
    if (c[i] != ref[i]) return false;
  return true;
}

// Whether the batch-reduce GEMM runs S with this file's packed layout on this CPU (oneDNN's
// ukernel: AVX-512 BF16 or AMX for bfloat16; for float16 only where oneDNN reads B in the same
// VNNI-2 layout, AMX-FP16), checked once on a small and on a larger product (several column
// blocks, K > 32, M > 16).
template <typename S>
bool brgemm_works() {
  try {
    return brgemm_case<S>(3, 5, 3) && brgemm_case<S>(19, 70, 67);
  } catch (const std::exception&) {
    return false;
  }
}

}  // namespace

bool hkt_lowp_supported(at::ScalarType dtype) {
  // oneDNN's GEMM is off when the user turns mkldnn off (read on every call, as ATen does)
  if (!at::globalContext().userEnabledMkldnn()) return false;
  static const bool bf16 = brgemm_works<at::BFloat16>();
  static const bool f16 = brgemm_works<at::Half>();
  if (dtype == at::kBFloat16) return bf16;
  if (dtype == at::kHalf) return f16;
  return false;
}

// The reduced-precision entry points (called by hkt_forward / hkt_backward in hkt_cpu.cpp for
// bfloat16 and float16 inputs): lam is float32, the log-sum-exp float32, the outputs and input
// gradients in the inputs' dtype, the level weights' gradient float32.
std::vector<at::Tensor> hkt_forward_lowp(std::vector<at::Tensor> q, std::vector<at::Tensor> k,
                                         at::Tensor v, at::Tensor lam,
                                         std::optional<at::Tensor> key_mask, bool causal,
                                         int64_t stride, double scale, int64_t tile_q,
                                         int64_t tile_k) {
  TORCH_CHECK(hkt_lowp_supported(v.scalar_type()), "no ", v.scalar_type(),
              " batch-reduce GEMM on this CPU");
  const Geom g = make_geom(q, k, v, lam, stride, causal, scale, tile_q, tile_k);
  const bool* km = mask_ptr(key_mask, g);
  at::Tensor out = empty_heads_like(v);
  at::Tensor lse = at::empty({g.B, g.H, g.T}, v.options().dtype(at::kFloat));
  const at::Tensor lam_c = lam.contiguous();
  if (v.scalar_type() == at::kBFloat16) {
    forward_lowp<at::BFloat16>(g, q, k, v, lam_c, km, out, lse);
  } else {
    forward_lowp<at::Half>(g, q, k, v, lam_c, km, out, lse);
  }
  return {out, lse};
}

std::vector<at::Tensor> hkt_backward_lowp(std::vector<at::Tensor> q, std::vector<at::Tensor> k,
                                          at::Tensor v, at::Tensor lam,
                                          std::optional<at::Tensor> key_mask, bool causal,
                                          int64_t stride, double scale, int64_t tile_q,
                                          int64_t tile_k, at::Tensor out, at::Tensor lse,
                                          at::Tensor dout) {
  TORCH_CHECK(hkt_lowp_supported(v.scalar_type()), "no ", v.scalar_type(),
              " batch-reduce GEMM on this CPU");
  const Geom g = make_geom(q, k, v, lam, stride, causal, scale, tile_q, tile_k);
  check_backward_inputs(g, v, out, dout, lse, at::kFloat);
  const bool* km = mask_ptr(key_mask, g);
  std::vector<at::Tensor> dq, dk;
  for (int64_t l = 0; l < g.L; ++l) {
    dq.push_back(at::empty_like(q[l]));
    dk.push_back(at::empty_like(k[l]));
  }
  at::Tensor dv = at::empty_like(v);
  at::Tensor dlam_bh = at::zeros({g.B, g.H, g.L}, v.options().dtype(at::kFloat));
  const at::Tensor lam_c = lam.contiguous();
  if (v.scalar_type() == at::kBFloat16) {
    backward_lowp<at::BFloat16>(g, q, k, v, lam_c, km, out, lse, dout, dq, dk, dv, dlam_bh);
  } else {
    backward_lowp<at::Half>(g, q, k, v, lam_c, km, out, lse, dout, dq, dk, dv, dlam_bh);
  }
  return gradient_list(dq, dk, dv, dlam_bh);
}

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
#include "hkt_cpu_tiles.h"

namespace {

// ---- forward -----------------------------------------------------------------------------

template <typename T>
void forward_impl(const Geom& g, const std::vector<at::Tensor>& q,
                  const std::vector<at::Tensor>& k, const at::Tensor& v, const at::Tensor& lam,
                  const bool* km, at::Tensor& out, at::Tensor& lse) {
  const int64_t n_qt = (g.T + g.tile_q - 1) / g.tile_q;
  const std::vector<int64_t> order = query_tile_order(g);

  const T* lam_p = lam.data_ptr<T>();
  T* lse_p = lse.data_ptr<T>();
  const T inf = std::numeric_limits<T>::infinity();

  run_dynamic(order, [&](int64_t item) {
    const int64_t bh = item / n_qt, t = item % n_qt;
    const int64_t b = bh / g.H, h = bh % g.H;
    const int64_t i0 = t * g.tile_q, i1 = std::min(i0 + g.tile_q, g.T), ni = i1 - i0;
    const auto Q = head_levels<T>(g, q, bh), K = head_levels<T>(g, k, bh);
    const BlasScores<T> scores{Q, K, g.d};
    const auto V = head_rows<T>(v, b, h);
    const bool* kmb = km == nullptr ? nullptr : km + b * g.T;
    const T* lam_h = lam_p + h * g.L;

    CoarseTile<T> ct(g);
    std::vector<T> S(g.tile_q * g.tile_k);
    std::vector<T> m(ni, -inf), den(ni, T(0)), acc(ni * g.dv, T(0));

    const int64_t jend = g.causal ? i1 : g.T;
    for (int64_t j0 = 0; j0 < jend; j0 += g.tile_k) {
      const int64_t j1 = std::min(j0 + g.tile_k, g.T), nj = j1 - j0;
      ct.load(g, scores, lam_h, kmb, i0, i1, j0, j1, false, S.data());
      softmax_rows<T>(g, ct, lam_h[0], i0, ni, j0, nj, S.data(), m.data(), den.data(),
                      acc.data());
      mm<T>(false, false, ni, g.dv, nj, T(1), S.data(), nj, V.row(j0), V.ld, T(1), acc.data(),
            g.dv);
    }
    write_rows<T, T>(g, head_rows<T, T*>(out, b, h), i0, ni, m.data(), den.data(), acc.data(),
                     lse_p + bh * g.T + i0);
  });
}

// ---- backward ----------------------------------------------------------------------------

template <typename T>
void backward_impl(const Geom& g, const std::vector<at::Tensor>& q,
                   const std::vector<at::Tensor>& k, const at::Tensor& v, const at::Tensor& lam,
                   const bool* km, const at::Tensor& out, const at::Tensor& lse,
                   const at::Tensor& dout, std::vector<at::Tensor>& dq,
                   std::vector<at::Tensor>& dk, at::Tensor& dv, at::Tensor& dlam_bh) {
  const std::vector<int64_t> order = head_order(g);
  const T* lam_p = lam.data_ptr<T>();

  run_dynamic(order, [&](int64_t bh) {
    const int64_t b = bh / g.H, h = bh % g.H;
    const auto Q = head_levels<T>(g, q, bh), K = head_levels<T>(g, k, bh);
    const BlasScores<T> scores{Q, K, g.d};
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
        ct.load(g, scores, lam_h, kmb, i0, i1, j0, j1, true, F.data());
        recompute_rows<T>(g, ct, lam0, LSE, i0, ni, j0, nj, F.data(), P.data());
        // dV += P^T dO;  dP = dO V^T
        mm<T>(true, false, nj, g.dv, ni, T(1), P.data(), nj, dO.row(i0), dO.ld, T(1),
              dV.row(j0), dV.ld);
        mm<T>(false, true, ni, nj, g.dv, T(1), dO.row(i0), dO.ld, V.row(j0), V.ld, T(0),
              dS.data(), nj);
        // dS = P (dP - delta): the gradient of the fused score
        dlam_acc[0] += ds_rows<T>(dS.data(), P.data(), F.data(), delta.data() + i0, ni, nj);
        const T w0 = lam0 * static_cast<T>(g.scale);
        mm<T>(false, false, ni, g.d, nj, w0, dS.data(), nj, K[0].row(j0), K[0].ld, T(1),
              dQ[0].row(i0), dQ[0].ld);
        mm<T>(true, false, nj, g.d, ni, w0, dS.data(), nj, Q[0].row(i0), Q[0].ld, T(1),
              dK[0].row(j0), dK[0].ld);
        // coarse levels: nested block sums of dS
        coarse_grads<T>(g, ct, dS.data(), ni, nj, D, rowbuf.data(), dlam_acc);
        for (int64_t l = 1; l < g.L; ++l) {
          const int64_t nr = ct.rows[l], nc = ct.cols[l];
          const T wl = lam_h[l] * static_cast<T>(g.scale);
          const int64_t ci0 = g.c0(l, i0), cj0 = g.c0(l, j0);
          mm<T>(false, false, nr, g.d, nc, wl, D[l].data(), nc, K[l].row(cj0), K[l].ld, T(1),
                dQ[l].row(ci0), dQ[l].ld);
          mm<T>(true, false, nc, g.d, nr, wl, D[l].data(), nc, Q[l].row(ci0), Q[l].ld, T(1),
                dK[l].row(cj0), dK[l].ld);
        }
      }
    }
    for (int64_t l = 0; l < g.L; ++l) dlam[l] = static_cast<T>(dlam_acc[l]);
  });
}

}  // namespace

// csrc/hkt_cpu_lowp.cpp: bfloat16 / float16 inputs on the batch-reduce GEMM
bool hkt_lowp_supported(at::ScalarType dtype);
std::vector<at::Tensor> hkt_forward_lowp(std::vector<at::Tensor> q, std::vector<at::Tensor> k,
                                         at::Tensor v, at::Tensor lam,
                                         std::optional<at::Tensor> key_mask, bool causal,
                                         int64_t stride, double scale, int64_t tile_q,
                                         int64_t tile_k);
std::vector<at::Tensor> hkt_backward_lowp(std::vector<at::Tensor> q, std::vector<at::Tensor> k,
                                          at::Tensor v, at::Tensor lam,
                                          std::optional<at::Tensor> key_mask, bool causal,
                                          int64_t stride, double scale, int64_t tile_q,
                                          int64_t tile_k, at::Tensor out, at::Tensor lse,
                                          at::Tensor dout);

std::vector<at::Tensor> hkt_forward(std::vector<at::Tensor> q, std::vector<at::Tensor> k,
                                    at::Tensor v, at::Tensor lam,
                                    std::optional<at::Tensor> key_mask, bool causal,
                                    int64_t stride, double scale, int64_t tile_q,
                                    int64_t tile_k) {
  if (v.scalar_type() == at::kBFloat16 || v.scalar_type() == at::kHalf) {
    return hkt_forward_lowp(q, k, v, lam, key_mask, causal, stride, scale, tile_q, tile_k);
  }
  const Geom g = make_geom(q, k, v, lam, stride, causal, scale, tile_q, tile_k);
  const bool* km = mask_ptr(key_mask, g);
  at::Tensor out = empty_heads_like(v);  // a (B, T, H, dv) v gives one too
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
  if (v.scalar_type() == at::kBFloat16 || v.scalar_type() == at::kHalf) {
    return hkt_backward_lowp(q, k, v, lam, key_mask, causal, stride, scale, tile_q, tile_k, out,
                             lse, dout);
  }
  const Geom g = make_geom(q, k, v, lam, stride, causal, scale, tile_q, tile_k);
  check_backward_inputs(g, v, out, dout, lse, v.scalar_type());
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
  return gradient_list(dq, dk, dv, dlam_bh);
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
  m.def("lowp_supported", [](const at::Tensor& x) { return hkt_lowp_supported(x.scalar_type()); },
        "whether the bfloat16 / float16 kernel runs on this CPU (x: a tensor of that dtype)");
  m.def("decode_step", &hkt_decode_step,
        "one causal HKT decoding step, every sequence at the same position");
  m.def("causal_dwconv_forward", &causal_dwconv_forward,
        "causal depthwise convolution over time, (B, T, D) -> (B, ceil(T / s), D)");
  m.def("causal_dwconv_backward", &causal_dwconv_backward,
        "its backward: returns (grad_x, grad_w (D, k), grad_bias (D,))");
}

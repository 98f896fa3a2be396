// One decoding step of a causal HKT layer on the CPU, every sequence at the same position.
//
// The same mathematics as HKTAttention._step (structattn/hkt/attention.py, the readable PyTorch
// version, which stays the reference and the path for gradients, dropout and sequences at
// different positions). A step is a few dozen tiny operations (a convolution over k vectors per
// level, row writes into the caches, the hybrid head) around two products that grow with the
// context (the new queries against the keys, the probabilities times V). As PyTorch calls, each
// tiny operation costs more in dispatch than in arithmetic; here they are loops, the products
// are BLAS calls per (sequence, head), and heads run in parallel. A new coarse token's LayerNorm
// and GELU stay PyTorch's (every s^l tokens), so that they overflow exactly like the reference.
//
// Shapes (B batch, H heads, d head dim, D = H d, L levels, s stride, k kernels):
//   x (B, D) layer input; qkv (B, 3D) level 0's Q, K, V for it;
//   keys[l] (B, H, >= T0 / s^l, d) and values (B, H, >= T0, d), contiguous: written in place
//   at the new rows; queries[l] (B, H, d); windows[l] (B, k_down - 1, D) for l < L - 1;
//   conv_window (B, k_conv - 1, D); scores[l] (B, H, T0 / s^l) for l >= 1 or empty (stale);
//   coarse_w[l] (2D, D) and coarse_b[l] (2D or empty) for levels 1 .. L-1;
//   down_w[l] (D, k_down), down_b[l] / ln_w[l] / ln_b[l] (D or empty);
//   lam (H, L) level weights times the score scale; beta (D) attention share (empty: no hybrid);
//   conv_w (D, k_conv), conv_b (D or empty).
// Returns [out (B, D), queries x L, windows x (L - 1), conv_window (empty: no hybrid),
//          scores x L (scores[0] empty)]; the caller stores them in the cache.
#include "hkt_cpu_common.h"

namespace {

using at::Tensor;

// out[b, c] = sum_j in[b, j, c] w[c, j] + bias[c], where in[b] is rows 0 .. k-2 of win[b] and
// then last[b]; the new window (the last k - 1 inputs) is written to new_win.
template <typename T>
void conv_last(const T* win, const T* last, const T* w, const T* bias, int64_t B, int64_t km1,
               int64_t D, T* out, T* new_win) {
  const int64_t k = km1 + 1;
  for (int64_t b = 0; b < B; ++b) {
    const T* wb = win + b * km1 * D;
    const T* lb = last + b * D;
    T* ob = out + b * D;
    for (int64_t c = 0; c < D; ++c) {
      T acc = 0;
      for (int64_t j = 0; j < km1; ++j) acc += wb[j * D + c] * w[c * k + j];
      acc += lb[c] * w[c * k + km1];
      ob[c] = bias ? acc + bias[c] : acc;
    }
    if (km1 > 0) {
      T* nb = new_win + b * km1 * D;
      std::copy(wb + D, wb + km1 * D, nb);
      std::copy(lb, lb + D, nb + (km1 - 1) * D);
    }
  }
}

template <typename T>
const T* ptr_or_null(const Tensor& t) {
  return t.numel() ? t.data_ptr<T>() : nullptr;
}

// Copies row (B, D) slices of width D into (B, H, d) rows of dst at row index `row` of a
// (B, H, cap, d) tensor (cap = 1 for a (B, H, d) tensor).
template <typename T>
void scatter_heads(const T* src, int64_t src_ld, int64_t B, int64_t H, int64_t d, T* dst,
                   int64_t cap, int64_t row) {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const T* s = src + b * src_ld + h * d;
      std::copy(s, s + d, dst + ((b * H + h) * cap + row) * d);
    }
}

}  // namespace

std::vector<Tensor> hkt_decode_step(
    const Tensor& x, const Tensor& qkv, int64_t pos, int64_t T0, int64_t s,
    const std::vector<Tensor>& keys, const std::vector<Tensor>& queries,
    const std::vector<Tensor>& windows, const Tensor& values, const Tensor& conv_window,
    const std::vector<Tensor>& scores, const std::vector<Tensor>& coarse_w,
    const std::vector<Tensor>& coarse_b, const std::vector<Tensor>& down_w,
    const std::vector<Tensor>& down_b, const std::vector<Tensor>& ln_w,
    const std::vector<Tensor>& ln_b, const std::vector<double>& ln_eps, const Tensor& lam,
    const Tensor& beta, const Tensor& conv_w, const Tensor& conv_b) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble),
              "hkt_decode_step: x must be a (B, D) float32 or float64 CPU tensor");
  TORCH_CHECK(lam.dim() == 2 && lam.size(0) > 0 && x.size(1) % lam.size(0) == 0,
              "hkt_decode_step: lam must be (H, L) with H dividing D");
  const int64_t B = x.size(0), D = x.size(1), H = lam.size(0), L = lam.size(1);
  TORCH_CHECK(s >= 2, "hkt_decode_step: stride must be >= 2");
  TORCH_CHECK(static_cast<int64_t>(keys.size()) == L &&
                  static_cast<int64_t>(queries.size()) == L &&
                  static_cast<int64_t>(scores.size()) == L &&
                  static_cast<int64_t>(windows.size()) == L - 1 &&
                  static_cast<int64_t>(coarse_w.size()) == L - 1 &&
                  static_cast<int64_t>(coarse_b.size()) == L - 1 &&
                  static_cast<int64_t>(down_w.size()) == L - 1 &&
                  static_cast<int64_t>(down_b.size()) == L - 1 &&
                  static_cast<int64_t>(ln_w.size()) == L - 1 &&
                  static_cast<int64_t>(ln_b.size()) == L - 1 &&
                  static_cast<int64_t>(ln_eps.size()) == L - 1,
              "hkt_decode_step: one key, query and score entry per level, one window and set of "
              "coarse weights per level above 0");
  int64_t span = 1;
  for (int64_t l = 1; l < L; ++l) span *= s;
  TORCH_CHECK(pos >= 0 && pos < T0 && T0 % span == 0,
              "hkt_decode_step: T0 must be a multiple of stride^(L-1) above pos");
  TORCH_CHECK(qkv.is_contiguous() && qkv.dim() == 2 && qkv.size(0) == B && qkv.size(1) == 3 * D,
              "hkt_decode_step: qkv must be a contiguous (B, 3D) tensor");
  TORCH_CHECK(values.is_contiguous() && values.dim() == 4 && values.size(0) == B &&
                  values.size(1) == H && values.size(2) >= T0 && values.size(3) == D / H,
              "hkt_decode_step: values must be contiguous (B, H, >= T0, d)");
  for (int64_t l = 0, rows = T0; l < L; ++l, rows /= s)
    TORCH_CHECK(keys[l].is_contiguous() && keys[l].dim() == 4 && keys[l].size(0) == B &&
                    keys[l].size(1) == H && keys[l].size(2) >= rows && keys[l].size(3) == D / H,
                "hkt_decode_step: level ", l, " keys must be contiguous (B, H, >= ", rows,
                ", d)");
  for (const Tensor* t : {&qkv, &values, &lam})
    TORCH_CHECK(t->scalar_type() == x.scalar_type(), "hkt_decode_step: one dtype throughout");
  const int64_t d = D / H;
  std::vector<Tensor> result;
  result.reserve(3 * L + 1);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "hkt_decode_step", [&] {
    using T = scalar_t;
    const auto opts = x.options();
    const bool hybrid = beta.numel() > 0;
    const T* xq = qkv.data_ptr<T>();  // (B, 3D) contiguous

    // Level 0: the new key and value rows, the new query.
    std::vector<Tensor> q_out(queries.begin(), queries.end());
    std::vector<Tensor> win_out(windows.begin(), windows.end());
    scatter_heads<T>(xq + D, 3 * D, B, H, d, keys[0].data_ptr<T>(), keys[0].size(2), pos);
    scatter_heads<T>(xq + 2 * D, 3 * D, B, H, d, values.data_ptr<T>(), values.size(2), pos);
    q_out[0] = at::empty({B, H, d}, opts);
    scatter_heads<T>(xq, 3 * D, B, H, d, q_out[0].data_ptr<T>(), 1, 0);

    const auto opt = [](const Tensor& t) {  // an empty tensor stands for an absent one
      return t.numel() ? c10::optional<Tensor>(t) : c10::nullopt;
    };
    // Coarse levels: level l gets a token where pos % s^l == 0, from level l - 1's last inputs.
    int64_t top = L - 1, block = 1;
    Tensor tok = x.contiguous();
    for (int64_t l = 1; l < L; ++l) {
      block *= s;
      const Tensor win = windows[l - 1].contiguous();
      const Tensor dw = down_w[l - 1].contiguous();
      const int64_t km1 = win.size(1);
      Tensor next = at::empty({B, D}, opts);
      win_out[l - 1] = at::empty({B, km1, D}, opts);
      conv_last<T>(win.data_ptr<T>(), tok.data_ptr<T>(), dw.data_ptr<T>(),
                   ptr_or_null<T>(down_b[l - 1]), B, km1, D, next.data_ptr<T>(),
                   win_out[l - 1].data_ptr<T>());
      if (pos % block != 0) {  // no new coarse token from here up
        top = l - 1;
        break;
      }
      // PyTorch's own LayerNorm and GELU (two calls per coarse token, every s^l steps), so that
      // overflow and NaN come out exactly as in the PyTorch step.
      next = at::gelu(at::layer_norm(next, {D}, opt(ln_w[l - 1]), opt(ln_b[l - 1]), ln_eps[l - 1]));
      Tensor qk = at::empty({B, 2 * D}, opts);  // (B, 2D) = next (B, D) W^T (W is (2D, D))
      T* pqk = qk.data_ptr<T>();
      const Tensor cw = coarse_w[l - 1].contiguous();
      const T* cb = ptr_or_null<T>(coarse_b[l - 1]);
      for (int64_t b = 0; b < B; ++b) {
        if (cb) std::copy(cb, cb + 2 * D, pqk + b * 2 * D);
        else std::fill(pqk + b * 2 * D, pqk + (b + 1) * 2 * D, T(0));
      }
      mm<T>(false, true, B, 2 * D, D, T(1), next.data_ptr<T>(), D, cw.data_ptr<T>(), D, T(1), pqk,
            2 * D);
      scatter_heads<T>(pqk + D, 2 * D, B, H, d, keys[l].data_ptr<T>(), keys[l].size(2),
                       pos / block);
      q_out[l] = at::empty({B, H, d}, opts);
      scatter_heads<T>(pqk, 2 * D, B, H, d, q_out[l].data_ptr<T>(), 1, 0);
      tok = next;
    }

    // Scores against keys 0 .. T0 - 1, summed coarse to fine (level l's rows start as level
    // l + 1's repeated s times, and the GEMM adds lambda_l q_l . K_l); a level above `top` kept
    // its query and keys, so its cached sum is reused. Level 0 only needs its first n = pos + 1.
    std::vector<Tensor> score_out(L);
    std::vector<Tensor> qs(L);
    std::vector<bool> fresh(L, true);
    std::vector<int64_t> Tl(L);
    Tl[L - 1] = T0 / span;
    for (int64_t l = L - 2; l >= 0; --l) Tl[l] = Tl[l + 1] * s;
    for (int64_t l = L - 1; l >= 0; --l) {
      const Tensor& kept = scores[l];
      const bool above_kept = l == L - 1 || !fresh[l + 1];
      if (l > top && above_kept && kept.dim() == 3 && kept.size(2) == Tl[l] &&
          kept.is_contiguous()) {
        score_out[l] = kept;
        fresh[l] = false;
      } else {
        score_out[l] = at::empty({B, H, l == 0 ? pos + 1 : Tl[l]}, opts);
        qs[l] = q_out[l].contiguous();
      }
    }
    const int64_t n = pos + 1;
    Tensor out = at::empty({B, D}, opts);
    T* po = out.data_ptr<T>();
    const T* plam = lam.contiguous().data_ptr<T>();
    const T* pv = values.data_ptr<T>();
    const int64_t capv = values.size(2);
    const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, n * d));
    at::parallel_for(0, B * H, grain, [&](int64_t begin, int64_t end) {
      std::vector<T> qrow(d);
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t h = bh % H;
        for (int64_t l = L - 1; l >= 0; --l) {
          if (!fresh[l]) continue;
          const int64_t cols = l == 0 ? n : Tl[l];
          T* row = score_out[l].data_ptr<T>() + bh * score_out[l].size(2);
          if (l + 1 < L) {
            expand_cols<T>(row, score_out[l + 1].data_ptr<T>() + bh * Tl[l + 1], cols, s);
          } else {
            std::fill(row, row + cols, T(0));
          }
          const T* q = qs[l].data_ptr<T>() + bh * d;
          const T w = plam[h * L + l];
          for (int64_t i = 0; i < d; ++i) qrow[i] = q[i] * w;
          mm<T>(false, true, 1, cols, d, T(1), qrow.data(), d,
                keys[l].data_ptr<T>() + bh * keys[l].size(2) * d, d, T(1), row, cols);
        }
        T* row = score_out[0].data_ptr<T>() + bh * n;
        T mx = -std::numeric_limits<T>::infinity();
        for (int64_t j = 0; j < n; ++j) mx = std::max(mx, row[j]);
        const T sum = exp_sum<T>(row, n, mx);
        mm<T>(false, false, 1, d, n, T(1) / sum, row, n, pv + bh * capv * d, d, T(0),
              po + (bh / H) * D + h * d, D);
      }
    });

    Tensor conv_out = at::empty({0}, opts);
    if (hybrid) {  // out = conv + beta (out - conv), the causal conv over V's last k_conv inputs
      const Tensor win = conv_window.contiguous();
      const Tensor cw = conv_w.contiguous();
      const int64_t km1 = win.size(1);
      Tensor vrow = qkv.narrow(1, 2 * D, D).contiguous();
      Tensor conv = at::empty({B, D}, opts);
      conv_out = at::empty({B, km1, D}, opts);
      conv_last<T>(win.data_ptr<T>(), vrow.data_ptr<T>(), cw.data_ptr<T>(), ptr_or_null<T>(conv_b),
                   B, km1, D, conv.data_ptr<T>(), conv_out.data_ptr<T>());
      const T* pc = conv.data_ptr<T>();
      const T* pb = beta.data_ptr<T>();
      for (int64_t b = 0; b < B; ++b)
        for (int64_t c = 0; c < D; ++c) {
          const int64_t i = b * D + c;
          po[i] = pc[i] + pb[c] * (po[i] - pc[i]);
        }
    }

    result.push_back(out);
    for (auto& t : q_out) result.push_back(t);
    for (auto& t : win_out) result.push_back(t);
    result.push_back(conv_out);
    result.push_back(at::empty({0}, opts));  // level 0's scores are not kept
    for (int64_t l = 1; l < L; ++l) result.push_back(score_out[l]);
  });
  return result;
}

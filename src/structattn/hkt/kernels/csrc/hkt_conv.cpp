// Causal depthwise convolution over time on the CPU, forward and backward, in the (B, T, D)
// layout the HKT layer holds (channels contiguous): output c reads inputs
// c*s - k + 1 .. c*s (zeros before 0), one filter per channel,
//
//     y[b, c, :] = bias + sum_j w[:, j] * x[b, c*s - (k-1) + j, :].
//
// The readable version is CausalDepthwiseConv (structattn/hkt/downsample.py, through conv2d),
// the reference these are tested against. Rows of x may be strided (a slice of a fused
// projection's output is read in place); every inner loop runs over the D contiguous channels.
//
// Shapes: x (B, T, D) with unit channel stride; w (D, k); bias (D) or empty; y (B, ceil(T/s), D).
#include "hkt_cpu_common.h"

namespace {

using at::Tensor;

// w (D, k) transposed to (k, D): the channels of one tap contiguous, as the loops read them.
template <typename T>
std::vector<T> taps_major(const T* w, int64_t D, int64_t k) {
  std::vector<T> wt(k * D);
  for (int64_t j = 0; j < k; ++j)
    for (int64_t c = 0; c < D; ++c) wt[j * D + c] = w[c * k + j];
  return wt;
}

template <typename T>
void conv_forward(const T* x, int64_t sb, int64_t st, const T* w, const T* bias, int64_t B,
                  int64_t T_in, int64_t T_out, int64_t D, int64_t k, int64_t s, T* y) {
  const std::vector<T> wt = taps_major(w, D, k);
  at::parallel_for(0, B * T_out, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t b = r / T_out, o = r % T_out;
      T* yr = y + r * D;
      if (bias) std::copy(bias, bias + D, yr);
      else std::fill(yr, yr + D, T(0));
      for (int64_t j = 0; j < k; ++j) {
        const int64_t t = o * s - (k - 1) + j;
        if (t < 0 || t >= T_in) continue;
        const T* xr = x + b * sb + t * st;
        const T* wj = wt.data() + j * D;
        for (int64_t c = 0; c < D; ++c) yr[c] += wj[c] * xr[c];
      }
    }
  });
}

// gx[b, t, :] = sum over taps j with t = c*s - (k-1) + j of w[:, j] * gy[b, c, :] (a gather,
// so rows are independent); gw[b, j, :] = sum_c x[b, c*s - (k-1) + j, :] * gy[b, c, :] per
// sequence (summed over b by the caller); gb likewise from gy.
template <typename T>
void conv_backward(const T* x, int64_t sb, int64_t st, const T* w, const T* gy, int64_t B,
                   int64_t T_in, int64_t T_out, int64_t D, int64_t k, int64_t s, T* gx, T* gw,
                   T* gb) {
  const std::vector<T> wt = taps_major(w, D, k);
  at::parallel_for(0, B * T_in, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t b = r / T_in, t = r % T_in;
      T* gr = gx + r * D;
      std::fill(gr, gr + D, T(0));
      for (int64_t j = 0; j < k; ++j) {
        const int64_t num = t + (k - 1) - j;  // = o * s for the output o that reads t at tap j
        if (num % s != 0) continue;
        const int64_t o = num / s;
        if (o >= T_out) continue;
        const T* g = gy + (b * T_out + o) * D;
        const T* wj = wt.data() + j * D;
        for (int64_t c = 0; c < D; ++c) gr[c] += wj[c] * g[c];
      }
    }
  });
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      T* gwb = gw + b * k * D;
      T* gbb = gb + b * D;
      std::fill(gwb, gwb + k * D, T(0));
      std::fill(gbb, gbb + D, T(0));
      for (int64_t o = 0; o < T_out; ++o) {
        const T* g = gy + (b * T_out + o) * D;
        for (int64_t c = 0; c < D; ++c) gbb[c] += g[c];
        for (int64_t j = 0; j < k; ++j) {
          const int64_t t = o * s - (k - 1) + j;
          if (t < 0 || t >= T_in) continue;
          const T* xr = x + b * sb + t * st;
          T* gwj = gwb + j * D;
          for (int64_t c = 0; c < D; ++c) gwj[c] += xr[c] * g[c];
        }
      }
    }
  });
}

void check(const Tensor& x, const Tensor& w, int64_t s) {
  TORCH_CHECK(x.dim() == 3 && x.device().is_cpu() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble),
              "causal_dwconv: x must be a (B, T, D) float32 or float64 CPU tensor");
  TORCH_CHECK(x.size(2) <= 1 || x.stride(2) == 1, "causal_dwconv: x's channels must be contiguous");
  TORCH_CHECK(w.dim() == 2 && w.size(0) == x.size(2) && w.size(1) >= 1 && w.is_contiguous() &&
                  w.scalar_type() == x.scalar_type(),
              "causal_dwconv: w must be a contiguous (D, k) tensor of x's dtype");
  TORCH_CHECK(s >= 1, "causal_dwconv: stride must be >= 1");
}

}  // namespace

Tensor causal_dwconv_forward(const Tensor& x, const Tensor& w, const Tensor& bias, int64_t s) {
  check(x, w, s);
  const int64_t B = x.size(0), T_in = x.size(1), D = x.size(2), k = w.size(1);
  const int64_t T_out = (T_in + s - 1) / s;
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == D && bias.is_contiguous() &&
                                    bias.scalar_type() == x.scalar_type()),
              "causal_dwconv: bias must be empty or a contiguous (D,) tensor of x's dtype");
  Tensor y = at::empty({B, T_out, D}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "causal_dwconv_forward", [&] {
    conv_forward<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), x.stride(1), w.data_ptr<scalar_t>(),
                           bias.numel() ? bias.data_ptr<scalar_t>() : nullptr, B, T_in, T_out, D,
                           k, s, y.data_ptr<scalar_t>());
  });
  return y;
}

// Returns (gx (B, T, D), gw (D, k), gb (D,)).
std::vector<Tensor> causal_dwconv_backward(const Tensor& x, const Tensor& w, const Tensor& gy_in,
                                           int64_t s) {
  check(x, w, s);
  const int64_t B = x.size(0), T_in = x.size(1), D = x.size(2), k = w.size(1);
  const int64_t T_out = (T_in + s - 1) / s;
  const Tensor gy = gy_in.contiguous();
  TORCH_CHECK(gy.dim() == 3 && gy.size(0) == B && gy.size(1) == T_out && gy.size(2) == D &&
                  gy.scalar_type() == x.scalar_type(),
              "causal_dwconv: grad_out must be (B, ceil(T / s), D) of x's dtype");
  Tensor gx = at::empty({B, T_in, D}, x.options());
  Tensor gw = at::empty({B, k, D}, x.options());
  Tensor gb = at::empty({B, D}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "causal_dwconv_backward", [&] {
    conv_backward<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), x.stride(1),
                            w.data_ptr<scalar_t>(), gy.data_ptr<scalar_t>(), B, T_in, T_out, D, k,
                            s, gx.data_ptr<scalar_t>(), gw.data_ptr<scalar_t>(),
                            gb.data_ptr<scalar_t>());
  });
  return {gx, gw.sum(0).t().contiguous(), gb.sum(0)};
}

// Shared by the HKT CPU kernels (hkt_cpu.cpp, hkt_decode.cpp): the BLAS GEMM that libtorch
// links and the row primitives (float32 vectorised with ATen's Vectorized, float64 plain).
#pragma once

#if !defined(CPU_CAPABILITY)
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    defined(__AVX512VL__)
#define CPU_CAPABILITY_AVX512
#define CPU_CAPABILITY AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY_AVX2
#define CPU_CAPABILITY AVX2
#endif
#endif

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

namespace {

// The Fortran BLAS that libtorch_cpu links (MKL in the x86 wheels, OpenBLAS elsewhere): the GEMM
// that PyTorch's own CPU flash attention runs. Called inside our parallel region it runs on one
// thread.
extern "C" {
void sgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k,
            const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
            const float* beta, float* c, const int* ldc);
void dgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k,
            const double* alpha, const double* a, const int* lda, const double* b,
            const int* ldb, const double* beta, double* c, const int* ldc);
}

inline void blas_gemm(const char* ta, const char* tb, const int* m, const int* n, const int* k,
                      const float* alpha, const float* a, const int* lda, const float* b,
                      const int* ldb, const float* beta, float* c, const int* ldc) {
  sgemm_(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
inline void blas_gemm(const char* ta, const char* tb, const int* m, const int* n, const int* k,
                      const double* alpha, const double* a, const int* lda, const double* b,
                      const int* ldb, const double* beta, double* c, const int* ldc) {
  dgemm_(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

// Row-major C (M x N) = alpha op(A) op(B) + beta C: the column-major product C^T = op(B)^T op(A)^T.
// op(A) is M x K; lda, ldb, ldc are row strides. Tiles are far below 2^31 elements.
template <typename T>
inline void mm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
               int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  const char opa = tb ? 'T' : 'N', opb = ta ? 'T' : 'N';
  const int m = static_cast<int>(N), n = static_cast<int>(M), k = static_cast<int>(K);
  const int la = static_cast<int>(ldb), lb = static_cast<int>(lda), lc = static_cast<int>(ldc);
  blas_gemm(&opa, &opb, &m, &n, &k, &alpha, B, &la, A, &lb, &beta, C, &lc);
}

// ---- row primitives (float32 vectorised, float64 plain) ---------------------------------------

// x[j] = w * x[j] + e[j] for j < n; returns max_j x[j] (-inf for n == 0).
template <typename T>
inline T axpy_max(T* x, const T* e, int64_t n, T w) {
  T mx = -std::numeric_limits<T>::infinity();
  for (int64_t j = 0; j < n; ++j) {
    x[j] = w * x[j] + e[j];
    mx = std::max(mx, x[j]);
  }
  return mx;
}

// x[j] = exp(x[j] - shift) for j < n; returns the sum.
template <typename T>
inline T exp_sum(T* x, int64_t n, T shift) {
  T sum = 0;
  for (int64_t j = 0; j < n; ++j) {
    x[j] = std::exp(x[j] - shift);
    sum += x[j];
  }
  return sum;
}

// p[j] = exp(w * x[j] + e[j] - shift) for j < n.
template <typename T>
inline void exp_affine(T* p, const T* x, const T* e, int64_t n, T w, T shift) {
  for (int64_t j = 0; j < n; ++j) p[j] = std::exp(w * x[j] + e[j] - shift);
}

// r[j] = p[j] * (r[j] - delta) (r holds dP on entry, dS on exit); returns sum_j r[j] * f[j].
template <typename T>
inline T ds_dot(T* r, const T* p, const T* f, int64_t n, T delta) {
  T dot = 0;
  for (int64_t j = 0; j < n; ++j) {
    r[j] = p[j] * (r[j] - delta);
    dot += r[j] * f[j];
  }
  return dot;
}

// sum_j x[j] * y[j] for j < n.
template <typename T>
inline T dot(const T* x, const T* y, int64_t n) {
  T acc = 0;
  for (int64_t j = 0; j < n; ++j) acc += x[j] * y[j];
  return acc;
}

// acc[j] += x[j] for j < n.
template <typename T>
inline void add_to(T* acc, const T* x, int64_t n) {
  for (int64_t j = 0; j < n; ++j) acc[j] += x[j];
}

using fVec = at::vec::Vectorized<float>;

// Horizontal sum and maximum of a vector's lanes.
inline float hsum(const fVec& v) {
  return at::vec::vec_reduce_all<float>([](const fVec& a, const fVec& b) { return a + b; }, v);
}
inline float hmax(const fVec& v) {
  return at::vec::vec_reduce_all<float>(
      [](const fVec& a, const fVec& b) { return at::vec::maximum(a, b); }, v);
}

template <>
inline float axpy_max<float>(float* x, const float* e, int64_t n, float w) {
  const int64_t V = fVec::size();
  fVec vw(w), vmax(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + V <= n; j += V) {
    fVec r = at::vec::fmadd(vw, fVec::loadu(x + j), fVec::loadu(e + j));
    r.store(x + j);
    vmax = at::vec::maximum(vmax, r);
  }
  float mx = -std::numeric_limits<float>::infinity();
  if (j > 0) {
    mx = hmax(vmax);
  }
  for (; j < n; ++j) {
    x[j] = w * x[j] + e[j];
    mx = std::max(mx, x[j]);
  }
  return mx;
}

template <>
inline float exp_sum<float>(float* x, int64_t n, float shift) {
  const int64_t V = fVec::size();
  fVec vs(shift), vsum(0.f);
  int64_t j = 0;
  for (; j + V <= n; j += V) {
    fVec p = (fVec::loadu(x + j) - vs).exp_u20();
    p.store(x + j);
    vsum = vsum + p;
  }
  float sum = 0.f;
  if (j > 0) {
    sum = hsum(vsum);
  }
  for (; j < n; ++j) {
    x[j] = std::exp(x[j] - shift);
    sum += x[j];
  }
  return sum;
}

template <>
inline void exp_affine<float>(float* p, const float* x, const float* e, int64_t n, float w,
                              float shift) {
  const int64_t V = fVec::size();
  fVec vw(w), vs(shift);
  int64_t j = 0;
  for (; j + V <= n; j += V) {
    fVec r = at::vec::fmadd(vw, fVec::loadu(x + j), fVec::loadu(e + j)) - vs;
    r.exp_u20().store(p + j);
  }
  for (; j < n; ++j) p[j] = std::exp(w * x[j] + e[j] - shift);
}

template <>
inline float ds_dot<float>(float* r, const float* p, const float* f, int64_t n, float delta) {
  const int64_t V = fVec::size();
  fVec vd(delta), vdot(0.f);
  int64_t j = 0;
  for (; j + V <= n; j += V) {
    fVec ds = fVec::loadu(p + j) * (fVec::loadu(r + j) - vd);
    ds.store(r + j);
    vdot = at::vec::fmadd(ds, fVec::loadu(f + j), vdot);
  }
  float acc = j > 0 ? hsum(vdot) : 0.f;
  for (; j < n; ++j) {
    r[j] = p[j] * (r[j] - delta);
    acc += r[j] * f[j];
  }
  return acc;
}

template <>
inline float dot<float>(const float* x, const float* y, int64_t n) {
  const int64_t V = fVec::size();
  fVec vacc(0.f);
  int64_t j = 0;
  for (; j + V <= n; j += V) vacc = at::vec::fmadd(fVec::loadu(x + j), fVec::loadu(y + j), vacc);
  float acc = j > 0 ? hsum(vacc) : 0.f;
  for (; j < n; ++j) acc += x[j] * y[j];
  return acc;
}

template <>
inline void add_to<float>(float* acc, const float* x, int64_t n) {
  const int64_t V = fVec::size();
  int64_t j = 0;
  for (; j + V <= n; j += V) (fVec::loadu(acc + j) + fVec::loadu(x + j)).store(acc + j);
  for (; j < n; ++j) acc[j] += x[j];
}

// dst[b] += sum of x[b*s .. b*s+s) (ragged last group), for the column groups of a row.
template <typename T>
inline void add_groups(T* dst, const T* x, int64_t n, int64_t s) {
  if (s == 2) {
    int64_t b = 0;
    for (; 2 * b + 1 < n; ++b) dst[b] += x[2 * b] + x[2 * b + 1];
    if (2 * b < n) dst[b] += x[2 * b];
    return;
  }
  for (int64_t b = 0, j = 0; j < n; ++b) {
    T acc = 0;
    for (const int64_t je = std::min(j + s, n); j < je; ++j) acc += x[j];
    dst[b] += acc;
  }
}

// dst[j] = src[j / s] for j < n: a row of a coarse grid repeated over its column blocks.
template <typename T>
inline void expand_cols(T* dst, const T* src, int64_t n, int64_t s) {
  for (int64_t b = 0, j = 0; j < n; ++b) {
    const T val = src[b];
    for (const int64_t je = std::min(j + s, n); j < je; ++j) dst[j] = val;
  }
}

template <>
inline void expand_cols<float>(float* dst, const float* src, int64_t n, int64_t s) {
  const int64_t V = fVec::size();
  int64_t j = 0;
  if (s == 2) {
    for (; j + 2 * V <= n; j += 2 * V) {
      const fVec x = fVec::loadu(src + j / 2);
      const auto dup = at::vec::interleave2<float>(x, x);
      dup.first.store(dst + j);
      dup.second.store(dst + j + V);
    }
  }
  for (; j < n; ++j) dst[j] = src[j / s];
}

template <>
inline void add_groups<float>(float* dst, const float* x, int64_t n, int64_t s) {
  if (s != 2) {
    for (int64_t b = 0, j = 0; j < n; ++b) {
      float acc = 0.f;
      for (const int64_t je = std::min(j + s, n); j < je; ++j) acc += x[j];
      dst[b] += acc;
    }
    return;
  }
  const int64_t V = fVec::size();
  int64_t j = 0;
  for (; j + 2 * V <= n; j += 2 * V) {
    const auto eo = at::vec::deinterleave2<float>(fVec::loadu(x + j), fVec::loadu(x + j + V));
    (fVec::loadu(dst + j / 2) + eo.first + eo.second).store(dst + j / 2);
  }
  for (; j < n; ++j) dst[j / 2] += x[j];
}

}  // namespace

// Linear layers, y[M, N] = x[M, K] @ W[N, K]^T, with one fixed arithmetic per output.
//
// Why our own: a row's result must not depend on how many rows share the call (or a
// request's tokens would depend on its batch), and oneDNN picks its kernel by M (its one-row
// kernel adds in another order than the rest). Here every output is one accumulator walked
// over K in order, whatever M, whatever tile the row falls in, whatever thread computes it:
//   bfloat16: acc = 0; for i = 0..K/2-1: acc = mac(x[2i+1], w[2i+1], acc);
//             acc = mac(x[2i], w[2i], acc)  (VDPBF16PS's pair step); y = acc rounded
//   float32:  acc = 0; for k = 0..K-1: acc = fma(x[k], w[k], acc); y = acc
// The weights are packed once into panels of 64 outputs, [N/64][K/P][64][P] (P = 2 for
// bfloat16 pairs), so a panel streams from memory in order; an AVX-512 micro-kernel holds up
// to 6 rows x 64 outputs in registers (4 rows for bfloat16 without AVX-512 BF16, whose pair
// step takes two FMAs), an AVX2 one (CPUs without AVX-512) 3 rows x 32, and a portable one
// follows the same arithmetic. A decode step's few rows stream each weight once, faster than
// oneDNN's small-M kernels here (docs/decisions.md). Threads split the panels: an output is
// always one thread's. ``linear_path`` names the micro-kernel a dtype runs on this build.

#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "numerics.h"

namespace {
using namespace prefix_serve;

constexpr int64_t kPanel = 64;  // outputs per panel: 4 vectors of 16
constexpr int kMaxRows = 6;     // rows one micro-kernel call holds (24 accumulators)

template <typename T> constexpr int64_t pack_of() { return Traits<T>::pack; }

// ---- portable: the arithmetic, output by output ----

template <typename T>
void panel_portable(const T* x, int64_t ldx, const T* w, int64_t K, T* y, int64_t ldy,
                    int64_t rows, int64_t cols) {
  constexpr int64_t P = pack_of<T>();
  using A = typename Traits<T>::Acc;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      A acc = 0;
      for (int64_t i = 0; i < K / P; ++i) {
        for (int64_t e = P - 1; e >= 0; --e) {
          const A wv = widen(w[(i * kPanel + c) * P + e]);
          acc = Traits<T>::mac(widen(x[r * ldx + i * P + e]), wv, acc);
        }
      }
      y[r * ldy + c] = static_cast<T>(acc);
    }
  }
}

// ---- AVX-512 micro-kernels: MR rows x 64 outputs ----
// Each has ``rows`` (the most it holds in registers), ``flushes`` (whether panel_avx512 must
// set MXCSR's DAZ and FTZ around it) and ``path`` (its name for linear_path).
#if defined(__AVX512F__)

template <typename T> struct Micro { static constexpr bool enabled = false; };

#if defined(__AVX512BF16__)
template <> struct Micro<c10::BFloat16> {
  static constexpr bool enabled = true, flushes = false;  // VDPBF16PS flushes by itself
  static constexpr int rows = kMaxRows;
  static constexpr const char* path = "avx512_bf16";
  using T = c10::BFloat16;
  template <int MR>
  static void run(const T* x, int64_t ldx, const T* w, int64_t K, T* y, int64_t ldy,
                  int64_t cols) {
    __m512 acc[MR][4];
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < K / 2; ++i) {
      const T* wi = w + i * kPanel * 2;
      _mm_prefetch(reinterpret_cast<const char*>(wi + 64 * kPanel * 2), _MM_HINT_T0);
      __m512i wv[4];
      for (int j = 0; j < 4; ++j) wv[j] = _mm512_loadu_si512(wi + j * 32);
      for (int r = 0; r < MR; ++r) {
        int32_t pair;
        std::memcpy(&pair, x + r * ldx + 2 * i, sizeof(pair));
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
        for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)wv[j], xv);
      }
    }
    for (int r = 0; r < MR; ++r) {
      for (int j = 0; j < 4 && j * 16 < cols; ++j) {
        const int64_t left = cols - j * 16;
        const __mmask16 m = static_cast<__mmask16>(left >= 16 ? 0xFFFFu : (1u << left) - 1u);
        _mm256_mask_storeu_epi16(y + r * ldy + j * 16, m, (__m256i)_mm512_cvtneps_pbh(acc[r][j]));
      }
    }
  }
};
#else
// AVX-512F without AVX-512 BF16 (Skylake-SP to Ice Lake): VDPBF16PS's pair step as two FMAs,
// odd element first, its flushes done by MXCSR's DAZ and FTZ (flushes). The same arithmetic
// as the instruction, the AVX2 kernel and the portable code, not a faster one of its own: a
// bfloat16 model then gives one set of bits whichever of them runs it, and the portable code
// stays every path's reference. 4 rows: 16 accumulators, a weight vector's two halves and
// the rows' broadcasts fit the 32 registers (6 rows would spill).
template <> struct Micro<c10::BFloat16> {
  static constexpr bool enabled = true, flushes = true;
  static constexpr int rows = 4;
  static constexpr const char* path = "avx512";
  using T = c10::BFloat16;
  template <int MR>
  static void run(const T* x, int64_t ldx, const T* w, int64_t K, T* y, int64_t ldy,
                  int64_t cols) {
    // the rows widened to float once a call, so that a step's broadcasts are plain loads
    thread_local std::vector<float> wide;
    wide.resize(static_cast<size_t>(MR * K));
    for (int r = 0; r < MR; ++r) widen_row(x + r * ldx, K, wide.data() + r * K);
    __m512 acc[MR][4];
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < K / 2; ++i) {
      const T* wi = w + i * kPanel * 2;
      _mm_prefetch(reinterpret_cast<const char*>(wi + 64 * kPanel * 2), _MM_HINT_T0);
      const float* xi = wide.data() + 2 * i;
      for (int j = 0; j < 4; ++j) {
        const __m512i pairs = _mm512_loadu_si512(wi + j * 32);
        const __m512 wo = odd16(pairs), we = even16(pairs);
        for (int r = 0; r < MR; ++r) {
          acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(xi[r * K + 1]), wo, acc[r][j]);
          acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(xi[r * K]), we, acc[r][j]);
        }
      }
    }
    for (int r = 0; r < MR; ++r) {  // rounded as the portable code rounds (c10's nearest even)
      alignas(64) float out[kPanel];
      for (int j = 0; j < 4; ++j) _mm512_store_ps(out + 16 * j, acc[r][j]);
      for (int64_t c = 0; c < cols; ++c) y[r * ldy + c] = static_cast<T>(out[c]);
    }
  }
  static void widen_row(const T* x, int64_t K, float* out) {
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) _mm512_storeu_ps(out + k, widen16(x + k));
    for (; k < K; ++k) out[k] = widen(x[k]);
  }
};
#endif

template <> struct Micro<float> {
  static constexpr bool enabled = true, flushes = false;
  static constexpr int rows = kMaxRows;
  static constexpr const char* path = "avx512";
  template <int MR>
  static void run(const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy,
                  int64_t cols) {
    __m512 acc[MR][4];
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
      const float* wk = w + k * kPanel;
      _mm_prefetch(reinterpret_cast<const char*>(wk + 32 * kPanel), _MM_HINT_T0);
      __m512 wv[4];
      for (int j = 0; j < 4; ++j) wv[j] = _mm512_loadu_ps(wk + j * 16);
      for (int r = 0; r < MR; ++r) {
        const __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
        for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
      }
    }
    for (int r = 0; r < MR; ++r) {
      for (int j = 0; j < 4 && j * 16 < cols; ++j) {
        const int64_t left = cols - j * 16;
        const __mmask16 m = static_cast<__mmask16>(left >= 16 ? 0xFFFFu : (1u << left) - 1u);
        _mm512_mask_storeu_ps(y + r * ldy + j * 16, m, acc[r][j]);
      }
    }
  }
};

template <typename T>
void panel_avx512(const T* x, int64_t ldx, const T* w, int64_t K, T* y, int64_t ldy,
                  int64_t rows, int64_t cols) {
  using U = Micro<T>;
  const FlushDenormals daz(U::flushes);  // this thread's MXCSR, restored on return
  int64_t r = 0;
  for (; r + U::rows <= rows; r += U::rows) {
    U::template run<U::rows>(x + r * ldx, ldx, w, K, y + r * ldy, ldy, cols);
  }
  switch (rows - r) {
    case 1: return U::template run<1>(x + r * ldx, ldx, w, K, y + r * ldy, ldy, cols);
    case 2: return U::template run<2>(x + r * ldx, ldx, w, K, y + r * ldy, ldy, cols);
    case 3: return U::template run<3>(x + r * ldx, ldx, w, K, y + r * ldy, ldy, cols);
    case 4: return U::template run<4>(x + r * ldx, ldx, w, K, y + r * ldy, ldy, cols);
    case 5: return U::template run<5>(x + r * ldx, ldx, w, K, y + r * ldy, ldy, cols);
    default: return;
  }
}
#endif

// ---- AVX2 + FMA micro-kernels (no AVX-512): MR rows x 32 outputs, half a panel a call ----
// The same arithmetic output by output: float32 one FMA per k; bfloat16 the pair step, whose
// flushes (subnormal inputs read as zero, subnormal results flushed) the CPU does for free
// with MXCSR's DAZ and FTZ set, as VDPBF16PS does them (the portable code writes them out).
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define PREFIX_SERVE_AVX2 1

template <typename T> struct Micro2 { static constexpr bool enabled = false; };

template <typename T, int MR>
void store_half(const __m256 (&acc)[MR][4], T* y, int64_t ldy, int64_t cols) {
  for (int r = 0; r < MR; ++r) {
    alignas(32) float out[32];
    for (int j = 0; j < 4; ++j) _mm256_store_ps(out + 8 * j, acc[r][j]);
    for (int64_t c = 0; c < cols; ++c) y[r * ldy + c] = static_cast<T>(out[c]);
  }
}

template <> struct Micro2<float> {
  static constexpr bool enabled = true;
  template <int MR>
  static void run(const float* x, int64_t ldx, const float* w, int64_t K, float* y,
                  int64_t ldy, int64_t cols) {
    __m256 acc[MR][4];
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
      const float* wk = w + k * kPanel;
      for (int j = 0; j < 4; ++j) {
        const __m256 wv = _mm256_loadu_ps(wk + j * 8);
        for (int r = 0; r < MR; ++r)
          acc[r][j] = _mm256_fmadd_ps(_mm256_set1_ps(x[r * ldx + k]), wv, acc[r][j]);
      }
    }
    store_half<float, MR>(acc, y, ldy, cols);
  }
};

template <> struct Micro2<c10::BFloat16> {
  static constexpr bool enabled = true;
  using T = c10::BFloat16;
  template <int MR>
  static void run(const T* x, int64_t ldx, const T* w, int64_t K, T* y, int64_t ldy,
                  int64_t cols) {
    __m256 acc[MR][4];
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
    const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
    for (int64_t i = 0; i < K / 2; ++i) {
      __m256 odd[MR], even[MR];
      for (int r = 0; r < MR; ++r) {
        odd[r] = _mm256_set1_ps(widen(x[r * ldx + 2 * i + 1]));
        even[r] = _mm256_set1_ps(widen(x[r * ldx + 2 * i]));
      }
      const T* wi = w + i * kPanel * 2;
      for (int j = 0; j < 4; ++j) {
        const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wi + j * 16));
        const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(pairs, high));
        const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
        for (int r = 0; r < MR; ++r) {
          acc[r][j] = _mm256_fmadd_ps(odd[r], wo, acc[r][j]);
          acc[r][j] = _mm256_fmadd_ps(even[r], we, acc[r][j]);
        }
      }
    }
    store_half<T, MR>(acc, y, ldy, cols);
  }
};

constexpr int kMaxRows2 = 3;

// A panel as two halves of 32 outputs (the registers hold 3 rows x 32, not x 64).
template <typename T>
void panel_avx2(const T* x, int64_t ldx, const T* w, int64_t K, T* y, int64_t ldy,
                int64_t rows, int64_t cols) {
  using U = Micro2<T>;
  constexpr int64_t P = pack_of<T>();
  const FlushDenormals daz(P == 2);  // this thread's MXCSR, restored on return
  for (int64_t half = 0; half * 32 < cols; ++half) {
    const T* wh = w + half * 32 * P;
    T* yh = y + half * 32;
    const int64_t n = std::min<int64_t>(32, cols - half * 32);
    int64_t r = 0;
    for (; r + kMaxRows2 <= rows; r += kMaxRows2)
      U::template run<kMaxRows2>(x + r * ldx, ldx, wh, K, yh + r * ldy, ldy, n);
    if (rows - r == 2) U::template run<2>(x + r * ldx, ldx, wh, K, yh + r * ldy, ldy, n);
    if (rows - r == 1) U::template run<1>(x + r * ldx, ldx, wh, K, yh + r * ldy, ldy, n);
  }
}
#endif

template <typename T>
void panel(const T* x, int64_t ldx, const T* w, int64_t K, T* y, int64_t ldy, int64_t rows,
           int64_t cols, bool vector) {
#if defined(__AVX512F__)
  if constexpr (Micro<T>::enabled) {
    if (vector) return panel_avx512<T>(x, ldx, w, K, y, ldy, rows, cols);
  }
#elif defined(PREFIX_SERVE_AVX2)
  if constexpr (Micro2<T>::enabled) {
    if (vector) return panel_avx2<T>(x, ldx, w, K, y, ldy, rows, cols);
  }
#endif
  panel_portable<T>(x, ldx, w, K, y, ldy, rows, cols);
}

// float64 is refused: its matrix products are not row-invariant (see the README)
template <typename Fn>
void dispatch_linear(at::ScalarType type, const char* name, const Fn& fn) {
  switch (type) {
    case at::kFloat: fn(float{}); break;
    case at::kBFloat16: fn(c10::BFloat16{}); break;
    default: TORCH_CHECK(false, name, ": bfloat16 or float32 only, not ", type);
  }
}

// A bfloat16 weight's subnormal as zero of its sign, as every path's pair step reads it
// (float32 weights are kept: their FMA flushes nothing).
inline float flushed(float w) { return w; }
inline c10::BFloat16 flushed(c10::BFloat16 w) {
  return std::fabs(widen(w)) < FLT_MIN ? c10::BFloat16(flush(widen(w))) : w;
}

// [N, K] -> [ceil(N/64), K/P, 64, P], zero-padded to whole panels
at::Tensor pack_linear(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "pack_linear: a contiguous [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1), panels = (N + kPanel - 1) / kPanel;
  at::Tensor out;
  dispatch_linear(weight.scalar_type(), "pack_linear", [&](auto zero) {
    using T = decltype(zero);
    constexpr int64_t P = pack_of<T>();
    TORCH_CHECK(K % P == 0, "pack_linear: K must be a multiple of ", P);
    out = at::zeros({panels, K / P, kPanel, P}, weight.options());
    const T* src = weight.data_ptr<T>();
    T* dst = out.data_ptr<T>();
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k)
        dst[(((n / kPanel) * (K / P) + k / P) * kPanel + n % kPanel) * P + k % P] =
            flushed(src[n * K + k]);
  });
  return out;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                  bool vector) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "linear: x must be [rows, K], rows dense");
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous(), "linear: a packed weight");
  TORCH_CHECK(x.scalar_type() == packed.scalar_type(), "linear: x and weight share a dtype");
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0);
  TORCH_CHECK(packed.size(1) * packed.size(3) == K, "linear: x's width is not the weight's K");
  TORCH_CHECK(out_features <= panels * kPanel, "linear: more outputs than the weight has");
  at::Tensor y = at::empty({M, out_features}, x.options());
  dispatch_linear(x.scalar_type(), "linear", [&](auto zero) {
    using T = decltype(zero);
    const T* xp = x.data_ptr<T>();
    const T* wp = packed.data_ptr<T>();
    T* yp = y.data_ptr<T>();
    const int64_t ldx = x.stride(0), panel_size = K * kPanel;
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const int64_t cols = std::min<int64_t>(kPanel, out_features - p * kPanel);
        panel<T>(xp, ldx, wp + p * panel_size, K, yp + p * kPanel, out_features, M, cols,
                 vector);
      }
    });
  });
  return y;
}

template <typename T> const char* path_of() {
#if defined(__AVX512F__)
  if constexpr (Micro<T>::enabled) return Micro<T>::path;
#elif defined(PREFIX_SERVE_AVX2)
  if constexpr (Micro2<T>::enabled) return "avx2";
#endif
  return "portable";
}

// The micro-kernel a dtype's linear runs with vector=True on this build: "avx512_bf16"
// (VDPBF16PS), "avx512", "avx2" or "portable" (tests check that none falls back silently).
std::string linear_path(at::ScalarType dtype) {
  std::string out;
  dispatch_linear(dtype, "linear_path", [&](auto zero) { out = path_of<decltype(zero)>(); });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(prefix_serve, m) {
  m.def("pack_linear(Tensor weight) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, int out_features, bool vector=True) -> Tensor");
  m.def("linear_path(ScalarType dtype) -> str", &linear_path);
}

TORCH_LIBRARY_IMPL(prefix_serve, CPU, m) {
  m.impl("pack_linear", &pack_linear);
  m.impl("linear", &linear);
}

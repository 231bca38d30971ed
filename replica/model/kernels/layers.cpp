// The small per-row steps of a decoder layer, fused: RMSNorm (with the residual add before
// it), SwiGLU's SiLU-times-up, and rotary embedding in place. Each replaces a chain of 4-8
// torch ops (one pass over memory instead of several, one dispatch instead of several) and
// computes what Hugging Face's Llama computes in the model's dtype: every bfloat16 op of the
// reference rounds to bfloat16 here too, at the same point. Every row is computed on its own
// with one fixed order (sums of squares in 16 lanes, then lanes added in a fixed tree), so a
// row's result never depends on how many rows share the call. The references are in
// replica/model/llama.py; tests compare the two.

#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <cstdint>
#include <vector>

#include "numerics.h"

namespace {
using namespace prefix_serve;

inline float round_to(float x, const c10::BFloat16*) { return widen(c10::BFloat16(x)); }
inline float round_to(float x, const float*) { return x; }
inline double round_to(double x, const double*) { return x; }

template <typename T> inline void store(T* p, typename Traits<T>::Acc x) {
  *p = static_cast<T>(x);
}

// out = round(round(x * r) * w), r = 1 / sqrt(mean(x^2) + eps), as RMSNorm in float32 and
// its scale in the model's dtype
template <typename T>
void norm_row(const T* x, const T* w, T* out, int64_t n, double eps) {
  using A = typename Traits<T>::Acc;
  A lanes[kLanes] = {};
  for (int64_t i = 0; i < n; i += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) {
      const A v = i + l < n ? widen(x[i + l]) : A(0);
      lanes[l] = lanes[l] + v * v;
    }
  }
  const A r = A(1) / std::sqrt(tree16(lanes) / static_cast<A>(n) + static_cast<A>(eps));
  for (int64_t i = 0; i < n; ++i) {
    const A normed = round_to(widen(x[i]) * r, x);
    store(out + i, round_to(normed * widen(w[i]), x));
  }
}

template <typename Fn> void over_rows(int64_t rows, int64_t width, const Fn& fn) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) fn(r);
  });
}

void check_rows(const at::Tensor& x, const at::Tensor& w, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, ": x must be [rows, width], rows dense");
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(1), name, ": weight");
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), name, ": x and weight share a dtype");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, weight, "rms_norm");
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  dispatch(x.scalar_type(), "rms_norm", [&](auto zero) {
    using T = decltype(zero);
    const T* xp = x.data_ptr<T>();
    const T* wp = weight.data_ptr<T>();
    T* op = out.data_ptr<T>();
    const int64_t n = x.size(1), stride = x.stride(0);
    over_rows(x.size(0), n, [&](int64_t r) { norm_row(xp + r * stride, wp, op + r * n, n, eps); });
  });
  return out;
}

// residual += x (rounded to the dtype), in place; returns RMSNorm(residual)
at::Tensor add_rms_norm(at::Tensor residual, const at::Tensor& x, const at::Tensor& weight,
                        double eps) {
  check_rows(residual, weight, "add_rms_norm");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.stride(1) == 1, "add_rms_norm: x like residual");
  TORCH_CHECK(x.scalar_type() == residual.scalar_type(), "add_rms_norm: one dtype");
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  dispatch(x.scalar_type(), "add_rms_norm", [&](auto zero) {
    using T = decltype(zero);
    T* rp = residual.data_ptr<T>();
    const T* xp = x.data_ptr<T>();
    const T* wp = weight.data_ptr<T>();
    T* op = out.data_ptr<T>();
    const int64_t n = x.size(1), rs = residual.stride(0), xs = x.stride(0);
    over_rows(x.size(0), n, [&](int64_t r) {
      T* row = rp + r * rs;
      for (int64_t i = 0; i < n; ++i) store(row + i, widen(row[i]) + widen(xp[r * xs + i]));
      norm_row(row, wp, op + r * n, n, eps);
    });
  });
  return out;
}

// SiLU(x) = x * sigmoid(x), sigmoid from exp(-|x|) <= 1 (exp_spec's domain) on both sides
inline float silu(float x) {
  const float e = exp_spec(-std::fabs(x));
  const float s = x >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
  return x * s;
}
inline double silu(double x) { return x / (1.0 + std::exp(-x)); }

template <typename T>
void silu_mul_row(const T* gate, const T* up, T* out, int64_t width) {
  for (int64_t i = 0; i < width; ++i) {
    store(out + i, round_to(silu(widen(gate[i])), gate) * widen(up[i]));
  }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
inline __m512 load_bf16(const c10::BFloat16* p, __mmask16 m) {
  const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 round_bf16(__m512 x) {  // to bfloat16 (nearest even) and back: exact widening
  const __m256i b = (__m256i)_mm512_cvtneps_pbh(x);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

// silu_mul_row for bfloat16, 16 lanes at a time: the same operations lane by lane
template <>
void silu_mul_row(const c10::BFloat16* gate, const c10::BFloat16* up, c10::BFloat16* out,
                  int64_t width) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < width; i += kLanes) {
    const __mmask16 m = static_cast<__mmask16>(
        width - i >= kLanes ? 0xFFFFu : (1u << (width - i)) - 1u);
    const __m512 x = load_bf16(gate + i, m);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
    const __mmask16 positive = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ);
    const __m512 num = _mm512_mask_blend_ps(positive, e, one);
    const __m512 s = _mm512_div_ps(num, _mm512_add_ps(one, e));
    const __m512 y = _mm512_mul_ps(round_bf16(_mm512_mul_ps(x, s)), load_bf16(up + i, m));
    _mm256_mask_storeu_epi16(out + i, m, (__m256i)_mm512_cvtneps_pbh(y));
  }
}
#endif

#if !(defined(__AVX512F__) && defined(__AVX512BF16__)) && defined(__AVX2__) && defined(__FMA__)
// Eight bfloat16 as floats (exact), and floats to bfloat16 bits (nearest even, NaN quiet),
// as c10::BFloat16 rounds.
inline __m256 load8_bf16(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256i bf16_bits8(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
}
inline __m256 round8_bf16(__m256 x) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(x), 16));
}

// silu_mul_row for bfloat16, 8 lanes at a time (the rest one by one): the same operations
template <>
void silu_mul_row(const c10::BFloat16* gate, const c10::BFloat16* up, c10::BFloat16* out,
                  int64_t width) {
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  int64_t i = 0;
  for (; i + 8 <= width; i += 8) {
    const __m256 x = load8_bf16(gate + i);
    const __m256 e = exp8(_mm256_sub_ps(zero, _mm256_and_ps(x, magnitude)));
    const __m256 positive = _mm256_cmp_ps(x, zero, _CMP_GE_OQ);
    const __m256 s = _mm256_div_ps(_mm256_blendv_ps(e, one, positive), _mm256_add_ps(one, e));
    const __m256 y = _mm256_mul_ps(round8_bf16(_mm256_mul_ps(x, s)), load8_bf16(up + i));
    alignas(32) int32_t bits[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(bits), bf16_bits8(y));
    for (int l = 0; l < 8; ++l) out[i + l].x = static_cast<uint16_t>(bits[l]);
  }
  for (; i < width; ++i) store(out + i, round_to(silu(widen(gate[i])), gate) * widen(up[i]));
}
#endif

// [rows, 2I] (gate, up) -> [rows, I]: round(round(silu(gate)) * up)
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be [rows, 2 x width], rows dense");
  const int64_t width = gate_up.size(1) / 2;
  at::Tensor out = at::empty({gate_up.size(0), width}, gate_up.options());
  dispatch(gate_up.scalar_type(), "silu_mul", [&](auto zero) {
    using T = decltype(zero);
    const T* gp = gate_up.data_ptr<T>();
    T* op = out.data_ptr<T>();
    const int64_t stride = gate_up.stride(0);
    over_rows(gate_up.size(0), width, [&](int64_t r) {
      const T* gate = gp + r * stride;
      silu_mul_row(gate, gate + width, op + r * width, width);
    });
  });
  return out;
}

// In place: x[t, h] = round(round(x * cos[t]) + round(rotate_half(x) * sin[t])), where
// rotate_half(x) = (-x2, x1) for the halves (x1, x2); cos and sin in x's dtype, [tokens, dim]
void rope(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rope: x must be [tokens, heads, dim]");
  TORCH_CHECK(cos.dim() == 2 && cos.is_contiguous() && sin.is_contiguous(), "rope: cos, sin");
  TORCH_CHECK(cos.size(0) == x.size(0) && cos.size(1) == x.size(2) && sin.sizes() == cos.sizes(),
              "rope: one cos and sin row of dim per token");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rope: one dtype");
  const int64_t heads = x.size(1), dim = x.size(2), half = dim / 2;
  dispatch(x.scalar_type(), "rope", [&](auto zero) {
    using T = decltype(zero);
    using A = typename Traits<T>::Acc;
    T* xp = x.data_ptr<T>();
    const T* cp = cos.data_ptr<T>();
    const T* sp = sin.data_ptr<T>();
    const int64_t ts = x.stride(0), hs = x.stride(1);
    over_rows(x.size(0), heads * dim, [&](int64_t t) {
      std::vector<A> row(static_cast<size_t>(dim));
      for (int64_t h = 0; h < heads; ++h) {
        T* v = xp + t * ts + h * hs;
        for (int64_t i = 0; i < dim; ++i) {
          const A rot = i < half ? -widen(v[i + half]) : widen(v[i - half]);
          const A a = round_to(widen(v[i]) * widen(cp[t * dim + i]), v);
          const A b = round_to(rot * widen(sp[t * dim + i]), v);
          row[i] = a + b;
        }
        for (int64_t i = 0; i < dim; ++i) store(v + i, row[i]);
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(prefix_serve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) residual, Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rope(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
}

TORCH_LIBRARY_IMPL(prefix_serve, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rope", &rope);
}

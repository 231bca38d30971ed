// Numerics the engine's kernels share: widening bfloat16, rounding to the model's dtype, the
// one exp every kernel uses, and VDPBF16PS's product-add step written portably. Everything
// here is exact or fixed: no compiler-chosen contraction (the build uses -ffp-contract=off).
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace prefix_serve {

// Calls ``fn`` with a zero of the C++ type of ``type`` (float32, float64 or bfloat16).
template <typename Fn> void dispatch(at::ScalarType type, const char* name, const Fn& fn) {
  switch (type) {
    case at::kFloat: fn(float{}); break;
    case at::kDouble: fn(double{}); break;
    case at::kBFloat16: fn(c10::BFloat16{}); break;
    default: TORCH_CHECK(false, name, ": unsupported dtype ", type);
  }
}


// A subnormal float as zero of the same sign (what VDPBF16PS does to its inputs and results).
inline float flush(float x) { return std::fabs(x) < FLT_MIN ? std::copysign(0.0f, x) : x; }

template <typename T> struct Traits {
  using Acc = float;
  static constexpr int pack = 1;
  static float mac(float a, float b, float acc) { return std::fma(a, b, acc); }
};
template <> struct Traits<double> {
  using Acc = double;
  static constexpr int pack = 1;
  static double mac(double a, double b, double acc) { return std::fma(a, b, acc); }
};
template <> struct Traits<c10::BFloat16> {
  using Acc = float;
  static constexpr int pack = 2;
  // one product-add step of VDPBF16PS: subnormal inputs read as zero, subnormal results
  // flushed (checked against the instruction bit for bit by a test)
  static float mac(float a, float b, float acc) {
    return flush(std::fma(flush(a), flush(b), flush(acc)));
  }
};

inline float widen(float x) { return x; }
inline double widen(double x) { return x; }
inline float widen(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;  // exact
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// A weight as the value products see it: rounded to the model's dtype (nearest even).
inline float to_weight(float p, const c10::BFloat16*) { return widen(c10::BFloat16(p)); }
inline float to_weight(float p, const float*) { return p; }
inline double to_weight(double p, const double*) { return p; }

// E(x), exp for x <= 0 (every argument here is a score minus a running maximum):
// 2^n * p(r), r = x - n ln2, p of degree 6 (relative error ~2e-7); 0 below -87, so no result
// is subnormal.
constexpr float kExpLow = -87.0f;
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = -0.693359375f, kLn2Lo = 2.12194440e-4f;
constexpr float kP0 = 1.3981999507e-3f, kP1 = 8.3334519073e-3f, kP2 = 4.1665795894e-2f,
                kP3 = 1.6666665459e-1f, kP4 = 5.0000001201e-1f;

inline float exp_spec(float x) {
  const float xc = x < kExpLow ? kExpLow : x;
  const float n = std::floor(std::fma(xc, kLog2e, 0.5f));
  float r = std::fma(n, kLn2Hi, xc);
  r = std::fma(n, kLn2Lo, r);
  float p = std::fma(kP0, r, kP1);
  p = std::fma(p, r, kP2);
  p = std::fma(p, r, kP3);
  p = std::fma(p, r, kP4);
  p = std::fma(p, r * r, r) + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < kExpLow ? 0.0f : p * scale;
}

inline double exp_spec(double x) { return x < -700.0 ? 0.0 : std::exp(x); }


constexpr int kLanes = 16;  // lanes of a float vector (AVX-512), and keys per attention unit

// Sixteen lanes added in a fixed tree: (l, l+8), (l, l+4), (l, l+2), (0, 1).
template <typename A> inline A tree16(const A* p) {
  A t8[8], t4[4];
  for (int i = 0; i < 8; ++i) t8[i] = p[i] + p[i + 8];
  for (int i = 0; i < 4; ++i) t4[i] = t8[i] + t8[i + 4];
  return (t4[0] + t4[2]) + (t4[1] + t4[3]);
}

#if defined(__AVX512F__)
// exp_spec, lane by lane, with the same operations in the same order.
inline __m512 exp16(__m512 x) {
  const __m512 low = _mm512_set1_ps(kExpLow);
  const __mmask16 under = _mm512_cmp_ps_mask(x, low, _CMP_LT_OQ);
  const __m512 xc = _mm512_mask_blend_ps(under, x, low);
  const __m512 n = _mm512_roundscale_ps(
      _mm512_fmadd_ps(xc, _mm512_set1_ps(kLog2e), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(kLn2Hi), xc);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(kP0), r, _mm512_set1_ps(kP1));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP4));
  p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __m512 out = _mm512_mul_ps(p, _mm512_castsi512_ps(e));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~under), out);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// exp_spec, lane by lane (8 lanes: CPUs without AVX-512), with the same operations in the same order.
inline __m256 exp8(__m256 x) {
  const __m256 low = _mm256_set1_ps(kExpLow);
  const __m256 under = _mm256_cmp_ps(x, low, _CMP_LT_OQ);
  const __m256 xc = _mm256_blendv_ps(x, low, under);
  const __m256 n = _mm256_floor_ps(
      _mm256_fmadd_ps(xc, _mm256_set1_ps(kLog2e), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(kLn2Hi), xc);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(kP0), r, _mm256_set1_ps(kP1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP4));
  p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 out = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  return _mm256_andnot_ps(under, out);
}

#endif

}  // namespace prefix_serve

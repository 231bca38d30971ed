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


// A subnormal float as zero of the same sign (what VDPBF16PS does to its inputs).
inline float flush(float x) { return std::fabs(x) < FLT_MIN ? std::copysign(0.0f, x) : x; }

// r = fma(a, b, acc) (a, b bfloat16 values, acc a float, each normal or zero) flushed as
// x86's FTZ flushes it, which the vector paths get from MXCSR (and, a test holds, VDPBF16PS):
// to zero when the exact result, rounded to 24 bits with an unbounded exponent, is below
// FLT_MIN ("tininess after rounding"). r itself, rounded with gradual underflow, tells that
// except at |r| == FLT_MIN, which an exact result in [FLT_MIN - 2^-150, FLT_MIN - 2^-151)
// also rounds to; there the step is redone scaled by 2^64, exactly and far from underflow.
// (A result that close to FLT_MIN is a multiple of the smaller lowest bit of a b (16
// significant bits) and acc (24), so both are below 2^-101: the smaller factor and acc scale
// without overflow.) Flushing r only when it is subnormal would keep FLT_MIN there.
inline float flush_result(float a, float b, float acc, float r) {
  const float m = std::fabs(r);
  if (m != FLT_MIN) return m < FLT_MIN ? std::copysign(0.0f, r) : r;
  constexpr float kScale = 0x1p64f;
  const bool a_smaller = std::fabs(a) <= std::fabs(b);
  const float scaled = std::fma(a_smaller ? a * kScale : a, a_smaller ? b : b * kScale,
                                acc * kScale);
  return std::fabs(scaled) < FLT_MIN * kScale ? std::copysign(0.0f, r) : r;
}

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
  // one product-add step of VDPBF16PS: subnormal inputs read as zero, tiny results flushed
  // (checked against the vector paths bit for bit by tests)
  static float mac(float a, float b, float acc) {
    a = flush(a), b = flush(b), acc = flush(acc);
    return flush_result(a, b, acc, std::fma(a, b, acc));
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

#if defined(__AVX512F__) || defined(__AVX2__)
// MXCSR's DAZ and FTZ for this thread while in scope (``on``), the old state back after: a
// vector path emulating VDPBF16PS's pair step with FMAs (CPUs without AVX-512 BF16) sets
// them around exactly its product-add loops, so that the CPU reads subnormal inputs as zero
// and flushes tiny results, as the instruction does and as the portable code writes out
// (flush, flush_result).
struct FlushDenormals {
  unsigned saved;
  explicit FlushDenormals(bool on) : saved(_mm_getcsr()) {
    if (on) _mm_setcsr(saved | 0x8040u);
  }
  ~FlushDenormals() { _mm_setcsr(saved); }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;
};
#endif

#if defined(__AVX512F__)
// 16 bfloat16 pairs (32-bit units, the odd element high): their odd and even elements as
// floats (exact), for the pair step written as two FMAs where AVX-512 BF16 is missing.
inline __m512 odd16(__m512i pairs) {
  return _mm512_castsi512_ps(
      _mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
}
inline __m512 even16(__m512i pairs) { return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)); }

// 16 bfloat16 as floats (exact).
inline __m512 widen16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// Each lane rounded to bfloat16 and widened back, as c10::BFloat16(float) rounds (nearest
// even, NaN to the quiet 0x7FC0): to_weight for 16 lanes without AVX-512 BF16's VCVTNEPS2BF16.
inline __m512 round16_bf16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF));
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  const __m512i rounded = _mm512_and_si512(_mm512_add_epi32(bits, bias), high);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  const __m512i quiet_nan = _mm512_set1_epi32(0x7FC00000);
  return _mm512_castsi512_ps(_mm512_mask_blend_epi32(nan, rounded, quiet_nan));
}
#endif

}  // namespace prefix_serve

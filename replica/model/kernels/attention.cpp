// Paged attention and KV-cache writes over a block-major KV cache, batch-invariant.
//
// Invariance is the point of this file: the output of one query depends only on that query,
// its keys and values, and nothing else in the step. Every query walks its keys in the same
// order, in units of up to 16 keys aligned to position 0, with one fixed arithmetic (the
// "spec" below) in float32 (float64 for a float64 model), whether it is one decode among 32,
// one row of a 1,000-token prefill chunk, or a decode whose first blocks another request
// computed. Queries are grouped into tiles, and within a tile the queries that read the same
// block are computed together, only so that a block is read while it is in cache: grouping
// changes what runs together, never what a query computes.
//
// The spec, per query head, over its units u of n_u keys (lanes l < 16; P is the pack: 2 for
// bfloat16, as AVX-512 BF16's dot product takes pairs, 1 otherwise):
//   pass 1, for each u: s_ul = 0; for i = 0..D/P-1, e = P-1..0: s_ul = fma(q[Pi+e], k_ul[Pi+e],
//           s_ul); s_ul *= scale (-inf for l >= n_u); vmax_l = max(vmax_l, s_ul)
//   m = max_l vmax_l
//   pass 2, for each u: p_ul = E(s_ul - m) (0 for l >= n_u); vsum_l += p_ul;
//           w_ul = p_ul rounded to the model's dtype;
//           for j = 0..ceil(n_u/P)-1, e = P-1..0: o_d = fma(w_u[Pj+e], v_u[Pj+e]_d, o_d)
//   out_d = o_d / tree16(vsum)
// where E is the polynomial exp below and tree16 adds lanes (l, l+8), (l, l+4), (l, l+2),
// (0, 1). Two passes, not an online softmax: the maximum is known before any exponential,
// so nothing is ever rescaled, and per key the work is a dot product, an exponential and an
// axpy. Three implementations follow the spec: a portable one, an AVX-512 one and an AVX2
// one (CPUs without AVX-512) for 16-token blocks; they agree bit for bit (a test compares
// them), so the portable one is also the vector ones' reference. AVX-512 BF16's VDPBF16PS is
// exactly the spec's pair step (odd element first, each product exact, each add rounded,
// subnormals flushed), which a test also checks; where it is missing (AVX-512F alone, or
// AVX2) the vector code writes the pair step as two FMAs under MXCSR's DAZ and FTZ.
// ``attention_path`` names the implementation a dtype runs on this build.
//
// Bit-exactness needs the compiler's help: the build uses -ffp-contract=off and every fused
// multiply-add is written as one (std::fma or an fmadd intrinsic), so no compiler-chosen
// contraction makes a vectorized loop and its scalar remainder round differently.
//
// Layout of the cache, one tensor [num_blocks, layers, 2, kv_heads, block_size * head_dim]:
// for a (block, layer, head), K element (token l, dim d) is at ((d/P)*block_size + l)*P + d%P
// (a unit's scores are one vector per dimension pair) and V element (l, d) at
// ((l/P)*head_dim + d)*P + l%P. A block's keys and values of every layer are one contiguous
// region.

#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>

#include "numerics.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cfloat>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace {
using namespace prefix_serve;

constexpr int kMaxGroup = 16;  // query heads per KV head
constexpr int kMaxHeads = 24;  // query heads one AVX-512 call holds in registers


struct Geometry {
  int64_t heads, kv_heads, group, head_dim, block_size;
  int64_t block_stride;  // elements from one block to the next (all layers, K and V)
  int64_t kv_offset;     // elements from a block's K of this layer to its V
  int64_t head_stride;   // elements from one KV head to the next
};

// One query's heads for one KV head (G heads): its scores, per-lane maxima and sums, output.
template <typename T> struct QueryState {
  using A = typename Traits<T>::Acc;
  const T* q;      // [G] rows of head_dim, in the model's dtype
  int64_t q_head;  // elements from one head's row to the next
  A* o;            // [G][D]
  A* scores;       // [G][units * 16]
  int64_t units;   // units this query reaches
  A* vmax;         // [G][16], then the maximum of each head in [G][0]
  A* vsum;         // [G][16]
};

// ---- the portable implementation (the spec, query by query) ----

template <typename T, typename A = typename Traits<T>::Acc>
void scores_portable(const T* q, const T* k, int64_t n, const Geometry& g, A scale, A* s,
                     A* vmax) {
  constexpr int P = Traits<T>::pack;
  for (int l = 0; l < kLanes; ++l) s[l] = 0;
  for (int64_t i = 0; i < g.head_dim / P; ++i) {
    const T* ki = k + i * g.block_size * P;
    for (int e = P - 1; e >= 0; --e) {
      const A qd = widen(q[i * P + e]);
      for (int64_t l = 0; l < n; ++l) s[l] = Traits<T>::mac(qd, widen(ki[l * P + e]), s[l]);
    }
  }
  for (int l = 0; l < kLanes; ++l) {
    s[l] = l < n ? s[l] * scale : -std::numeric_limits<A>::infinity();
    vmax[l] = s[l] > vmax[l] ? s[l] : vmax[l];
  }
}

template <typename T, typename A = typename Traits<T>::Acc>
void values_portable(const A* s, A m, const T* v, int64_t n, int64_t dim, A* vsum, A* o) {
  constexpr int P = Traits<T>::pack;
  A w[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    const A p = l < n ? exp_spec(s[l] - m) : A(0);
    vsum[l] = vsum[l] + p;
    w[l] = to_weight(p, v);
  }
  for (int64_t j = 0; j < (n + P - 1) / P; ++j) {
    const T* vj = v + j * dim * P;
    for (int e = P - 1; e >= 0; --e) {
      const A wj = w[j * P + e];
      for (int64_t d = 0; d < dim; ++d) o[d] = Traits<T>::mac(wj, widen(vj[d * P + e]), o[d]);
    }
  }
}

// Pass 1 (``values`` false) or pass 2 of unit ``u`` for several queries, query by query.
template <typename T>
void unit_portable(QueryState<T>* states, const int64_t* n, int count, const T* k, const T* v,
                   int64_t u, bool values, typename Traits<T>::Acc scale, const Geometry& g) {
  for (int i = 0; i < count; ++i) {
    QueryState<T>& st = states[i];
    for (int64_t h = 0; h < g.group; ++h) {
      auto* s = st.scores + (h * st.units + u) * kLanes;
      if (!values) {
        scores_portable<T>(st.q + h * st.q_head, k, n[i], g, scale, s, st.vmax + h * kLanes);
      } else {
        values_portable<T>(s, st.vmax[h * kLanes], v, n[i], g.head_dim, st.vsum + h * kLanes,
                           st.o + h * g.head_dim);
      }
    }
  }
}

// ---- the AVX-512 implementation (16-token blocks) ----
// A Vec<T> holds a dtype's steps; ``flushes``: its pair step needs MXCSR's DAZ and FTZ around
// the product loops; ``pv_heads``: the heads whose accumulators a value pass holds (with a
// value row's registers, within the 32); ``Query``: what qk reads q as.
#if defined(__AVX512F__)

template <typename T> struct Vec;

template <> struct Vec<float> {
  static constexpr bool enabled = true, flushes = false;
  static constexpr int pv_heads = 6;
  static constexpr const char* path = "avx512";
  using Query = float;
  // s += q . k for the dimension(s) at step i: q broadcast, k a row of 16 keys
  static __m512 qk(__m512 acc, const float* q, int64_t i, const float* k) {
    return _mm512_fmadd_ps(_mm512_set1_ps(q[i]), _mm512_loadu_ps(k + i * kLanes), acc);
  }
  static constexpr int64_t qk_steps(int64_t dim) { return dim; }
  using Weights = float;
  static void weights(__m512 p, float* w) { _mm512_storeu_ps(w, p); }
  // o += w_j . v_j for the key(s) of step j, over 16 dimensions at c
  static __m512i value_row(const float* v, int64_t j, int64_t dim, int64_t c) {
    return _mm512_castps_si512(_mm512_loadu_ps(v + j * dim + c));
  }
  using Row = __m512i;
  static __m512 weight(const float* w, int64_t j) { return _mm512_set1_ps(w[j]); }
  static __m512 pv(__m512 o, __m512 w, __m512i row) {
    return _mm512_fmadd_ps(w, _mm512_castsi512_ps(row), o);
  }
  static constexpr int64_t pv_steps(int64_t n) { return n; }
};

#if defined(__AVX512BF16__)
template <> struct Vec<c10::BFloat16> {
  static constexpr bool enabled = true, flushes = false;  // VDPBF16PS flushes by itself
  static constexpr int pv_heads = 6;
  static constexpr const char* path = "avx512_bf16";
  using Query = c10::BFloat16;
  static __m512 pair(const c10::BFloat16* p) {
    int32_t bits;
    std::memcpy(&bits, p, sizeof(bits));
    return _mm512_castsi512_ps(_mm512_set1_epi32(bits));
  }
  static __m512 qk(__m512 acc, const c10::BFloat16* q, int64_t i, const c10::BFloat16* k) {
    const __m512i keys = _mm512_loadu_si512(k + i * kLanes * 2);
    // the broadcast pair last: it is the operand the instruction can take from memory
    return _mm512_dpbf16_ps(acc, (__m512bh)keys, (__m512bh)pair(q + 2 * i));
  }
  static constexpr int64_t qk_steps(int64_t dim) { return dim / 2; }
  using Weights = c10::BFloat16;
  static void weights(__m512 p, c10::BFloat16* w) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(w), (__m256i)_mm512_cvtneps_pbh(p));
  }
  using Row = __m512i;
  static __m512i value_row(const c10::BFloat16* v, int64_t j, int64_t dim, int64_t c) {
    return _mm512_loadu_si512(v + (j * dim + c) * 2);  // 16 dimensions of 2 keys
  }
  static __m512 weight(const c10::BFloat16* w, int64_t j) { return pair(w + 2 * j); }
  static __m512 pv(__m512 o, __m512 w, __m512i row) {
    return _mm512_dpbf16_ps(o, (__m512bh)row, (__m512bh)w);
  }
  static constexpr int64_t pv_steps(int64_t n) { return (n + 1) / 2; }
};
#else
// AVX-512F without AVX-512 BF16 (Skylake-SP to Ice Lake): the pair step as two FMAs, odd
// element first, flushed by MXCSR's DAZ and FTZ (flushes): the spec's arithmetic, as the
// instruction, the AVX2 code and the portable code compute it, so a bfloat16 model has one
// set of bits whichever runs it. q is widened once a call and the weights are held widened,
// so that a step's broadcasts are plain loads; a value row is its two halves, so 4 heads.
template <> struct Vec<c10::BFloat16> {
  static constexpr bool enabled = true, flushes = true;
  static constexpr int pv_heads = 4;
  static constexpr const char* path = "avx512";
  using T = c10::BFloat16;
  struct Pair {
    __m512 odd, even;
  };
  using Query = float;
  static __m512 qk(__m512 acc, const float* q, int64_t i, const T* k) {
    const __m512i keys = _mm512_loadu_si512(k + i * kLanes * 2);
    acc = _mm512_fmadd_ps(_mm512_set1_ps(q[2 * i + 1]), odd16(keys), acc);
    return _mm512_fmadd_ps(_mm512_set1_ps(q[2 * i]), even16(keys), acc);
  }
  static constexpr int64_t qk_steps(int64_t dim) { return dim / 2; }
  using Weights = float;  // rounded to bfloat16 (to_weight), held as floats
  static void weights(__m512 p, float* w) { _mm512_storeu_ps(w, round16_bf16(p)); }
  using Row = Pair;
  static Pair value_row(const T* v, int64_t j, int64_t dim, int64_t c) {
    const __m512i pairs = _mm512_loadu_si512(v + (j * dim + c) * 2);  // 16 dims of 2 keys
    return {odd16(pairs), even16(pairs)};
  }
  static Pair weight(const float* w, int64_t j) {
    return {_mm512_set1_ps(w[2 * j + 1]), _mm512_set1_ps(w[2 * j])};
  }
  static __m512 pv(__m512 o, Pair w, Pair row) {
    return _mm512_fmadd_ps(w.even, row.even, _mm512_fmadd_ps(w.odd, row.odd, o));
  }
  static constexpr int64_t pv_steps(int64_t n) { return (n + 1) / 2; }
};
#endif
template <> struct Vec<double> { static constexpr bool enabled = false; };

// The H heads' q rows as Vec<T>::qk reads them: in place, or widened to float into this
// thread's scratch (bfloat16 without AVX-512 BF16; head_dim is a multiple of 32 here).
template <typename T, int H>
void query_rows(QueryState<T>* states, const Geometry& g, const typename Vec<T>::Query* (&q)[H]) {
  const int64_t G = g.group, D = g.head_dim;
  thread_local std::vector<float> wide;
  if constexpr (!std::is_same_v<typename Vec<T>::Query, T>) wide.resize(H * D);
  for (int x = 0; x < H; ++x) {
    const T* row = states[x / G].q + (x % G) * states[x / G].q_head;
    if constexpr (std::is_same_v<typename Vec<T>::Query, T>) {
      q[x] = row;
    } else {
      float* out = wide.data() + x * D;
      for (int64_t d = 0; d < D; d += kLanes) _mm512_storeu_ps(out + d, widen16(row + d));
      q[x] = out;
    }
  }
}

// Pass 1 of one 16-token block for H query heads (queries x group heads), all reading the
// same keys: each K row is loaded once for all of them. H is a compile-time constant so that
// the accumulators stay in registers.
template <typename T, int H>
void scores_avx512(QueryState<T>* states, const int64_t* n, const T* k, int64_t u, float scale,
                   const Geometry& g) {
  using V = Vec<T>;
  const int64_t G = g.group, D = g.head_dim;
  const typename V::Query* q[H];
  query_rows<T, H>(states, g, q);
  __m512 acc[H];
  for (int x = 0; x < H; ++x) acc[x] = _mm512_setzero_ps();
  {
    const FlushDenormals daz(V::flushes);  // the products only: the scaling rounds as specified
    for (int64_t i = 0; i < V::qk_steps(D); ++i) {
      for (int x = 0; x < H; ++x) acc[x] = V::qk(acc[x], q[x], i, k);
    }
  }
  for (int x = 0; x < H; ++x) {
    QueryState<T>& st = states[x / G];
    const int64_t h = x % G;
    const __mmask16 valid = static_cast<__mmask16>((1u << n[x / G]) - 1u);
    const __m512 s = _mm512_mask_blend_ps(
        valid, _mm512_set1_ps(-std::numeric_limits<float>::infinity()),
        _mm512_mul_ps(acc[x], _mm512_set1_ps(scale)));
    _mm512_storeu_ps(st.scores + (h * st.units + u) * kLanes, s);
    float* vmax = st.vmax + h * kLanes;
    _mm512_storeu_ps(vmax, _mm512_max_ps(_mm512_loadu_ps(vmax), s));  // max: exact
  }
}

// o += w . v for H heads over one block's values, in the spec's order per head (pair j,
// odd element first). Heads go in groups of up to Vec<T>::pv_heads so that a group's
// accumulators (all of head_dim) stay in registers while each value row is loaded once per
// group; a head whose keys end early skips the later pairs (the spec's ceil(n/P)).
template <typename T, int HG, int CH>
void pv_group(float* const* o_of, const int64_t* n_of, int64_t most,
              const typename Vec<T>::Weights (*w)[kLanes], const T* v, int64_t D) {
  using V = Vec<T>;
  bool uniform = true;
  for (int x = 0; x < HG; ++x) uniform = uniform && n_of[x] == most;
  for (int64_t c0 = 0; c0 < D; c0 += CH * kLanes) {
    __m512 o[HG][CH];
    for (int x = 0; x < HG; ++x)
      for (int c = 0; c < CH; ++c) o[x][c] = _mm512_loadu_ps(o_of[x] + c0 + c * kLanes);
    for (int64_t j = 0; j < V::pv_steps(most); ++j) {
      typename V::Row rows[CH];
      for (int c = 0; c < CH; ++c) rows[c] = V::value_row(v, j, D, c0 + c * kLanes);
      for (int x = 0; x < HG; ++x) {
        if (!uniform && j >= V::pv_steps(n_of[x])) continue;  // the spec skips these
        const auto wj = V::weight(w[x], j);
        for (int c = 0; c < CH; ++c) o[x][c] = V::pv(o[x][c], wj, rows[c]);
      }
    }
    for (int x = 0; x < HG; ++x)
      for (int c = 0; c < CH; ++c) _mm512_storeu_ps(o_of[x] + c0 + c * kLanes, o[x][c]);
  }
}

template <typename T, int H, int CH>
void pv_chunks(float* const* o_of, const int64_t* n_of, int64_t most,
               const typename Vec<T>::Weights (*w)[kLanes], const T* v, int64_t D) {
  constexpr int HG = Vec<T>::pv_heads, full = H / HG, rest = H % HG;
  for (int gi = 0; gi < full; ++gi) {
    pv_group<T, HG, CH>(o_of + gi * HG, n_of + gi * HG, most, w + gi * HG, v, D);
  }
  if constexpr (rest > 0) {
    pv_group<T, rest, CH>(o_of + full * HG, n_of + full * HG, most, w + full * HG, v, D);
  }
}

// head_dim in chunks of 16 floats: up to 4 chunks held at once (64 dimensions)
template <typename T, int H>
void pv_avx512(float* const* o_of, const int64_t* n_of, int64_t most,
               const typename Vec<T>::Weights (*w)[kLanes], const T* v, int64_t D) {
  switch (std::min<int64_t>(4, D / kLanes)) {
    case 1: return pv_chunks<T, H, 1>(o_of, n_of, most, w, v, D);
    case 2: return pv_chunks<T, H, 2>(o_of, n_of, most, w, v, D);
    case 3: return pv_chunks<T, H, 3>(o_of, n_of, most, w, v, D);
    default: return pv_chunks<T, H, 4>(o_of, n_of, most, w, v, D);
  }
}

// Pass 2 of one 16-token block for H query heads reading the same values: each V row is
// loaded once for all of them.
template <typename T, int H>
void values_avx512(QueryState<T>* states, const int64_t* n, const T* v, int64_t u,
                   const Geometry& g) {
  using V = Vec<T>;
  const int64_t G = g.group, D = g.head_dim;
  float* o_of[H];
  int64_t n_of[H];
  alignas(64) typename V::Weights w[H][kLanes];
  int64_t most = 0;
  for (int x = 0; x < H; ++x) {
    QueryState<T>& st = states[x / G];
    const int64_t h = x % G;
    o_of[x] = st.o + h * D;
    n_of[x] = n[x / G];
    most = std::max(most, n_of[x]);
    const __mmask16 valid = static_cast<__mmask16>((1u << n_of[x]) - 1u);
    const __m512 s = _mm512_loadu_ps(st.scores + (h * st.units + u) * kLanes);
    const __m512 m = _mm512_set1_ps(st.vmax[h * kLanes]);
    const __m512 p = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(s, m)));
    float* vsum = st.vsum + h * kLanes;
    _mm512_storeu_ps(vsum, _mm512_add_ps(_mm512_loadu_ps(vsum), p));
    V::weights(p, w[x]);
  }
  const FlushDenormals daz(V::flushes);  // the products only: exp and sums round as specified
  pv_avx512<T, H>(o_of, n_of, most, w, v, D);
}

template <typename T, int H>
void unit_avx512(QueryState<T>* states, const int64_t* n, const T* k, const T* v, int64_t u,
                 bool values, float scale, const Geometry& g) {
  if (values) return values_avx512<T, H>(states, n, v, u, g);
  scores_avx512<T, H>(states, n, k, u, scale, g);
}

template <typename T, int... Hs>
constexpr auto avx512_table(std::integer_sequence<int, Hs...>) {
  using Fn = void (*)(QueryState<T>*, const int64_t*, const T*, const T*, int64_t, bool, float,
                      const Geometry&);
  return std::array<Fn, sizeof...(Hs)>{&unit_avx512<T, Hs + 1>...};
}

template <typename T>
void unit_avx512_any(QueryState<T>* states, const int64_t* n, int count, const T* k,
                     const T* v, int64_t u, bool values, float scale, const Geometry& g) {
  static constexpr auto table = avx512_table<T>(std::make_integer_sequence<int, kMaxHeads>{});
  table[count * g.group - 1](states, n, k, v, u, values, scale, g);
}
#endif

// ---- the AVX2 + FMA implementation (CPUs without AVX-512; 16-token blocks) ----
// Query by query, head by head, like the portable code, with a unit's 16 lanes in two
// 8-float vectors: the same operations lane by lane in the same order, so the two agree bit
// for bit. bfloat16's pair step flushes subnormals as VDPBF16PS does: MXCSR's DAZ and FTZ are
// set around exactly the product-add loops (the scaling, exp and sums round as the spec's).
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define PREFIX_SERVE_AVX2 1

// Lanes [8 * half, 8 * half + 8) valid below n: all ones, else zero.
inline __m256 valid8(int64_t n, int half) {
  const __m256i lane = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                        _mm256_set1_epi32(8 * half));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lane));
}

// A pair row of 8 lanes (bfloat16 pairs as 32-bit units): its odd and even elements.
inline __m256 odd8(__m256i pairs) {
  return _mm256_castsi256_ps(
      _mm256_and_si256(pairs, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
}
inline __m256 even8(__m256i pairs) { return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)); }
inline __m256i load8i(const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

template <typename T>
void qk_avx2(const T* q, const T* k, int64_t dim, __m256 (&acc)[2]) {
  FlushDenormals daz(Traits<T>::pack == 2);
  for (int64_t i = 0; i < dim / Traits<T>::pack; ++i) {
    if constexpr (Traits<T>::pack == 2) {
      const __m256 qo = _mm256_set1_ps(widen(q[2 * i + 1])), qe = _mm256_set1_ps(widen(q[2 * i]));
      for (int h = 0; h < 2; ++h) {
        const __m256i keys = load8i(k + (i * kLanes + 8 * h) * 2);
        acc[h] = _mm256_fmadd_ps(qe, even8(keys), _mm256_fmadd_ps(qo, odd8(keys), acc[h]));
      }
    } else {
      const __m256 qd = _mm256_set1_ps(widen(q[i]));
      for (int h = 0; h < 2; ++h)
        acc[h] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k + i * kLanes + 8 * h), acc[h]);
    }
  }
}

template <typename T>
void scores_avx2(const T* q, const T* k, int64_t n, const Geometry& g, float scale, float* s,
                 float* vmax) {
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  qk_avx2<T>(q, k, g.head_dim, acc);
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int h = 0; h < 2; ++h) {
    const __m256 scaled = _mm256_mul_ps(acc[h], _mm256_set1_ps(scale));
    const __m256 sh = _mm256_blendv_ps(minus_inf, scaled, valid8(n, h));
    _mm256_storeu_ps(s + 8 * h, sh);
    _mm256_storeu_ps(vmax + 8 * h, _mm256_max_ps(sh, _mm256_loadu_ps(vmax + 8 * h)));
  }
}

// o += w . v over 64 dimensions at c0 (8 vectors), pair by pair, odd key first.
template <typename T>
void pv_avx2(const float* w, const T* v, int64_t n, int64_t dim, int64_t c0, int64_t width,
             float* o) {
  constexpr int64_t P = Traits<T>::pack;
  __m256 acc[8];
  const int chunks = static_cast<int>(width / 8);
  for (int c = 0; c < chunks; ++c) acc[c] = _mm256_loadu_ps(o + c0 + 8 * c);
  FlushDenormals daz(P == 2);
  for (int64_t j = 0; j < (n + P - 1) / P; ++j) {
    if constexpr (P == 2) {
      const __m256 wo = _mm256_set1_ps(w[2 * j + 1]), we = _mm256_set1_ps(w[2 * j]);
      for (int c = 0; c < chunks; ++c) {
        const __m256i pairs = load8i(v + (j * dim + c0 + 8 * c) * 2);
        acc[c] = _mm256_fmadd_ps(we, even8(pairs), _mm256_fmadd_ps(wo, odd8(pairs), acc[c]));
      }
    } else {
      const __m256 wj = _mm256_set1_ps(w[j]);
      for (int c = 0; c < chunks; ++c)
        acc[c] = _mm256_fmadd_ps(wj, _mm256_loadu_ps(v + j * dim + c0 + 8 * c), acc[c]);
    }
  }
  for (int c = 0; c < chunks; ++c) _mm256_storeu_ps(o + c0 + 8 * c, acc[c]);
}

template <typename T>
void values_avx2(const float* s, float m, const T* v, int64_t n, int64_t dim, float* vsum,
                 float* o) {
  alignas(32) float w[kLanes];
  for (int h = 0; h < 2; ++h) {
    const __m256 p = _mm256_and_ps(
        valid8(n, h), exp8(_mm256_sub_ps(_mm256_loadu_ps(s + 8 * h), _mm256_set1_ps(m))));
    _mm256_storeu_ps(vsum + 8 * h, _mm256_add_ps(_mm256_loadu_ps(vsum + 8 * h), p));
    _mm256_store_ps(w + 8 * h, p);
  }
  for (int l = 0; l < kLanes; ++l) w[l] = to_weight(w[l], v);  // the dtype's rounding
  for (int64_t c0 = 0; c0 < dim; c0 += 64)
    pv_avx2<T>(w, v, n, dim, c0, std::min<int64_t>(64, dim - c0), o);
}

template <typename T>
void unit_avx2(QueryState<T>* states, const int64_t* n, int count, const T* k, const T* v,
               int64_t u, bool values, float scale, const Geometry& g) {
  for (int i = 0; i < count; ++i) {
    QueryState<T>& st = states[i];
    for (int64_t h = 0; h < g.group; ++h) {
      float* s = st.scores + (h * st.units + u) * kLanes;
      if (!values) {
        scores_avx2<T>(st.q + h * st.q_head, k, n[i], g, scale, s, st.vmax + h * kLanes);
      } else {
        values_avx2<T>(s, st.vmax[h * kLanes], v, n[i], g.head_dim, st.vsum + h * kLanes,
                       st.o + h * g.head_dim);
      }
    }
  }
}
#endif

template <typename T> struct Kernel {
  using A = typename Traits<T>::Acc;
  bool vector = false;  // the AVX-512 path: 16-token blocks, head_dim a multiple of 32
  int per_call = 1;     // queries one unit call takes

  Kernel(const Geometry& g, bool allow_vector) {
#if defined(__AVX512F__)
    if constexpr (Vec<T>::enabled) {
      vector = allow_vector && g.block_size == kLanes && g.head_dim % (2 * kLanes) == 0 &&
               g.group <= kMaxHeads;
      if (vector) per_call = static_cast<int>(kMaxHeads / g.group);
    }
#elif defined(PREFIX_SERVE_AVX2)
    if constexpr (!std::is_same_v<T, double>) {
      vector = allow_vector && g.block_size == kLanes && g.head_dim % 8 == 0;
      if (vector) per_call = 16;  // queries reading one block, while it is in cache
    }
#endif
  }

  void unit(QueryState<T>* states, const int64_t* n, int count, const T* k, const T* v,
            int64_t u, bool values, A scale, const Geometry& g) const {
#if defined(__AVX512F__)
    if constexpr (Vec<T>::enabled) {
      if (vector) return unit_avx512_any<T>(states, n, count, k, v, u, values, scale, g);
    }
#elif defined(PREFIX_SERVE_AVX2)
    if constexpr (!std::is_same_v<T, double>) {
      if (vector) return unit_avx2<T>(states, n, count, k, v, u, values, scale, g);
    }
#endif
    unit_portable<T>(states, n, count, k, v, u, values, scale, g);
  }
};

struct Step {
  const int32_t* tables;
  int64_t table_stride;
  const int32_t* seq;
  const int32_t* ctx;
};

// Ask for the K (pass 1) or V (pass 2) of the unit at key `start` of each query that reaches
// it, while the current unit computes: blocks sit anywhere in the pool, where no hardware
// prefetcher looks.
template <typename T>
void prefetch_next(const Geometry& g, const Step& step, const T* kv_layer, const int32_t* rows,
                   int count, int64_t start, int64_t kvh, bool values) {
  const int64_t b = start / g.block_size;
  if (start % g.block_size != 0) return;  // the same block as the unit before
  const int64_t bytes = g.block_size * g.head_dim * static_cast<int64_t>(sizeof(T));
  int64_t last = -1;
  for (int i = 0; i < count; ++i) {
    if (step.ctx[rows[i]] <= start) continue;
    const int64_t block = step.tables[step.seq[rows[i]] * step.table_stride + b];
    if (block == last) continue;
    last = block;
    const char* k = reinterpret_cast<const char*>(kv_layer + block * g.block_stride +
                                                  kvh * g.head_stride);
    const char* wanted = values ? k + g.kv_offset * static_cast<int64_t>(sizeof(T)) : k;
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(wanted + off);
  }
}

// A tile's scratch: each query's output, scores, lane maxima and sums for one KV head.
template <typename T> struct TileStore {
  using A = typename Traits<T>::Acc;
  std::vector<A> data;
  std::vector<QueryState<T>> states;

  TileStore(const Geometry& g, const Step& step, const T* q, int64_t q_tok, int64_t q_head,
            const int32_t* rows, int count, int64_t kvh, int64_t unit) {
    const int64_t G = g.group, D = g.head_dim;
    std::vector<int64_t> offsets(static_cast<size_t>(count) + 1, 0);
    for (int i = 0; i < count; ++i) {
      const int64_t units = (step.ctx[rows[i]] + unit - 1) / unit;
      offsets[i + 1] = offsets[i] + G * (D + (units + 2) * kLanes);
    }
    data.assign(static_cast<size_t>(offsets[count]), A(0));
    states.resize(static_cast<size_t>(count));
    for (int i = 0; i < count; ++i) {
      A* base = data.data() + offsets[i];
      const int64_t units = (step.ctx[rows[i]] + unit - 1) / unit;
      QueryState<T>& st = states[i];
      st = QueryState<T>{q + rows[i] * q_tok + kvh * G * q_head, q_head, base, base + G * D,
                         units, nullptr, nullptr};
      st.vmax = st.scores + G * units * kLanes;
      st.vsum = st.vmax + G * kLanes;
      std::fill(st.vmax, st.vmax + G * kLanes, -std::numeric_limits<A>::infinity());
    }
  }
};

// One pass of a tile over one KV head: unit by unit from position 0; at each unit, the
// queries reading the same physical block go through one call.
template <typename T>
void tile_pass(const Kernel<T>& kernel, const Geometry& g, const Step& step, const T* kv_layer,
               TileStore<T>& store, const int32_t* rows, int count, int64_t kvh, bool values,
               typename Traits<T>::Acc scale) {
  const int64_t bs = g.block_size, unit = std::min<int64_t>(bs, kLanes);
  int64_t max_ctx = 0;
  for (int i = 0; i < count; ++i) max_ctx = std::max<int64_t>(max_ctx, step.ctx[rows[i]]);
  std::vector<QueryState<T>> batch(static_cast<size_t>(kernel.per_call));
  std::vector<int64_t> counts(static_cast<size_t>(kernel.per_call));
  std::vector<int64_t> blocks(static_cast<size_t>(count));
  std::vector<char> done(static_cast<size_t>(count));
  for (int64_t start = 0; start < max_ctx; start += unit) {
    const int64_t b = start / bs, within = start % bs;
    for (int i = 0; i < count; ++i) {
      done[i] = step.ctx[rows[i]] <= start;
      blocks[i] = done[i] ? -1 : step.tables[step.seq[rows[i]] * step.table_stride + b];
    }
    prefetch_next(g, step, kv_layer, rows, count, start + unit, kvh, values);
    for (int i = 0; i < count; ++i) {
      if (done[i]) continue;
      int taken = 0;
      for (int j = i; j < count && taken < kernel.per_call; ++j) {
        if (done[j] || blocks[j] != blocks[i]) continue;
        batch[taken] = store.states[j];
        counts[taken++] = std::min<int64_t>(unit, step.ctx[rows[j]] - start);
        done[j] = 1;
      }
      const T* block = kv_layer + blocks[i] * g.block_stride + kvh * g.head_stride;
      kernel.unit(batch.data(), counts.data(), taken, block + within * Traits<T>::pack,
                  block + g.kv_offset + within * g.head_dim, start / unit, values, scale, g);
    }
  }
}

// One tile of queries against one KV head: pass 1 (scores and maxima), each head's maximum,
// pass 2 (weights, sums and values), then the outputs.
template <typename T>
void run_tile(const Kernel<T>& kernel, const Geometry& g, const Step& step, const T* kv_layer,
              const T* q, int64_t q_tok, int64_t q_head, T* out, const int32_t* rows, int count,
              int64_t kvh, typename Traits<T>::Acc scale) {
  using A = typename Traits<T>::Acc;
  const int64_t G = g.group, D = g.head_dim;
  const int64_t unit = std::min<int64_t>(g.block_size, kLanes);
  TileStore<T> store(g, step, q, q_tok, q_head, rows, count, kvh, unit);
  tile_pass<T>(kernel, g, step, kv_layer, store, rows, count, kvh, false, scale);
  for (QueryState<T>& st : store.states) {
    for (int64_t h = 0; h < G; ++h) {
      A* vmax = st.vmax + h * kLanes;
      A m = vmax[0];
      for (int l = 1; l < kLanes; ++l) m = vmax[l] > m ? vmax[l] : m;
      vmax[0] = m;  // a max is exact in any order
    }
  }
  tile_pass<T>(kernel, g, step, kv_layer, store, rows, count, kvh, true, scale);
  for (int i = 0; i < count; ++i) {
    const QueryState<T>& st = store.states[i];
    for (int64_t h = 0; h < G; ++h) {
      const A total = tree16(st.vsum + h * kLanes);
      T* o = out + (rows[i] * g.heads + kvh * G + h) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(st.o[h * D + d] / total);
    }
  }
}

// Run fn(item) for items [0, n) on the intra-op threads, largest first (cost[item]), each
// thread taking the next one when free: tiles of one long prompt differ a lot in cost.
template <typename Fn>
void parallel_by_cost(const std::vector<int64_t>& cost, const Fn& fn) {
  const int64_t n = static_cast<int64_t>(cost.size());
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(n, at::get_num_threads());
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < n; i = next++) fn(order[i]);
  });
}

template <typename T>
void attention_impl(const at::Tensor& q, const at::Tensor& kv, int64_t layer,
                    const at::Tensor& block_tables, const at::Tensor& query_seq,
                    const at::Tensor& query_ctx, const at::Tensor& tile_starts,
                    const at::Tensor& tile_rows, double scale, bool allow_vector,
                    at::Tensor& out) {
  Geometry g;
  g.heads = q.size(1);
  g.head_dim = q.size(2);
  g.kv_heads = kv.size(3);
  g.group = g.heads / g.kv_heads;
  g.block_size = kv.size(4) / g.head_dim;
  g.block_stride = kv.stride(0);
  g.kv_offset = kv.stride(2);
  g.head_stride = kv.stride(3);
  const Kernel<T> kernel(g, allow_vector);
  const Step step{block_tables.data_ptr<int32_t>(), block_tables.stride(0),
                  query_seq.data_ptr<int32_t>(), query_ctx.data_ptr<int32_t>()};
  const T* kv_layer = kv.data_ptr<T>() + layer * kv.stride(1);
  const int32_t* starts = tile_starts.data_ptr<int32_t>();
  const int32_t* rows = tile_rows.data_ptr<int32_t>();
  const int64_t num_tiles = tile_starts.size(0) - 1;
  std::vector<int64_t> cost(static_cast<size_t>(num_tiles * g.kv_heads));
  for (int64_t tile = 0; tile < num_tiles; ++tile) {
    int64_t keys = 0;
    for (int32_t r = starts[tile]; r < starts[tile + 1]; ++r) keys += step.ctx[rows[r]];
    for (int64_t kvh = 0; kvh < g.kv_heads; ++kvh) cost[tile * g.kv_heads + kvh] = keys;
  }
  const auto a_scale = static_cast<typename Traits<T>::Acc>(scale);
  parallel_by_cost(cost, [&](int64_t item) {
    const int64_t tile = item / g.kv_heads, kvh = item % g.kv_heads;
    run_tile<T>(kernel, g, step, kv_layer, q.data_ptr<T>(), q.stride(0), q.stride(1),
                out.data_ptr<T>(), rows + starts[tile], starts[tile + 1] - starts[tile], kvh,
                a_scale);
  });
}

template <typename T> const char* attention_path_of() {
#if defined(__AVX512F__)
  if constexpr (Vec<T>::enabled) return Vec<T>::path;
#elif defined(PREFIX_SERVE_AVX2)
  if constexpr (!std::is_same_v<T, double>) return "avx2";
#endif
  return "portable";
}

// The implementation a dtype's attention runs with vector=True on this build, for 16-token
// blocks and a head_dim that is a multiple of 32 (others run "portable"): "avx512_bf16"
// (VDPBF16PS), "avx512", "avx2" or "portable".
std::string attention_path(at::ScalarType dtype) {
  std::string out;
  dispatch(dtype, "attention_path", [&](auto zero) { out = attention_path_of<decltype(zero)>(); });
  return out;
}

void check_attention_args(const at::Tensor& q, const at::Tensor& kv, int64_t layer,
                          const at::Tensor& block_tables, const at::Tensor& query_seq,
                          const at::Tensor& query_ctx, const at::Tensor& tile_starts,
                          const at::Tensor& tile_rows) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [tokens, heads, head_dim]");
  TORCH_CHECK(kv.dim() == 5 && kv.is_contiguous(), "kv must be a contiguous 5-d cache");
  TORCH_CHECK(q.scalar_type() == kv.scalar_type(), "q and kv must share a dtype");
  TORCH_CHECK(layer >= 0 && layer < kv.size(1), "layer out of range");
  const int64_t heads = q.size(1), kv_heads = kv.size(3);
  TORCH_CHECK(heads % kv_heads == 0 && heads / kv_heads <= kMaxGroup, "bad head grouping");
  TORCH_CHECK(kv.size(4) % q.size(2) == 0, "kv's last dim must be block_size * head_dim");
  const int64_t bs = kv.size(4) / q.size(2);
  TORCH_CHECK(bs % 2 == 0 && (bs <= kLanes || bs % kLanes == 0),
              "block_size must be even and at most 16, or a multiple of 16");
  TORCH_CHECK(q.size(2) % 2 == 0, "head_dim must be even");
  for (const auto* t : {&block_tables, &query_seq, &query_ctx, &tile_starts, &tile_rows}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "index tensors: int32");
  }
  TORCH_CHECK(query_seq.size(0) == q.size(0) && query_ctx.size(0) == q.size(0),
              "one sequence and one context length per query");
  TORCH_CHECK(tile_rows.size(0) == q.size(0), "tiles must cover every query once");
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& kv, int64_t layer,
                           const at::Tensor& block_tables, const at::Tensor& query_seq,
                           const at::Tensor& query_ctx, const at::Tensor& tile_starts,
                           const at::Tensor& tile_rows, double scale, bool vector) {
  check_attention_args(q, kv, layer, block_tables, query_seq, query_ctx, tile_starts, tile_rows);
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  dispatch(q.scalar_type(), "paged_attention", [&](auto zero) {
    using T = decltype(zero);
    attention_impl<T>(q, kv, layer, block_tables, query_seq, query_ctx, tile_starts, tile_rows,
                      scale, vector, out);
  });
  return out;
}

template <typename T>
void write_kv_impl(at::Tensor& kv, int64_t layer, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& slots) {
  constexpr int64_t P = Traits<T>::pack;
  const int64_t tokens = k.size(0), kv_heads = k.size(1), dim = k.size(2);
  const int64_t bs = kv.size(4) / dim;
  T* base = kv.data_ptr<T>() + layer * kv.stride(1);
  const int64_t block_stride = kv.stride(0), kv_offset = kv.stride(2), head_stride = kv.stride(3);
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t k_tok = k.stride(0), k_head = k.stride(1);
  const int64_t v_tok = v.stride(0), v_head = v.stride(1);
  at::parallel_for(0, tokens * kv_heads, 64, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / kv_heads, h = item % kv_heads;
      const int64_t block = slot[t] / bs, l = slot[t] % bs;
      T* kdst = base + block * block_stride + h * head_stride;
      T* vdst = kdst + kv_offset;
      const T* ksrc = kp + t * k_tok + h * k_head;
      const T* vsrc = vp + t * v_tok + h * v_head;
      for (int64_t d = 0; d < dim; ++d) {
        kdst[((d / P) * bs + l) * P + d % P] = ksrc[d];
        vdst[((l / P) * dim + d) * P + l % P] = vsrc[d];
      }
    }
  });
}

void write_kv(at::Tensor kv, int64_t layer, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slots) {
  TORCH_CHECK(kv.dim() == 5 && kv.is_contiguous(), "kv must be a contiguous 5-d cache");
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.sizes() == v.sizes(), "k, v: [tokens, heads, dim]");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "k and v rows must be contiguous");
  TORCH_CHECK(k.scalar_type() == kv.scalar_type() && v.scalar_type() == kv.scalar_type(),
              "k, v and kv must share a dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous(), "slots: int64");
  TORCH_CHECK(slots.size(0) == k.size(0), "one slot per token");
  TORCH_CHECK(layer >= 0 && layer < kv.size(1), "layer out of range");
  dispatch(kv.scalar_type(), "write_kv", [&](auto zero) {
    using T = decltype(zero);
    write_kv_impl<T>(kv, layer, k, v, slots);
  });
}

}  // namespace

TORCH_LIBRARY(prefix_serve, m) {
  m.def(
      "paged_attention(Tensor q, Tensor kv, int layer, Tensor block_tables, Tensor query_seq, "
      "Tensor query_ctx, Tensor tile_starts, Tensor tile_rows, float scale, bool vector=True) "
      "-> Tensor");
  m.def("write_kv(Tensor(a!) kv, int layer, Tensor k, Tensor v, Tensor slots) -> ()");
  m.def("attention_path(ScalarType dtype) -> str", &attention_path);
}

TORCH_LIBRARY_IMPL(prefix_serve, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("write_kv", &write_kv);
}

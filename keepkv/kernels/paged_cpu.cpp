// keepkv's C++ kernels on CPU: the paged decode attention (the "cpp" backend of
// keepkv.kernels.paged), and three steps of KeepKV's merge (keepkv.kernels.ema, the EMA fold;
// keepkv.kernels.nearest, the target search; keepkv.kernels.protect, the entries open to merges;
// all at the end of this file).
//
// One query token per request, grouped-query attention over the request's entries, read in place
// through its block table (keepkv/kernels/paged.py has the contract and the reference):
//
//     z_s = q.k_s * scaling + bias_s,   p = softmax(z),   out = sum_s p_s v_s   (fp32 throughout)
//
// with, optionally, the logits q.k*scaling (no bias) and the probabilities per entry.
//
// Work: one task per (request, KV head), handed out dynamically (longest requests first) over
// torch's intra-op threads (at::parallel_for: torch's own OpenMP pool where torch is built so).
// A task
//   1. computes the group's g logits block by block, each key read once for the whole group
//      (register tiles of up to 4 heads x 4 vectors of slots or of dimensions), adds the bias
//      (one gather per vector of slots), and keeps z in the probabilities' output row (or a
//      per-thread scratch row when they are not asked for);
//   2. takes the softmax in place over that row: max, exp (a vectorised polynomial), sum;
//   3. accumulates the values block by block in registers (up to 4 heads x 4 vectors of dims),
//      each value read once per group of 4 heads.
// bf16 and fp16 caches are read as they are and widened in registers (bf16: a shift), never
// copied. The ISA is chosen at compile time: AVX-512 (F, BW, VL, DQ), AVX2 + FMA + F16C, or plain
// C++ (KEEPKV_ISA_* names which one the loader asked for; the intrinsics follow the compiler's
// target macros).

#include <Python.h>  // first, as Python asks

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

struct bf16_t { uint16_t bits; };
struct f16_t { uint16_t bits; };

constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;          // ln 2 split for Cody-Waite reduction
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kExpLow = -87.3365447f;         // exp below this: 0 (2^-126)

// -- vectors ------------------------------------------------------------------------------------
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
constexpr int W = 16;
using vf = __m512;
inline __mmask16 first_lanes(int n) {
  return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1u);
}
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset(float x) { return _mm512_set1_ps(x); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
// lanes where a > b (ordered: a NaN never is): x, else y
inline vf vwhere_gt(vf a, vf b, vf x, vf y) { return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_GT_OQ), y, x); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vload(const bf16_t* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline vf vload(const f16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
// the first n lanes (0 <= n <= W) from p, zeros after: no read past them
inline vf vload_n(const float* p, int n) { return _mm512_maskz_loadu_ps(first_lanes(n), p); }
inline vf vload_n_or(const float* p, int n, float fill) { return _mm512_mask_loadu_ps(vset(fill), first_lanes(n), p); }
inline vf vload_n(const bf16_t* p, int n) {
  __m256i h = _mm256_maskz_loadu_epi16(first_lanes(n), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline vf vload_n(const f16_t* p, int n) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(first_lanes(n), p)); }
inline void vstore(float* p, vf x) { _mm512_storeu_ps(p, x); }
inline void vstore_n(float* p, vf x, int n) { _mm512_mask_storeu_ps(p, first_lanes(n), x); }
inline float vsum(vf x) { return _mm512_reduce_add_ps(x); }
inline float vtop(vf x) { return _mm512_reduce_max_ps(x); }
// words[(s0 + lane) * stride] for the first n lanes, 0 after
inline vf vgather(const float* base, int stride, int n) {
  __m512i index = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                     _mm512_set1_epi32(stride));
  return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), first_lanes(n), index, base, 4);
}
// the four sums of a, b, c, d into out[0..3]
inline void vsum4(vf a, vf b, vf c, vf d, float* out) {
  vf ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  vf cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  vf abcd = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  // each 128-bit lane holds 4 partial sums of one of a, b, c, d
  abcd = _mm512_add_ps(abcd, _mm512_shuffle_ps(abcd, abcd, 0x4E));
  abcd = _mm512_add_ps(abcd, _mm512_shuffle_ps(abcd, abcd, 0xB1));
  __m128 sums = _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                                                0, 0, 0), abcd));
  _mm_storeu_ps(out, sums);
}
// exp(x) for x <= 0 (0 below kExpLow and for -inf)
inline vf vexp(vf x) {
  __mmask16 live = _mm512_cmp_ps_mask(x, vset(kExpLow), _CMP_GE_OQ);
  x = _mm512_max_ps(x, vset(kExpLow));
  vf n = _mm512_roundscale_ps(_mm512_mul_ps(x, vset(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  vf u = _mm512_fnmadd_ps(n, vset(kLn2Hi), x);
  u = _mm512_fnmadd_ps(n, vset(kLn2Lo), u);
  vf p = vset(1.0f / 5040);
  p = vfma(p, u, vset(1.0f / 720));
  p = vfma(p, u, vset(1.0f / 120));
  p = vfma(p, u, vset(1.0f / 24));
  p = vfma(p, u, vset(1.0f / 6));
  p = vfma(p, u, vset(0.5f));
  p = vfma(p, u, vset(1.0f));
  p = vfma(p, u, vset(1.0f));
  return _mm512_maskz_scalef_ps(live, p, n);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int W = 8;
using vf = __m256;
inline __m256i lane_mask(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vset(float x) { return _mm256_set1_ps(x); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf vwhere_gt(vf a, vf b, vf x, vf y) { return _mm256_blendv_ps(y, x, _mm256_cmp_ps(a, b, _CMP_GT_OQ)); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline vf widen_bf16(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
inline vf vload(const bf16_t* p) { return widen_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline vf vload(const f16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline vf vload_n(const float* p, int n) { return _mm256_maskload_ps(p, lane_mask(n)); }
inline vf vload_n_or(const float* p, int n, float fill) {
  const __m256i mask = lane_mask(n);
  return _mm256_blendv_ps(vset(fill), _mm256_maskload_ps(p, mask), _mm256_castsi256_ps(mask));
}
inline __m128i load_halves_n(const uint16_t* p, int n) {
  alignas(16) uint16_t staged[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::memcpy(staged, p, sizeof(uint16_t) * std::max(0, std::min(n, 8)));
  return _mm_load_si128(reinterpret_cast<const __m128i*>(staged));
}
inline vf vload_n(const bf16_t* p, int n) { return widen_bf16(load_halves_n(&p->bits, n)); }
inline vf vload_n(const f16_t* p, int n) { return _mm256_cvtph_ps(load_halves_n(&p->bits, n)); }
inline void vstore(float* p, vf x) { _mm256_storeu_ps(p, x); }
inline void vstore_n(float* p, vf x, int n) { _mm256_maskstore_ps(p, lane_mask(n), x); }
inline float vsum(vf x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float vtop(vf x) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline vf vgather(const float* base, int stride, int n) {
  __m256i index = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(stride));
  return _mm256_mask_i32gather_ps(_mm256_setzero_ps(), base, index, _mm256_castsi256_ps(lane_mask(n)), 4);
}
inline void vsum4(vf a, vf b, vf c, vf d, float* out) {
  vf t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
}
inline vf vexp(vf x) {
  vf live = _mm256_cmp_ps(x, vset(kExpLow), _CMP_GE_OQ);
  x = _mm256_max_ps(x, vset(kExpLow));
  vf n = _mm256_round_ps(_mm256_mul_ps(x, vset(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  vf u = _mm256_fnmadd_ps(n, vset(kLn2Hi), x);
  u = _mm256_fnmadd_ps(n, vset(kLn2Lo), u);
  vf p = vset(1.0f / 5040);
  p = vfma(p, u, vset(1.0f / 720));
  p = vfma(p, u, vset(1.0f / 120));
  p = vfma(p, u, vset(1.0f / 24));
  p = vfma(p, u, vset(1.0f / 6));
  p = vfma(p, u, vset(0.5f));
  p = vfma(p, u, vset(1.0f));
  p = vfma(p, u, vset(1.0f));
  __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(power)), live);
}
#else  // plain C++: one lane
constexpr int W = 1;
using vf = float;
inline vf vzero() { return 0.0f; }
inline vf vset(float x) { return x; }
inline vf vfma(vf a, vf b, vf c) { return std::fma(a, b, c); }
inline vf vadd(vf a, vf b) { return a + b; }
inline vf vsub(vf a, vf b) { return a - b; }
inline vf vmul(vf a, vf b) { return a * b; }
inline vf vmax(vf a, vf b) { return a > b ? a : b; }
inline vf vdiv(vf a, vf b) { return a / b; }
inline vf vwhere_gt(vf a, vf b, vf x, vf y) { return a > b ? x : y; }
inline float widen(bf16_t x) {
  uint32_t bits = uint32_t(x.bits) << 16;
  float y;
  std::memcpy(&y, &bits, 4);
  return y;
}
inline float widen(f16_t x) {  // IEEE half to float, subnormals and specials included
  uint32_t sign = uint32_t(x.bits & 0x8000u) << 16, exponent = (x.bits >> 10) & 0x1Fu, mantissa = x.bits & 0x3FFu;
  float magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(float(mantissa), -24);
  } else if (exponent == 31) {
    magnitude = mantissa ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  } else {
    magnitude = std::ldexp(float(mantissa | 0x400u), int(exponent) - 25);
  }
  uint32_t bits;
  std::memcpy(&bits, &magnitude, 4);
  bits |= sign;
  std::memcpy(&magnitude, &bits, 4);
  return magnitude;
}
inline vf vload(const float* p) { return *p; }
inline vf vload(const bf16_t* p) { return widen(*p); }
inline vf vload(const f16_t* p) { return widen(*p); }
template <typename T>
inline vf vload_n(const T* p, int n) { return n > 0 ? vload(p) : 0.0f; }
inline vf vload_n_or(const float* p, int n, float fill) { return n > 0 ? *p : fill; }
inline void vstore(float* p, vf x) { *p = x; }
inline void vstore_n(float* p, vf x, int n) { if (n > 0) *p = x; }
inline float vsum(vf x) { return x; }
inline float vtop(vf x) { return x; }
inline vf vgather(const float* base, int, int n) { return n > 0 ? *base : 0.0f; }
inline void vsum4(vf a, vf b, vf c, vf d, float* out) { out[0] = a; out[1] = b; out[2] = c; out[3] = d; }
inline vf vexp(vf x) { return x >= kExpLow ? std::exp(x) : 0.0f; }
#endif

#define KEEPKV_PRAGMA(x) _Pragma(#x)
#define UNROLL KEEPKV_PRAGMA(GCC unroll 16)

constexpr int kHeads = 4;  // query heads per register tile
constexpr int kVecs = 4;   // vectors (of slots or of dimensions) per register tile

// -- the call -----------------------------------------------------------------------------------
struct Call {
  const void* q;         // [R, H, D] fp32, bf16 or fp16 (q_dtype: 0, 1, 2), scaled by nothing yet
  const void* cache;     // the flat cache
  const float* words;    // the same memory as fp32 words
  const int32_t* table;  // [R, table_stride]
  const int32_t* lens;   // [R]
  void* out;             // [R, H, D] fp32, or bf16 where out_bf16
  float* logits;         // [R, H_kv, g, max_len] or null
  float* probs;          // likewise
  int64_t rows, heads, head_dim, kv_heads, group, block_size, cell, keys_at, values_at, words_at, word_count,
      bias_word, cell_words, table_stride, max_len, blocks_in_cache;
  bool keys_by_dim, values_by_dim, out_bf16;
  int q_dtype;
  float scaling;
};

// fp32 -> bf16, rounded to nearest even (NaN: a quiet NaN), as torch rounds it
inline uint16_t to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return uint16_t((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// q[0, count) * scaling into qs (fp32)
template <typename Q>
inline void scaled_query(const Q* q, int64_t count, float scaling, float* qs) {
  for (int64_t e = 0; e < count; e += W) {
    const int n = int(std::min<int64_t>(W, count - e));
    vstore_n(qs + e, vmul(vload_n(q + e, n), vset(scaling)), n);
  }
}

// Per-thread scratch, grown, never shrunk: the scaled queries, the logits when no probabilities
// are returned, a task's fp32 output when out is bf16, and nothing else.
struct Scratch {
  std::vector<float> q, z, o;
};
Scratch& scratch() {
  static thread_local Scratch held;
  return held;
}

// 1a. logits of heads [i0, i0 + GH) for slots [s0, s0 + n) of one block whose keys are packed
// dimension by dimension ([D, block_size]); n <= kVecs * W. z rows at first + s0.
template <typename T, int GH, bool FULL>
inline void logits_by_dim(const Call& c, const T* keys, const float* qs, int s0, int n, const vf* bias, float** zrow,
                          float** lrow) {
  vf acc[GH][kVecs];
  UNROLL
  for (int i = 0; i < GH; ++i)
    UNROLL
    for (int v = 0; v < kVecs; ++v) acc[i][v] = vzero();
  const int64_t bs = c.block_size;
  for (int64_t d = 0; d < c.head_dim; ++d) {
    const T* row = keys + d * bs + s0;
    vf k[kVecs];
    UNROLL
    for (int v = 0; v < kVecs; ++v) k[v] = FULL ? vload(row + v * W) : vload_n(row + v * W, n - v * W);
    UNROLL
    for (int i = 0; i < GH; ++i) {
      vf w = vset(qs[i * c.head_dim + d]);
      UNROLL
      for (int v = 0; v < kVecs; ++v) acc[i][v] = vfma(w, k[v], acc[i][v]);
    }
  }
  UNROLL
  for (int i = 0; i < GH; ++i)
    UNROLL
    for (int v = 0; v < kVecs; ++v) {
      int left = n - v * W;
      if (!FULL && left <= 0) break;
      if (lrow) FULL ? vstore(lrow[i] + s0 + v * W, acc[i][v]) : vstore_n(lrow[i] + s0 + v * W, acc[i][v], left);
      vf z = bias ? vadd(acc[i][v], bias[v]) : acc[i][v];
      FULL ? vstore(zrow[i] + s0 + v * W, z) : vstore_n(zrow[i] + s0 + v * W, z, left);
    }
}

// 1b. logits of heads [i0, i0 + GH) for 4 slots of one block whose keys are packed slot by slot
// ([block_size, D]): slots s[0..3] (repeated where fewer are left), stored for the first n.
template <typename T, int GH>
inline void logits_by_slot(const Call& c, const T* keys, const float* qs, const int* s, int n, const float* bias,
                           float** zrow, float** lrow, int64_t first) {
  vf acc[GH][4];
  UNROLL
  for (int i = 0; i < GH; ++i)
    UNROLL
    for (int j = 0; j < 4; ++j) acc[i][j] = vzero();
  const int64_t D = c.head_dim;
  const T* key[4] = {keys + s[0] * D, keys + s[1] * D, keys + s[2] * D, keys + s[3] * D};
  int64_t d = 0;
  for (; d + W <= D; d += W) {
    vf k[4] = {vload(key[0] + d), vload(key[1] + d), vload(key[2] + d), vload(key[3] + d)};
    UNROLL
    for (int i = 0; i < GH; ++i) {
      vf w = vload(qs + i * D + d);
      UNROLL
      for (int j = 0; j < 4; ++j) acc[i][j] = vfma(w, k[j], acc[i][j]);
    }
  }
  if (d < D) {
    int left = int(D - d);
    vf k[4] = {vload_n(key[0] + d, left), vload_n(key[1] + d, left), vload_n(key[2] + d, left),
               vload_n(key[3] + d, left)};
    UNROLL
    for (int i = 0; i < GH; ++i) {
      vf w = vload_n(qs + i * D + d, left);
      UNROLL
      for (int j = 0; j < 4; ++j) acc[i][j] = vfma(w, k[j], acc[i][j]);
    }
  }
  UNROLL
  for (int i = 0; i < GH; ++i) {
    float sums[4];
    vsum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3], sums);
    for (int j = 0; j < n; ++j) {
      if (lrow) lrow[i][first + s[j]] = sums[j];
      zrow[i][first + s[j]] = bias ? sums[j] + bias[j] : sums[j];
    }
  }
}

// 3a. out of heads [i0, i0 + GH), dimensions [d0, d0 + n) (n <= kVecs * W) over the entries
// [begin, end) (begin at a block's start) of values packed slot by slot. p rows: the heads' weights
// from entry begin on.
template <typename T, int GH, int NV, bool FULL>
inline void values_by_slot(const Call& c, const T* cache, const int32_t* blocks, int64_t h, int64_t begin, int64_t end,
                           const float* const* prow, int64_t d0, int n, const float* scale, float* const* orow) {
  vf acc[GH][NV];
  UNROLL
  for (int i = 0; i < GH; ++i)
    UNROLL
    for (int v = 0; v < NV; ++v) acc[i][v] = vzero();
  const int64_t bs = c.block_size, D = c.head_dim;
  for (int64_t first = begin; first < end; first += bs) {
    const T* values = cache + (int64_t(blocks[first / bs]) * c.kv_heads + h) * c.cell + c.values_at + d0;
    int64_t count = std::min(bs, end - first);
    const int64_t at = first - begin;  // where the block's weights start in the p rows
    for (int64_t s = 0; s < count; ++s) {
      const T* row = values + s * D;
      vf val[NV];
      UNROLL
      for (int v = 0; v < NV; ++v) val[v] = FULL ? vload(row + v * W) : vload_n(row + v * W, n - v * W);
      UNROLL
      for (int i = 0; i < GH; ++i) {
        vf w = vset(prow[i][at + s]);
        UNROLL
        for (int v = 0; v < NV; ++v) acc[i][v] = vfma(w, val[v], acc[i][v]);
      }
    }
  }
  UNROLL
  for (int i = 0; i < GH; ++i)
    UNROLL
    for (int v = 0; v < NV; ++v) {
      vf o = scale ? vmul(acc[i][v], vset(scale[i])) : acc[i][v];
      FULL ? vstore(orow[i] + d0 + v * W, o) : vstore_n(orow[i] + d0 + v * W, o, n - v * W);
    }
}

// 3b. out of heads [i0, i0 + GH), dimensions d[0..3] (repeated where fewer are left; stored for
// the first n) over the entries [begin, end) of values packed dimension by dimension ([D, block_size]).
template <typename T, int GH>
inline void values_by_dim(const Call& c, const T* cache, const int32_t* blocks, int64_t h, int64_t begin, int64_t end,
                          const float* const* prow, const int* d, int n, const float* scale, float* const* orow) {
  vf acc[GH][4];
  UNROLL
  for (int i = 0; i < GH; ++i)
    UNROLL
    for (int j = 0; j < 4; ++j) acc[i][j] = vzero();
  const int64_t bs = c.block_size;
  for (int64_t first = begin; first < end; first += bs) {
    const T* values = cache + (int64_t(blocks[first / bs]) * c.kv_heads + h) * c.cell + c.values_at;
    const T* row[4] = {values + d[0] * bs, values + d[1] * bs, values + d[2] * bs, values + d[3] * bs};
    int64_t count = std::min(bs, end - first);
    const int64_t at = first - begin;  // where the block's weights start in the p rows
    int64_t s = 0;
    for (; s + W <= count; s += W) {
      vf val[4] = {vload(row[0] + s), vload(row[1] + s), vload(row[2] + s), vload(row[3] + s)};
      UNROLL
      for (int i = 0; i < GH; ++i) {
        vf w = vload(prow[i] + at + s);
        UNROLL
        for (int j = 0; j < 4; ++j) acc[i][j] = vfma(w, val[j], acc[i][j]);
      }
    }
    if (s < count) {  // masked: the slots past the length may hold anything, NaN included
      int left = int(count - s);
      vf val[4] = {vload_n(row[0] + s, left), vload_n(row[1] + s, left), vload_n(row[2] + s, left),
                   vload_n(row[3] + s, left)};
      UNROLL
      for (int i = 0; i < GH; ++i) {
        vf w = vload_n(prow[i] + at + s, left);
        UNROLL
        for (int j = 0; j < 4; ++j) acc[i][j] = vfma(w, val[j], acc[i][j]);
      }
    }
  }
  UNROLL
  for (int i = 0; i < GH; ++i) {
    float sums[4];
    vsum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3], sums);
    for (int j = 0; j < n; ++j) orow[i][d[j]] = scale ? sums[j] * scale[i] : sums[j];
  }
}

// Calls body(std::integral_constant<int, GH>) for head groups of at most kHeads over [0, g).
template <typename F>
inline void for_head_groups(int64_t g, F&& body) {
  for (int64_t i0 = 0; i0 < g; i0 += kHeads) {
    switch (std::min<int64_t>(kHeads, g - i0)) {
      case 1: body(i0, std::integral_constant<int, 1>()); break;
      case 2: body(i0, std::integral_constant<int, 2>()); break;
      case 3: body(i0, std::integral_constant<int, 3>()); break;
      default: body(i0, std::integral_constant<int, 4>()); break;
    }
  }
}

// One piece of a task: the entries [begin, end) of request r (begin at a block's start) for
// KV head h's group. A whole request (begin 0, end its length, split null) leaves the finished
// rows: out, the probabilities normalised, the tails of the statistics. A piece of a split one
// leaves, per head, its max m, its sum l of exp(z - m) (kept unnormalised in the probabilities'
// rows) and its unnormalised output [g, D] in split (m, l, then the outputs), for combine().
template <typename T>
void attend_piece(const Call& c, int64_t r, int64_t h, int64_t begin, int64_t end, float* split) {
  const T* cache = static_cast<const T*>(c.cache);
  const int64_t g = c.group, D = c.head_dim, bs = c.block_size, length = c.lens[r], span = end - begin;
  const int32_t* blocks = c.table + r * c.table_stride;
  const int64_t stats_row = (r * c.kv_heads + h) * g;  // row of head 0 of the group in logits / probs
  Scratch& own = scratch();
  if (own.q.size() < size_t(g * D)) own.q.resize(g * D);
  float* qs = own.q.data();
  const int64_t q_at = (r * c.heads + h * g) * D;
  if (c.q_dtype == 1)
    scaled_query(static_cast<const bf16_t*>(c.q) + q_at, g * D, c.scaling, qs);
  else if (c.q_dtype == 2)
    scaled_query(static_cast<const f16_t*>(c.q) + q_at, g * D, c.scaling, qs);
  else
    scaled_query(static_cast<const float*>(c.q) + q_at, g * D, c.scaling, qs);
  // z from entry begin on: the probabilities' rows when asked for (the softmax runs in place),
  // else scratch
  float* z;
  int64_t z_stride;
  if (c.probs) {
    z = c.probs + stats_row * c.max_len + begin;
    z_stride = c.max_len;
  } else {
    z_stride = std::max<int64_t>(span, 1);
    if (own.z.size() < size_t(g * z_stride)) own.z.resize(g * z_stride);
    z = own.z.data();
  }
  float* lbase = c.logits ? c.logits + stats_row * c.max_len + begin : nullptr;

  // 1. logits, block by block: each key read once per group of kHeads heads
  for (int64_t first = begin; first < end; first += bs) {
    const int64_t block = blocks[first / bs], at = first - begin;
    const T* keys = cache + (block * c.kv_heads + h) * c.cell + c.keys_at;
    const float* words =
        c.bias_word >= 0 ? c.words + (block * c.kv_heads + h) * c.cell_words + c.words_at + c.bias_word : nullptr;
    const int count = int(std::min(bs, end - first));
    if (c.keys_by_dim) {
      for (int s0 = 0; s0 < count; s0 += kVecs * W) {
        const int n = std::min(count - s0, kVecs * W);
        vf bias[kVecs];
        if (words) {
          UNROLL
          for (int v = 0; v < kVecs; ++v)
            bias[v] = vgather(words + int64_t(s0 + v * W) * c.word_count, int(c.word_count), n - v * W);
        }
        for_head_groups(g, [&](int64_t i0, auto gh) {
          constexpr int GH = decltype(gh)::value;
          float* zrow[GH];
          float* lrow[GH];
          UNROLL
          for (int i = 0; i < GH; ++i) {
            zrow[i] = z + (i0 + i) * z_stride + at;
            lrow[i] = lbase ? lbase + (i0 + i) * c.max_len + at : nullptr;
          }
          if (n == kVecs * W)
            logits_by_dim<T, GH, true>(c, keys, qs + i0 * D, s0, n, words ? bias : nullptr, zrow, lbase ? lrow : nullptr);
          else
            logits_by_dim<T, GH, false>(c, keys, qs + i0 * D, s0, n, words ? bias : nullptr, zrow, lbase ? lrow : nullptr);
        });
      }
    } else {
      for (int s0 = 0; s0 < count; s0 += 4) {
        const int n = std::min(count - s0, 4);
        int s[4];
        float bias[4] = {0, 0, 0, 0};
        UNROLL
        for (int j = 0; j < 4; ++j) {
          s[j] = s0 + std::min(j, n - 1);
          if (words) bias[j] = words[int64_t(s[j]) * c.word_count];
        }
        for_head_groups(g, [&](int64_t i0, auto gh) {
          constexpr int GH = decltype(gh)::value;
          float* zrow[GH];
          float* lrow[GH];
          UNROLL
          for (int i = 0; i < GH; ++i) {
            zrow[i] = z + (i0 + i) * z_stride;
            lrow[i] = lbase ? lbase + (i0 + i) * c.max_len : nullptr;
          }
          logits_by_slot<T, GH>(c, keys, qs + i0 * D, s, n, words ? bias : nullptr, zrow, lbase ? lrow : nullptr, at);
        });
      }
    }
  }
  const bool whole = split == nullptr;
  if (lbase && whole)  // -inf past the length
    for (int64_t i = 0; i < g; ++i)
      std::fill(lbase + i * c.max_len + length, lbase + (i + 1) * c.max_len, -std::numeric_limits<float>::infinity());

  // 2. softmax per head, in place: exp(z - max) and its sum; normalised in the probabilities'
  // rows of a whole request (else out is scaled by 1 / sum, or the pieces combined later)
  float inverse_small[64];
  std::vector<float> inverse_big;
  float* inv = inverse_small;
  if (g > 64) {
    inverse_big.resize(g);
    inv = inverse_big.data();
  }
  for (int64_t i = 0; i < g; ++i) {
    float* zi = z + i * z_stride;
    vf top_v = vset(-std::numeric_limits<float>::infinity());
    int64_t s = 0;
    for (; s + W <= span; s += W) top_v = vmax(top_v, vload(zi + s));
    float top = vtop(top_v);
    for (; s < span; ++s) top = std::max(top, zi[s]);
    float total = 0.0f;
    if (!(top > -std::numeric_limits<float>::infinity())) {  // nothing visible (or empty): zeros
      std::fill(zi, zi + span, 0.0f);
    } else {
      vf total_v = vzero(), shift = vset(-top);
      for (s = 0; s + W <= span; s += W) {
        vf e = vexp(vadd(vload(zi + s), shift));
        vstore(zi + s, e);
        total_v = vadd(total_v, e);
      }
      total = vsum(total_v);
      if (s < span) {
        int left = int(span - s);
        vstore_n(zi + s, vexp(vadd(vload_n(zi + s, left), shift)), left);
        total += vsum(vload_n(zi + s, left));  // the lanes past the piece read as 0
      }
    }
    inv[i] = total > 0.0f ? 1.0f / total : 0.0f;
    if (!whole) {
      split[i] = top;
      split[g + i] = total;
    } else if (c.probs) {
      vf scale = vset(inv[i]);
      for (s = 0; s + W <= span; s += W) vstore(zi + s, vmul(vload(zi + s), scale));
      for (; s < span; ++s) zi[s] *= inv[i];
      std::fill(zi + span, zi + c.max_len, 0.0f);
    }
  }
  // where the output goes: out itself (scaled by 1 / sum unless normalised already; through
  // scratch when it is bf16), or the piece's
  float* out;
  if (!whole) {
    out = split + 2 * g;
  } else if (c.out_bf16) {
    if (own.o.size() < size_t(g * D)) own.o.resize(g * D);
    out = own.o.data();
  } else {
    out = static_cast<float*>(c.out) + q_at;
  }
  const float* scale = whole && !c.probs ? inv : nullptr;

  // 3. values, every block once per group of kHeads heads (and kVecs * W dimensions)
  for_head_groups(g, [&](int64_t i0, auto gh) {
    constexpr int GH = decltype(gh)::value;
    const float* prow[GH];
    float* orow[GH];
    UNROLL
    for (int i = 0; i < GH; ++i) {
      prow[i] = z + (i0 + i) * z_stride;
      orow[i] = out + (i0 + i) * D;
    }
    const float* sc = scale ? scale + i0 : nullptr;
    if (c.values_by_dim) {
      for (int d0 = 0; d0 < D; d0 += 4) {
        const int n = int(std::min<int64_t>(4, D - d0));
        int d[4];
        UNROLL
        for (int j = 0; j < 4; ++j) d[j] = d0 + std::min(j, n - 1);
        values_by_dim<T, GH>(c, cache, blocks, h, begin, end, prow, d, n, sc, orow);
      }
    } else {
      for (int64_t d0 = 0; d0 < D; d0 += kVecs * W) {
        const int n = int(std::min<int64_t>(kVecs * W, D - d0));
        if (n == kVecs * W)
          values_by_slot<T, GH, kVecs, true>(c, cache, blocks, h, begin, end, prow, d0, n, sc, orow);
        else
          values_by_slot<T, GH, kVecs, false>(c, cache, blocks, h, begin, end, prow, d0, n, sc, orow);
      }
    }
  });
  if (whole && c.out_bf16) {
    uint16_t* narrow = static_cast<uint16_t*>(c.out) + q_at;
    for (int64_t e = 0; e < g * D; ++e) narrow[e] = to_bf16(out[e]);
  }
}

// A split task's pieces into its rows: out = sum_p w_p o_p / sum_p w_p l_p with w_p = exp(m_p - M),
// the probabilities rescaled piece by piece, the statistics' tails.
void combine(const Call& c, int64_t r, int64_t h, int64_t pieces, int64_t piece_entries, const float* split) {
  const int64_t g = c.group, D = c.head_dim, length = c.lens[r], stride = g * (D + 2);
  const int64_t stats_row = (r * c.kv_heads + h) * g;
  const int64_t out_at = (r * c.heads + h * g) * D;
  Scratch& own = scratch();
  if (c.out_bf16 && own.o.size() < size_t(g * D)) own.o.resize(g * D);
  float* out = c.out_bf16 ? own.o.data() : static_cast<float*>(c.out) + out_at;
  for (int64_t i = 0; i < g; ++i) {
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < pieces; ++p) top = std::max(top, split[p * stride + i]);
    float total = 0.0f;
    for (int64_t d = 0; d < D; ++d) out[i * D + d] = 0.0f;
    float weights[64];
    std::vector<float> weights_big;
    float* w = weights;
    if (pieces > 64) {
      weights_big.resize(pieces);
      w = weights_big.data();
    }
    for (int64_t p = 0; p < pieces; ++p) {
      const float* piece = split + p * stride;
      w[p] = top > -std::numeric_limits<float>::infinity() && piece[i] > -std::numeric_limits<float>::infinity()
                 ? std::exp(piece[i] - top)
                 : 0.0f;
      total += w[p] * piece[g + i];
      const float* o = piece + 2 * g + i * D;
      for (int64_t d = 0; d < D; ++d) out[i * D + d] += w[p] * o[d];
    }
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    for (int64_t d = 0; d < D; ++d) out[i * D + d] *= inv;
    if (c.probs) {
      float* row = c.probs + (stats_row + i) * c.max_len;
      for (int64_t p = 0; p < pieces; ++p) {
        const float factor = w[p] * inv;
        for (int64_t s = p * piece_entries; s < std::min(length, (p + 1) * piece_entries); ++s) row[s] *= factor;
      }
      std::fill(row + length, row + c.max_len, 0.0f);
    }
    if (c.logits) {
      float* row = c.logits + (stats_row + i) * c.max_len;
      std::fill(row + length, row + c.max_len, -std::numeric_limits<float>::infinity());
    }
  }
  if (c.out_bf16) {
    uint16_t* narrow = static_cast<uint16_t*>(c.out) + out_at;
    for (int64_t e = 0; e < g * D; ++e) narrow[e] = to_bf16(out[e]);
  }
}

}  // namespace

namespace {

// Checks every request's length and the blocks it reads: 0, or an error code (see decode()).
int check(const Call& c, int64_t* where) {
  const int64_t plane = c.block_size * c.head_dim;
  if (c.keys_at < 0 || c.keys_at + plane > c.cell || c.values_at < 0 || c.values_at + plane > c.cell ||
      (c.bias_word >= 0 && (c.words_at < 0 || c.bias_word >= c.word_count ||
                            c.words_at + c.block_size * c.word_count > c.cell_words)))
    return 3;
  for (int64_t r = 0; r < c.rows; ++r) {
    const int64_t length = c.lens[r];
    if (length < 0 || length > c.max_len) {
      *where = r;
      return 1;
    }
    const int32_t* blocks = c.table + r * c.table_stride;
    for (int64_t b = 0; b * c.block_size < length; ++b)
      if (blocks[b] < 0 || blocks[b] >= c.blocks_in_cache) {
        *where = r;
        return 2;
      }
  }
  return 0;
}

// Runs body(worker) on up to `threads` of torch's threads, each taking tasks from a shared counter.
template <typename F>
void on_threads(int64_t threads, F&& body) {
  if (threads <= 1)
    body(0, 1);
  else
    at::parallel_for(0, threads, 1, body);
}

template <typename T>
void run(const Call& c) {
  const int64_t tasks = c.rows * c.kv_heads, bs = c.block_size;
  int64_t entries = 0;
  for (int64_t r = 0; r < c.rows; ++r) entries += c.lens[r];
  const int64_t work = entries * c.kv_heads * (c.group + 1) * c.head_dim;
  int64_t threads = work < (int64_t(1) << 16) ? 1 : at::get_num_threads();  // too little to wake a thread for
  // Fewer tasks (request, KV head) than twice the threads: each request split into pieces of
  // whole blocks (at least kPieceEntries entries), so that every thread has work.
  constexpr int64_t kPieceEntries = 256;
  int64_t piece_blocks = 0;  // 0: no split
  if (threads > 1 && tasks < 2 * threads) {
    const int64_t blocks = (entries + bs - 1) / bs * c.kv_heads;  // about
    piece_blocks = std::max((kPieceEntries + bs - 1) / bs, blocks / (4 * threads));
  }
  // longest requests first, handed out one task (or piece) at a time
  std::vector<int32_t> order(c.rows);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return c.lens[a] > c.lens[b]; });
  std::atomic<int64_t> next{0};
  if (!piece_blocks) {
    threads = std::min(threads, tasks);
    on_threads(threads, [&](int64_t, int64_t) {
      for (int64_t t = next.fetch_add(1, std::memory_order_relaxed); t < tasks;
           t = next.fetch_add(1, std::memory_order_relaxed))
        attend_piece<T>(c, order[t / c.kv_heads], t % c.kv_heads, 0, c.lens[order[t / c.kv_heads]], nullptr);
    });
    return;
  }
  // pieces: (row, KV head, piece) in order; a request of one piece runs whole
  const int64_t piece_entries = piece_blocks * bs, stride = c.group * (c.head_dim + 2);
  struct Piece {
    int32_t r, h, p, pieces;
    int64_t slot;  // where its partial results go in `partial` (-1: a whole request)
  };
  std::vector<Piece> list;
  int64_t slots = 0;
  for (int32_t r : order) {
    const int64_t pieces = std::max<int64_t>(1, (c.lens[r] + piece_entries - 1) / piece_entries);
    for (int32_t h = 0; h < c.kv_heads; ++h)
      for (int32_t p = 0; p < pieces; ++p)
        list.push_back({r, h, p, int32_t(pieces), pieces > 1 ? slots++ : -1});
  }
  std::vector<float> partial(size_t(slots * stride));
  const int64_t count = int64_t(list.size());
  on_threads(std::min(threads, count), [&](int64_t, int64_t) {
    for (int64_t t = next.fetch_add(1, std::memory_order_relaxed); t < count;
         t = next.fetch_add(1, std::memory_order_relaxed)) {
      const Piece& piece = list[t];
      const int64_t begin = piece.p * piece_entries, end = std::min<int64_t>(c.lens[piece.r], begin + piece_entries);
      attend_piece<T>(c, piece.r, piece.h, begin, piece.pieces > 1 ? end : c.lens[piece.r],
                      piece.slot >= 0 ? partial.data() + piece.slot * stride : nullptr);
    }
  });
  // combine each split task (its pieces' slots are consecutive)
  for (const Piece& piece : list)
    if (piece.p == 0 && piece.pieces > 1)
      combine(c, piece.r, piece.h, piece.pieces, piece_entries, partial.data() + piece.slot * stride);
}

// The call: raw addresses (the Python side owns and checks the tensors) and the geometry, in
// paged_cpp._cpp_decode's order. dtype (the cache's, a[7]; the query's, a[25]): 0 fp32, 1 bf16,
// 2 fp16; a[26]: out is bf16. Returns 0, or 1 (a length < 0 or > max_len) or 2 (a block out
// of the cache) with the request's row in *where, or 3 (planes or words outside a cell); nothing
// is written then.
int decode(const int64_t* a, double scaling, int64_t* where) {
  Call c;
  c.q = reinterpret_cast<const void*>(a[0]);
  c.cache = reinterpret_cast<const void*>(a[1]);
  c.words = reinterpret_cast<const float*>(a[1]);
  c.table = reinterpret_cast<const int32_t*>(a[2]);
  c.lens = reinterpret_cast<const int32_t*>(a[3]);
  c.out = reinterpret_cast<void*>(a[4]);
  c.logits = reinterpret_cast<float*>(a[5]);
  c.probs = reinterpret_cast<float*>(a[6]);
  const int64_t dtype = a[7];
  c.rows = a[8];
  c.heads = a[9];
  c.head_dim = a[10];
  c.kv_heads = a[11];
  c.group = c.kv_heads > 0 ? c.heads / c.kv_heads : 0;
  c.block_size = a[12];
  c.cell = a[13];
  c.keys_at = a[14];
  c.values_at = a[15];
  c.keys_by_dim = a[16] != 0;
  c.values_by_dim = a[17] != 0;
  c.words_at = a[18];
  c.word_count = a[19];
  c.bias_word = a[20];
  c.cell_words = a[21];
  c.table_stride = a[22];
  c.max_len = a[23];
  c.blocks_in_cache = a[24];
  c.q_dtype = int(a[25]);
  c.out_bf16 = a[26] != 0;
  c.scaling = float(scaling);
  if (c.kv_heads < 1 || c.head_dim < 1 || c.block_size < 1 || c.heads % c.kv_heads || c.rows < 0 || c.max_len < 0)
    return 3;
  int error = check(c, where);
  if (error) return error;
  if (dtype == 1)
    run<bf16_t>(c);
  else if (dtype == 2)
    run<f16_t>(c);
  else
    run<float>(c);
  return 0;
}

// -- KeepKV's EMA fold ---------------------------------------------------------------------------
// The r query rows of a decode interval folded into KeepKV's EMA of attention scores (eq. 8), per
// (row, KV head) and entry s, in one pass over the rows' scores (keepkv/kernels/ema.py has the
// contract and the torch reference):
//
//     new_h(s) = ln sum_{i<r, pos_s <= qpos_i} exp(score_{h,i,s} + ln(1 - a) + (r - 1 - i) ln a)
//     out_h(s) = logaddexp(old_h(s) + r ln a, new_h(s))
//
// where, pooled (one EMA word per KV head), the sum also runs over the group's g query heads and
// new(s) takes - ln g. A row at position -1 (padding) sees nothing.
struct Fold {
  const float* scores;      // [B, H_kv, g, r, S], S contiguous
  const float* old;         // [B, H_kv, S, g'] (g' = 1 pooled, else g)
  const int64_t* pos;       // [B, H_kv, S] or null (every row sees every entry)
  const int64_t* qpos;      // [B, r]
  float* out;               // [B, H_kv, g', S] contiguous
  int64_t batch, kv_heads, group, rows, size;
  int64_t sb, sk, sg, sr;   // scores' strides
  int64_t ob, ok, os, oh;   // old's
  int64_t pb, pk, ps;       // pos'
  int64_t qb, qr;           // qpos'
  bool pool;
  float log_fresh, log_alpha, decay;
};

void fold_task(const Fold& f, int64_t b, int64_t k, std::vector<float>& scratch) {
  const int64_t r = f.rows, S = f.size;
  scratch.resize(size_t((r + 3) * S));
  float* add = scratch.data();  // [r, S]: the row's weight where it sees the entry, else -inf
  float* top = add + r * S;
  float* total = top + S;
  float* kept = total + S;  // the old state, decayed
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < r; ++i) {
    const float weight = f.log_fresh + float(r - 1 - i) * f.log_alpha;
    float* row = add + i * S;
    if (!f.pos) {
      std::fill(row, row + S, weight);
      continue;
    }
    const int64_t seen = f.qpos[b * f.qb + i * f.qr];
    const int64_t* pos = f.pos + b * f.pb + k * f.pk;
    for (int64_t s = 0; s < S; ++s) row[s] = pos[s * f.ps] <= seen ? weight : kNegInf;
  }
  const int64_t outputs = f.pool ? 1 : f.group, heads = f.pool ? f.group : 1;
  const float inv_heads = 1.0f / float(heads);
  for (int64_t o = 0; o < outputs; ++o) {
    const float* first = f.scores + b * f.sb + k * f.sk + (f.pool ? 0 : o * f.sg);
    const float* old = f.old + b * f.ob + k * f.ok + o * f.oh;
    for (int64_t s = 0; s < S; ++s) kept[s] = old[s * f.os] + f.decay;
    // out = ln(exp(kept) + (1/g) sum exp(v)) = m + ln(exp(kept - m) + (1/g) sum exp(v - m)), m the max
    // of them all: one pass for m, one for the sum, one logarithm per entry
    for (int64_t s = 0; s < S; s += W) {
      const int n = int(std::min<int64_t>(W, S - s));
      const vf old_s = vload_n(kept + s, n);
      vf m = old_s;
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t i = 0; i < r; ++i)
          m = vmax(m, vadd(vload_n(first + h * f.sg + i * f.sr + s, n), vload_n(add + i * S + s, n)));
      vf sum = vzero();
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t i = 0; i < r; ++i)
          sum = vadd(sum, vexp(vsub(vadd(vload_n(first + h * f.sg + i * f.sr + s, n), vload_n(add + i * S + s, n)), m)));
      sum = vfma(sum, vset(inv_heads), vexp(vsub(old_s, m)));  // exp(-inf - -inf) = exp(NaN): 0
      vstore_n(top + s, m, n);
      vstore_n(total + s, sum, n);
    }
    float* out = f.out + ((b * f.kv_heads + k) * outputs + o) * S;
    for (int64_t s = 0; s < S; ++s) out[s] = total[s] > 0.0f ? top[s] + std::log(total[s]) : kNegInf;
  }
}

// Returns 0, or 1 (a shape or stride the fold does not take); nothing is written then.
int ema_fold(const int64_t* a, const double* d) {
  Fold f;
  f.scores = reinterpret_cast<const float*>(a[0]);
  f.old = reinterpret_cast<const float*>(a[1]);
  f.pos = reinterpret_cast<const int64_t*>(a[2]);
  f.qpos = reinterpret_cast<const int64_t*>(a[3]);
  f.out = reinterpret_cast<float*>(a[4]);
  f.batch = a[5];
  f.kv_heads = a[6];
  f.group = a[7];
  f.rows = a[8];
  f.size = a[9];
  f.sb = a[10], f.sk = a[11], f.sg = a[12], f.sr = a[13];
  f.ob = a[14], f.ok = a[15], f.os = a[16], f.oh = a[17];
  f.pb = a[18], f.pk = a[19], f.ps = a[20];
  f.qb = a[21], f.qr = a[22];
  f.pool = a[23] != 0;
  f.log_fresh = float(d[0]);
  f.log_alpha = float(d[1]);
  f.decay = float(d[2]);
  if (f.batch < 0 || f.kv_heads < 1 || f.group < 1 || f.rows < 1 || f.size < 0 || !f.scores || !f.old || !f.qpos || !f.out)
    return 1;
  const int64_t tasks = f.batch * f.kv_heads;
  const int64_t work = tasks * f.group * f.rows * f.size;
  const int64_t threads = work < (int64_t(1) << 16) ? 1 : std::min<int64_t>(at::get_num_threads(), tasks);
  std::atomic<int64_t> next{0};
  on_threads(threads, [&](int64_t, int64_t) {
    std::vector<float> scratch;
    for (int64_t t = next.fetch_add(1, std::memory_order_relaxed); t < tasks; t = next.fetch_add(1, std::memory_order_relaxed))
      fold_task(f, t / f.kv_heads, t % f.kv_heads, scratch);
  });
  return 0;
}

constexpr Py_ssize_t kFoldInts = 24, kFoldDoubles = 3;

// -- the kept queries' masked softmax -----------------------------------------------------------
// The attention each query row a cache kept since its last compression gave (keepkv/kernels/kept.py
// has the contract and the torch reference): per (row, KV head), query head h and kept query i,
//
//     probs(s) = exp(logits(s) + bias(s)) / sum_{pos_t <= qpos_i} exp(logits(t) + bias(t))
//
// where pos_s <= qpos_i, else 0 (a row that sees nothing: all 0).
// Each row's visible bias ([N, S], -inf where it sees nothing) is built once per (row, KV head)
// and read by the group's heads; a row is three passes in L1: max, exp and sum, scale.
struct KeptSoftmax {
  const float* logits;  // [B, H_kv, g, N, S], S contiguous
  const float* bias;    // [B, H_kv, S]
  const int64_t* pos;   // [B, H_kv, S]
  const int64_t* qpos;  // [B, N]
  float* probs;         // [B, H_kv, g, N, S] contiguous
  int64_t batch, kv_heads, group, rows, size;
  int64_t lb, lk, lg, lr;  // logits' strides
  int64_t bb, bk, bs;      // bias'
  int64_t pb, pk, ps;      // pos'
  int64_t qb, qr;          // qpos'
};

void kept_softmax_task(const KeptSoftmax& f, int64_t b, int64_t k, std::vector<float>& scratch) {
  const int64_t N = f.rows, S = f.size;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  scratch.resize(size_t((N + 2) * S));
  float* add = scratch.data();  // [N, S]: the bias where the row sees the entry, else -inf
  float* bias = add + N * S;    // [S], contiguous
  float* at = bias + S;         // [S]: the positions as floats, exact below 2^24
  const float* bias_in = f.bias + b * f.bb + k * f.bk;
  const int64_t* pos = f.pos + b * f.pb + k * f.pk;
  constexpr int64_t kExact = int64_t(1) << 24;
  bool exact = true;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t p = pos[s * f.ps];
    exact = exact && p < kExact && p > -kExact;
    at[s] = float(p);
    bias[s] = bias_in[s * f.bs];
  }
  for (int64_t i = 0; i < N; ++i) {
    const int64_t seen = f.qpos[b * f.qb + i * f.qr];
    float* row = add + i * S;
    if (!exact || seen >= kExact || seen <= -kExact) {  // compared as integers
      for (int64_t s = 0; s < S; ++s) row[s] = pos[s * f.ps] <= seen ? bias[s] : kNegInf;
      continue;
    }
    const vf limit = vset(float(seen));
    for (int64_t s = 0; s < S; s += W) {  // a later entry than the row's query: -inf
      const int n = int(std::min<int64_t>(W, S - s));
      vstore_n(row + s, vwhere_gt(vload_n(at + s, n), limit, vset(kNegInf), vload_n(bias + s, n)), n);
    }
  }
  for (int64_t h = 0; h < f.group; ++h) {
    for (int64_t i = 0; i < N; ++i) {
      const float* logits = f.logits + b * f.lb + k * f.lk + h * f.lg + i * f.lr;
      const float* row = add + i * S;
      float* probs = f.probs + (((b * f.kv_heads + k) * f.group + h) * N + i) * S;
      vf top = vset(kNegInf);
      for (int64_t s = 0; s < S; s += W) {
        const int n = int(std::min<int64_t>(W, S - s));
        top = vmax(top, vadd(vload_n(logits + s, n), vload_n_or(row + s, n, kNegInf)));  // past S: -inf
      }
      const float m = vtop(top);
      if (m == kNegInf) {  // sees nothing (a padding row)
        std::fill(probs, probs + S, 0.0f);
        continue;
      }
      vf total = vzero();
      for (int64_t s = 0; s < S; s += W) {
        const int n = int(std::min<int64_t>(W, S - s));
        const vf e = vexp(vsub(vadd(vload_n(logits + s, n), vload_n_or(row + s, n, kNegInf)), vset(m)));
        vstore_n(probs + s, e, n);
        total = vadd(total, e);
      }
      const vf scale = vset(1.0f / vsum(total));
      for (int64_t s = 0; s < S; s += W) {
        const int n = int(std::min<int64_t>(W, S - s));
        vstore_n(probs + s, vmul(vload_n(probs + s, n), scale), n);
      }
    }
  }
}

// Returns 0, or 1 (a shape the pass does not take); nothing is written then.
int kept_softmax(const int64_t* a) {
  KeptSoftmax f;
  f.logits = reinterpret_cast<const float*>(a[0]);
  f.bias = reinterpret_cast<const float*>(a[1]);
  f.pos = reinterpret_cast<const int64_t*>(a[2]);
  f.qpos = reinterpret_cast<const int64_t*>(a[3]);
  f.probs = reinterpret_cast<float*>(a[4]);
  f.batch = a[5], f.kv_heads = a[6], f.group = a[7], f.rows = a[8], f.size = a[9];
  f.lb = a[10], f.lk = a[11], f.lg = a[12], f.lr = a[13];
  f.bb = a[14], f.bk = a[15], f.bs = a[16];
  f.pb = a[17], f.pk = a[18], f.ps = a[19];
  f.qb = a[20], f.qr = a[21];
  if (f.batch < 0 || f.kv_heads < 1 || f.group < 1 || f.rows < 1 || f.size < 1 || !f.logits || !f.bias || !f.pos ||
      !f.qpos || !f.probs)
    return 1;
  const int64_t tasks = f.batch * f.kv_heads;
  const int64_t work = tasks * f.group * f.rows * f.size;
  const int64_t threads = work < (int64_t(1) << 16) ? 1 : std::min<int64_t>(at::get_num_threads(), tasks);
  std::atomic<int64_t> next{0};
  on_threads(threads, [&](int64_t, int64_t) {
    std::vector<float> scratch;
    for (int64_t t = next.fetch_add(1, std::memory_order_relaxed); t < tasks; t = next.fetch_add(1, std::memory_order_relaxed))
      kept_softmax_task(f, t / f.kv_heads, t % f.kv_heads, scratch);
  });
  return 0;
}

constexpr Py_ssize_t kKeptInts = 22;

// -- the most cosine-similar candidate ----------------------------------------------------------
// For each evicted entry e of a (row, KV head), the allowed slot t whose key is most cosine-similar
// (D2O eq. 8; KeepKV's merge target; keepkv.merging.cosine_nearest has the contract):
//
//     u_e = k_e / max(|k_e|, 1e-12),   sim(e, t) = (k_t . u_e) / max(|k_t|, 1e-12)
//
// the first t of the largest sim, and that sim (-inf, slot 0, where no slot is allowed). Keys
// fp32, bf16 or fp16 [B, H_kv, S, D] with D contiguous; src [B, H_kv, E] int64 (negative: 0);
// allowed [B, H_kv, S] bool. Out: idx [B, H_kv, E] int64, sim [B, H_kv, E] fp32, contiguous.
struct Nearest {
  const void* keys;
  const int64_t* src;
  const uint8_t* allowed;
  int64_t* idx;
  float* sim;
  int64_t batch, kv_heads, size, dim, evicted;
  int64_t kb, kk, ks;  // keys' strides (elements)
  int64_t sb, sk, se;  // src's
  int64_t ab, ak, as;  // allowed's
};

template <typename T>
float dot(const T* a, const float* u, int64_t dim) {
  vf acc = vzero();
  for (int64_t d = 0; d < dim; d += W) {
    const int n = int(std::min<int64_t>(W, dim - d));
    acc = vfma(vload_n(a + d, n), vload_n(u + d, n), acc);
  }
  return vsum(acc);
}

constexpr int kCandidates = 8;  // candidates in flight in the search

// The evicted entries' unit keys are laid out dimension by dimension ([D, E], E padded to whole
// vectors), so each candidate's key, one broadcast per dimension, takes W evicted entries at once:
// their similarities and the running best of each are lanes, with no horizontal sums. Eight
// candidates, two sums each (even and odd dimensions), are in flight; they are then compared in
// slot order, strictly greater, so each lane keeps the first of its largest.
template <typename T>
void nearest_task(const Nearest& f, int64_t b, int64_t k, std::vector<float>& scratch, std::vector<int32_t>& slots) {
  const T* keys = static_cast<const T*>(f.keys) + b * f.kb + k * f.kk;
  const uint8_t* allowed = f.allowed + b * f.ab + k * f.ak;
  const int64_t D = f.dim;
  slots.clear();
  for (int64_t s = 0; s < f.size; ++s)
    if (allowed[s * f.as]) slots.push_back(int32_t(s));
  const int64_t count = int64_t(slots.size());
  const int64_t lanes = (f.evicted + W - 1) / W * W;
  scratch.assign(size_t(D * lanes + kCandidates * D + W), 0.0f);
  float* units = scratch.data();             // [D, lanes]: evicted entry e's unit key at units[d * lanes + e]
  float* widened = units + D * lanes;        // [kCandidates, D]: keys in fp32, then W lanes out
  const int64_t* src = f.src + b * f.sb + k * f.sk;
  for (int64_t e = 0; e < f.evicted; ++e) {
    const T* key = keys + std::max<int64_t>(src[e * f.se], 0) * f.ks;
    for (int64_t d = 0; d < D; d += W) {
      const int n = int(std::min<int64_t>(W, D - d));
      vstore_n(widened + d, vload_n(key + d, n), n);
    }
    const float norm = std::max(std::sqrt(dot(widened, widened, D)), 1e-12f);
    for (int64_t d = 0; d < D; ++d) units[d * lanes + e] = widened[d] / norm;
  }
  int64_t* idx = f.idx + (b * f.kv_heads + k) * f.evicted;
  float* sim = f.sim + (b * f.kv_heads + k) * f.evicted;
  float* best_out = widened + kCandidates * D;  // [W]
  for (int64_t e0 = 0; e0 < lanes; e0 += W) {
    vf best = vset(-std::numeric_limits<float>::infinity()), at = vzero();  // slots as floats: exact below 2^24
    for (int64_t c0 = 0; c0 < count; c0 += kCandidates) {
      const int here = int(std::min<int64_t>(kCandidates, count - c0));
      float norm[kCandidates];
      for (int j = 0; j < kCandidates; ++j) {
        float* key = widened + j * D;
        if (j >= here) {  // past the last candidate: a zero key, never compared
          std::fill(key, key + D, 0.0f);
          norm[j] = 1.0f;
          continue;
        }
        const T* from = keys + slots[c0 + j] * f.ks;
        for (int64_t d = 0; d < D; d += W) {
          const int n = int(std::min<int64_t>(W, D - d));
          vstore_n(key + d, vload_n(from + d, n), n);
        }
        norm[j] = std::max(std::sqrt(dot(key, key, D)), 1e-12f);
      }
      vf even[kCandidates], odd[kCandidates];
      UNROLL for (int j = 0; j < kCandidates; ++j) even[j] = odd[j] = vzero();
      int64_t d = 0;
      for (; d + 2 <= D; d += 2) {
        const vf u0 = vload(units + d * lanes + e0), u1 = vload(units + (d + 1) * lanes + e0);
        UNROLL for (int j = 0; j < kCandidates; ++j) {
          even[j] = vfma(vset(widened[j * D + d]), u0, even[j]);
          odd[j] = vfma(vset(widened[j * D + d + 1]), u1, odd[j]);
        }
      }
      if (d < D) {
        const vf u0 = vload(units + d * lanes + e0);
        UNROLL for (int j = 0; j < kCandidates; ++j) even[j] = vfma(vset(widened[j * D + d]), u0, even[j]);
      }
      for (int j = 0; j < here; ++j) {
        const vf similarity = vdiv(vadd(even[j], odd[j]), vset(norm[j]));
        at = vwhere_gt(similarity, best, vset(float(slots[c0 + j])), at);
        best = vwhere_gt(similarity, best, similarity, best);
      }
    }
    const int n = int(std::min<int64_t>(W, f.evicted - e0));
    vstore_n(best_out, best, n);
    for (int i = 0; i < n; ++i) sim[e0 + i] = best_out[i];
    vstore_n(best_out, at, n);
    for (int i = 0; i < n; ++i) idx[e0 + i] = int64_t(best_out[i]);
  }
}

// Returns 0, or 1 (a shape the search does not take); nothing is written then.
int nearest(const int64_t* a) {
  Nearest f;
  f.keys = reinterpret_cast<const void*>(a[0]);
  f.src = reinterpret_cast<const int64_t*>(a[1]);
  f.allowed = reinterpret_cast<const uint8_t*>(a[2]);
  f.idx = reinterpret_cast<int64_t*>(a[3]);
  f.sim = reinterpret_cast<float*>(a[4]);
  const int64_t dtype = a[5];
  f.batch = a[6], f.kv_heads = a[7], f.size = a[8], f.dim = a[9], f.evicted = a[10];
  f.kb = a[11], f.kk = a[12], f.ks = a[13];
  f.sb = a[14], f.sk = a[15], f.se = a[16];
  f.ab = a[17], f.ak = a[18], f.as = a[19];
  if (f.batch < 0 || f.kv_heads < 1 || f.size < 0 || f.dim < 1 || f.evicted < 0 || dtype < 0 || dtype > 2) return 1;
  const int64_t tasks = f.batch * f.kv_heads;
  const int64_t work = tasks * f.evicted * f.size * f.dim;
  const int64_t threads = work < (int64_t(1) << 18) ? 1 : std::min<int64_t>(at::get_num_threads(), tasks);
  std::atomic<int64_t> next{0};
  on_threads(threads, [&](int64_t, int64_t) {
    std::vector<float> scratch;
    std::vector<int32_t> slots;
    for (int64_t t = next.fetch_add(1, std::memory_order_relaxed); t < tasks; t = next.fetch_add(1, std::memory_order_relaxed)) {
      if (dtype == 1)
        nearest_task<bf16_t>(f, t / f.kv_heads, t % f.kv_heads, scratch, slots);
      else if (dtype == 2)
        nearest_task<f16_t>(f, t / f.kv_heads, t % f.kv_heads, scratch, slots);
      else
        nearest_task<float>(f, t / f.kv_heads, t % f.kv_heads, scratch, slots);
    }
  });
  return 0;
}

constexpr Py_ssize_t kNearestInts = 20;

// -- the kept entries open to merges ------------------------------------------------------------
// KeepKV's merge gate `protect` (keepkv.kernels.protect.open_to_merges has the contract): of the n
// kept entries of a (row, KV head) whose priority is finite, those ranked r < n * protect (fp32,
// as torch computes it) by (priority descending, slot ascending) take no merges; every other kept
// entry is open. One partial selection (nth_element) per (row, KV head), not a sort. priority
// [B, H_kv, S] fp32, kept [B, H_kv, S] bool (any strides); out [B, H_kv, S] bool, contiguous.
struct OpenRank {
  const float* priority;
  const uint8_t* kept;
  uint8_t* out;
  int64_t batch, kv_heads, size;
  int64_t pb, pk, ps;  // priority's strides (elements)
  int64_t kb, kk, ks;  // kept's
  float protect;
};

void open_task(const OpenRank& f, int64_t b, int64_t k, std::vector<int32_t>& scored) {
  const float* priority = f.priority + b * f.pb + k * f.pk;
  const uint8_t* kept = f.kept + b * f.kb + k * f.kk;
  uint8_t* out = f.out + (b * f.kv_heads + k) * f.size;
  scored.clear();
  for (int64_t s = 0; s < f.size; ++s) {
    out[s] = kept[s * f.ks] ? 1 : 0;
    if (out[s] && std::isfinite(priority[s * f.ps])) scored.push_back(int32_t(s));
  }
  const int64_t n = int64_t(scored.size());
  const float bound = float(n) * f.protect;  // rank r is protected iff float(r) < bound
  const int64_t protected_count = std::min<int64_t>(n, int64_t(std::ceil(bound)));
  if (protected_count <= 0) return;
  auto before = [&](int32_t a, int32_t c) {  // a ranks before c
    const float pa = priority[a * f.ps], pc = priority[c * f.ps];
    return pa > pc || (pa == pc && a < c);
  };
  if (protected_count < n) std::nth_element(scored.begin(), scored.begin() + protected_count, scored.end(), before);
  for (int64_t r = 0; r < protected_count; ++r) out[scored[r]] = 0;
}

// Returns 0, or 1 (a shape it does not take); nothing is written then.
int open_to_merges(const int64_t* a, double protect) {
  OpenRank f;
  f.priority = reinterpret_cast<const float*>(a[0]);
  f.kept = reinterpret_cast<const uint8_t*>(a[1]);
  f.out = reinterpret_cast<uint8_t*>(a[2]);
  f.batch = a[3], f.kv_heads = a[4], f.size = a[5];
  f.pb = a[6], f.pk = a[7], f.ps = a[8];
  f.kb = a[9], f.kk = a[10], f.ks = a[11];
  f.protect = float(protect);
  if (f.batch < 0 || f.kv_heads < 1 || f.size < 0 || f.size >= (int64_t(1) << 24) || !(protect >= 0.0 && protect <= 1.0))
    return 1;
  std::vector<int32_t> scored;
  for (int64_t t = 0; t < f.batch * f.kv_heads; ++t) open_task(f, t / f.kv_heads, t % f.kv_heads, scored);
  return 0;
}

constexpr Py_ssize_t kOpenInts = 12;

constexpr Py_ssize_t kIntArgs = 27;

const char* isa_name() {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  return "avx2";
#else
  return "generic";
#endif
}

}  // namespace

// The Python binding, in CPython's own API (pybind11's headers alone take longer to compile than
// the kernel): decode(27 ints, scaling) -> (error, row), run without the GIL.
extern "C" {

static PyObject* py_decode(PyObject*, PyObject* const* args, Py_ssize_t count) {
  if (count != kIntArgs + 1) {
    PyErr_Format(PyExc_TypeError, "decode takes %d arguments; got %d", int(kIntArgs + 1), int(count));
    return nullptr;
  }
  int64_t a[kIntArgs];
  for (Py_ssize_t i = 0; i < kIntArgs; ++i) {
    a[i] = PyLong_AsLongLong(args[i]);
    if (a[i] == -1 && PyErr_Occurred()) return nullptr;
  }
  const double scaling = PyFloat_AsDouble(args[kIntArgs]);
  if (scaling == -1.0 && PyErr_Occurred()) return nullptr;
  int64_t where = -1;
  int error = 0;
  std::string failure;
  Py_BEGIN_ALLOW_THREADS
  try {
    error = decode(a, scaling, &where);
  } catch (const std::exception& caught) {
    failure = caught.what();
  } catch (...) {
    failure = "unknown C++ exception";
  }
  Py_END_ALLOW_THREADS
  if (!failure.empty()) {
    PyErr_Format(PyExc_RuntimeError, "keepkv's C++ paged kernel failed: %s", failure.c_str());
    return nullptr;
  }
  return Py_BuildValue("(iL)", error, static_cast<long long>(where));
}

static PyObject* py_ema_fold(PyObject*, PyObject* const* args, Py_ssize_t count) {
  if (count != kFoldInts + kFoldDoubles) {
    PyErr_Format(PyExc_TypeError, "ema_fold takes %d arguments; got %d", int(kFoldInts + kFoldDoubles), int(count));
    return nullptr;
  }
  int64_t a[kFoldInts];
  double d[kFoldDoubles];
  for (Py_ssize_t i = 0; i < kFoldInts; ++i) {
    a[i] = PyLong_AsLongLong(args[i]);
    if (a[i] == -1 && PyErr_Occurred()) return nullptr;
  }
  for (Py_ssize_t i = 0; i < kFoldDoubles; ++i) {
    d[i] = PyFloat_AsDouble(args[kFoldInts + i]);
    if (d[i] == -1.0 && PyErr_Occurred()) return nullptr;
  }
  int error = 0;
  Py_BEGIN_ALLOW_THREADS
  error = ema_fold(a, d);
  Py_END_ALLOW_THREADS
  return PyLong_FromLong(error);
}

static PyObject* py_nearest(PyObject*, PyObject* const* args, Py_ssize_t count) {
  if (count != kNearestInts) {
    PyErr_Format(PyExc_TypeError, "nearest takes %d arguments; got %d", int(kNearestInts), int(count));
    return nullptr;
  }
  int64_t a[kNearestInts];
  for (Py_ssize_t i = 0; i < kNearestInts; ++i) {
    a[i] = PyLong_AsLongLong(args[i]);
    if (a[i] == -1 && PyErr_Occurred()) return nullptr;
  }
  int error = 0;
  Py_BEGIN_ALLOW_THREADS
  error = nearest(a);
  Py_END_ALLOW_THREADS
  return PyLong_FromLong(error);
}

static PyObject* py_open_to_merges(PyObject*, PyObject* const* args, Py_ssize_t count) {
  if (count != kOpenInts + 1) {
    PyErr_Format(PyExc_TypeError, "open_to_merges takes %d arguments; got %d", int(kOpenInts + 1), int(count));
    return nullptr;
  }
  int64_t a[kOpenInts];
  for (Py_ssize_t i = 0; i < kOpenInts; ++i) {
    a[i] = PyLong_AsLongLong(args[i]);
    if (a[i] == -1 && PyErr_Occurred()) return nullptr;
  }
  const double protect = PyFloat_AsDouble(args[kOpenInts]);
  if (protect == -1.0 && PyErr_Occurred()) return nullptr;
  int error = 0;
  Py_BEGIN_ALLOW_THREADS
  error = open_to_merges(a, protect);
  Py_END_ALLOW_THREADS
  return PyLong_FromLong(error);
}

static PyObject* py_kept_softmax(PyObject*, PyObject* const* args, Py_ssize_t count) {
  if (count != kKeptInts) {
    PyErr_Format(PyExc_TypeError, "kept_softmax takes %d arguments; got %d", int(kKeptInts), int(count));
    return nullptr;
  }
  int64_t a[kKeptInts];
  for (Py_ssize_t i = 0; i < kKeptInts; ++i) {
    a[i] = PyLong_AsLongLong(args[i]);
    if (a[i] == -1 && PyErr_Occurred()) return nullptr;
  }
  int error = 0;
  Py_BEGIN_ALLOW_THREADS
  error = kept_softmax(a);
  Py_END_ALLOW_THREADS
  return PyLong_FromLong(error);
}

static PyObject* py_isa(PyObject*, PyObject*) { return PyUnicode_FromString(isa_name()); }

static PyMethodDef kMethods[] = {
    {"decode", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(py_decode)), METH_FASTCALL,
     "paged decode attention over raw addresses (see keepkv/kernels/paged_cpp.py)"},
    {"ema_fold", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(py_ema_fold)), METH_FASTCALL,
     "KeepKV's EMA fold over raw addresses (see keepkv/kernels/ema.py)"},
    {"nearest", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(py_nearest)), METH_FASTCALL,
     "the most cosine-similar allowed slot of each evicted entry (see keepkv/merging.py cosine_nearest)"},
    {"open_to_merges", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(py_open_to_merges)), METH_FASTCALL,
     "the kept entries open to KeepKV's merges (see keepkv/kernels/protect.py)"},
    {"kept_softmax", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(py_kept_softmax)), METH_FASTCALL,
     "the kept queries' masked softmax (see keepkv/kernels/kept.py)"},
    {"isa", py_isa, METH_NOARGS, "the instruction set this build was compiled for"},
    {nullptr, nullptr, 0, nullptr}};

#define KEEPKV_STRING2(x) #x
#define KEEPKV_STRING(x) KEEPKV_STRING2(x)
#define KEEPKV_JOIN2(a, b) a##b
#define KEEPKV_JOIN(a, b) KEEPKV_JOIN2(a, b)

static PyModuleDef kModule = {PyModuleDef_HEAD_INIT, KEEPKV_STRING(TORCH_EXTENSION_NAME),
                              "keepkv's paged decode attention on CPU (keepkv.kernels.paged, backend 'cpp')", -1,
                              kMethods, nullptr, nullptr, nullptr, nullptr};

PyMODINIT_FUNC KEEPKV_JOIN(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&kModule); }

}  // extern "C"

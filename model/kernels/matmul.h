// Matrix products for the decode step, the server's packed steps and prompts: y[M, N] = x[M, K] @ W[N, K]^T
// (+ bias), M from one row up to max_rows() (model/kernels/__init__.py). Blocks of many rows of float32 x take
// outer products (see "Many rows" below): with AVX-512, float32 blocks of 8 to 96 rows where the core has two
// 512-bit FMA pipes (`fma_ports`), else of 32 to 96 rows at least 7/8 full, of 10 to 16 rows, and of 8 to 16
// rows in a product as wide as the LM head; with AVX2, blocks of 16 to 96 rows at least 7/8 full, float32 or
// int8 (in int16). What follows describes the dot-product tiles every other product takes (with AVX-512, one
// or two rows of x run them one output at a time, W's rows in order: see `group`).
//
// W is stored [N, K] row-major (nn.Linear's layout: one output's weights contiguous), so every output is a
// dot product over a contiguous row and each thread streams one contiguous slab of W: the threads split the
// outputs N, not K, and never share a cache line of W. A tile holds MR rows of x against NR rows of W in
// MR * NR vector accumulators, summed across lanes at the end. The library is built for AVX2, AVX-512 or
// AVX-512 with VNNI (model/kernels/__init__.py chooses by the CPU; `__AVX512F__` and `__AVX512VNNI__` tell
// which here). Two weight types:
// - float32: 8 lanes of K per FMA with AVX2, 16 with AVX-512, accumulated in float32;
// - int8 with one float32 scale per output (symmetric, per output channel). Each row of x is first rounded
//   to int16 with a scale of its own (|x| max -> 32767: 15 bits, finer than bfloat16's 8), and 16 weights at
//   a time (32 with AVX-512) are widened to int16 and multiplied in pairs into int32 lanes
//   (`_mm256_madd_epi16`, `_mm512_madd_epi16` or VNNI's `_mm512_dpwssd_epi32`, exact), turned into float32
//   every KC of K, before an int32 could overflow; the scales of x and of the output are applied once, at the
//   end: a third of the instructions per weight of converting each weight to float32. So an int8 product
//   rounds x the same way whatever the rows beside it; with AVX-512 its sums too, as every int8 product
//   there takes these tiles, so a row's outputs are bit for bit the same alone or in a batch. (With AVX2 a
//   block of 16-96 rows at least 7/8 full takes int16 outer products, `OuterI16`, whose sums turn into
//   float32 every kSubK of K: rounded otherwise, about 1e-5 apart.)
//
// Each output ends with an epilogue (`Op`): stored, or added to y (the residual stream's `x += f(x)`), so
// the decode step (decode.cpp) needs no pass of its own for it. `gelu` is GPT-2's activation, vectorised.
// While a group's tiles run they prefetch the next group's rows of W into L2 (`kAhead`), spread evenly over
// the group's row tiles: at a few rows of x the products are bound by how fast memory streams in, and on the
// Zen 1 host the hardware's prefetchers alone left int8 at a third of the bandwidth (the AVX-512 build
// streams one row of x through W's rows in order instead, without prefetching: see `group`).
#pragma once

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace gpt2 {

enum class Op { kStore, kAdd };  // y = s; y += s

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hsum(__m256i v) { return hsum(_mm256_cvtepi32_ps(v)); }  // int32 lanes, each rounded to float32

inline double hsum(__m256d v) {  // lane 0 + lane 1 + lane 2 + lane 3, in that order
  double lanes[4];
  _mm256_storeu_pd(lanes, v);
  return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

inline void finish(Op op, float s, float* y) {
  if (op == Op::kAdd)
    *y += s;
  else
    *y = s;
}

// e^x for 8 floats (Cephes' expf: x = n ln 2 + r, |r| <= ln 2 / 2, a degree-6 polynomial for e^r, 2^n put
// into the exponent bits); relative error about 1e-7, x clamped to where float32 stays finite.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

#ifdef __AVX512F__
inline __m512 exp16(__m512 x) {  // exp8's steps on 16 lanes: each lane the same bits as exp8's
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}
#endif

// GPT-2's "gelu_new", 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), in place over n floats, with
// tanh(u) = 1 - 2 / (e^(2u) + 1).
inline void gelu(float* x, int64_t n) {
  const float c = 0.7978845608028654f;  // sqrt(2 / pi)
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 u = _mm256_mul_ps(_mm256_set1_ps(c), _mm256_fmadd_ps(_mm256_mul_ps(v, v), _mm256_mul_ps(v, _mm256_set1_ps(0.044715f)), v));
    const __m256 e = exp8(_mm256_add_ps(u, u));
    const __m256 t = _mm256_sub_ps(_mm256_set1_ps(1.0f), _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, _mm256_set1_ps(1.0f))));
    _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), v), _mm256_add_ps(_mm256_set1_ps(1.0f), t)));
  }
  for (; i < n; ++i) x[i] = 0.5f * x[i] * (1.0f + std::tanh(c * (x[i] + 0.044715f * x[i] * x[i] * x[i])));
}

#ifdef __AVX512F__
inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

struct F32 {  // float32 weights against float32 rows of x
  using T = float;  // a weight
  using X = float;  // an element of x as the tile reads it
  using Acc = __m512;
  static constexpr int64_t kStep = 16;  // K per step
  static inline Acc zero() { return _mm512_setzero_ps(); }
  static inline __m512 load_x(const float* x) { return _mm512_loadu_ps(x); }
  static inline __m512 load_w(const float* w) { return _mm512_loadu_ps(w); }
  static inline Acc fma(__m512 x, __m512 w, Acc acc) { return _mm512_fmadd_ps(x, w, acc); }
};
#else
struct F32 {  // float32 weights against float32 rows of x
  using T = float;  // a weight
  using X = float;  // an element of x as the tile reads it
  using Acc = __m256;
  static constexpr int64_t kStep = 8;  // K per step
  static inline Acc zero() { return _mm256_setzero_ps(); }
  static inline __m256 load_x(const float* x) { return _mm256_loadu_ps(x); }
  static inline __m256 load_w(const float* w) { return _mm256_loadu_ps(w); }
  static inline Acc fma(__m256 x, __m256 w, Acc acc) { return _mm256_fmadd_ps(x, w, acc); }
};
#endif

#ifdef __AVX512F__
inline float hsum(__m512i v) { return hsum(_mm512_cvtepi32_ps(v)); }  // int32 lanes, each rounded to float32

struct I8 {  // int8 weights against int16 rows of x: 32 products per step, summed in pairs into 16 int32 lanes
  using T = int8_t;
  using X = int16_t;
  using Acc = __m512i;
  static constexpr int64_t kStep = 32;
  static inline Acc zero() { return _mm512_setzero_si512(); }
  static inline __m512i load_x(const int16_t* x) { return _mm512_loadu_si512(x); }
  static inline __m512i load_w(const int8_t* w) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
  }
#ifdef __AVX512VNNI__  // the pairs' products and their sum in one instruction (int8, 32 rows: 53-56 -> 49 ms, Zen 4)
  static inline Acc fma(__m512i x, __m512i w, Acc acc) { return _mm512_dpwssd_epi32(acc, x, w); }
#else
  static inline Acc fma(__m512i x, __m512i w, Acc acc) { return _mm512_add_epi32(acc, _mm512_madd_epi16(x, w)); }
#endif
};

// With AVX-512 an int16 multiply-add does 32 products to a float32 FMA's 16 (measured on a 2-core Zen 4 host,
// a step of gpt2-small: 16 decode rows and a 64-token chunk 95 against 117 ms on dequantized float32 tiles,
// 16 rows 31 against 42 ms).
#else
struct I8 {  // int8 weights against int16 rows of x: 16 products per step, summed in pairs into 8 int32 lanes
  using T = int8_t;
  using X = int16_t;
  using Acc = __m256i;
  static constexpr int64_t kStep = 16;
  static inline Acc zero() { return _mm256_setzero_si256(); }
  static inline __m256i load_x(const int16_t* x) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)); }
  static inline __m256i load_w(const int8_t* w) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  }
  static inline Acc fma(__m256i x, __m256i w, Acc acc) { return _mm256_add_epi32(acc, _mm256_madd_epi16(x, w)); }
};

#endif

// K between turning int32 sums into float32: each int32 lane adds two products of at most 32767 * 127 for
// every kStep of K (8 lanes for 16 values with AVX2, 16 for 32 with AVX-512), so over 4096 of K at most
// 512 of them, 2.13e9 < 2^31 even when every product is the largest of its sign (and still below with a
// weight of -128, which the quantizer never makes).
constexpr int64_t KC = 4096;
static_assert(KC % F32::kStep == 0 && KC % I8::kStep == 0, "a block of K ends on a whole step");
static_assert(KC / I8::kStep * 2 * 32767LL * 128 < (1LL << 31), "no int32 lane can overflow within KC");

constexpr int NR = 4;  // outputs per tile
#ifdef __AVX512F__
// rows of x per tile: 4 x 4 accumulators, 4 x values and a weight vector in 21 of AVX-512's 32 registers.
// Measured on a 2-core Zen 4 host against (rows x outputs) 3 x 4, 5 x 4, 6 x 4, 4 x 5 and 4 x 6: as fast as any
// at 1 and 8 rows, the fastest at 16 and at a server step (16 decode rows and a 64-token prompt chunk, 24%
// faster than the AVX2 build's 3 x 4 there)
constexpr int MR = 4;
#else
constexpr int MR = 3;  // rows of x per tile: 3 x 4 accumulators, 3 x values and a weight vector in 16 registers
#endif

// What a row tile prefetches of the next group's rows of W (`next`, or null for nothing): every `period`-th
// step of K, from step `phase`. Each of a group's row tiles takes its own phase, so the next group streams in
// evenly while the group runs; all of it in the first tile left memory idle for the rest (on an AVX2 host at
// 2 threads, gpt2-small's 48 float32 block matrices took 8% longer at 73-128 rows, 25% at 16).
// The lines go to L2 (`kAhead`, T1), not L1: a prefetch into L1 holds one of the core's few L1 miss buffers
// for the whole trip from memory, which caps a core's stream at about 15 GB/s, while L2 tracks many more
// misses and the tile's loads then find the lines there. Measured on a 2-core Zen 4 host, 2 threads, the 48
// float32 block matrices of gpt2-small (their own 340 MB, in 2 MB pages) and the LM head, T0 -> T1: 2 rows
// 15.1 -> 9.9 ms and 7.4 -> 4.5, 4 rows 14.3 -> 10.4 and 7.1 -> 4.9, 8 rows 18.3 -> 14.8, 16 rows
// 27.3 -> 22.2, 24 rows 35.2 -> 30.5; int8 blocks at 2-8 rows 20-30% faster, at 16-24 rows the same; the AVX2
// build on the same host: float32 blocks 14.3 -> 11.6 ms at one row, 17.2 -> 11.6 at 4.
constexpr auto kAhead = _MM_HINT_T1;  // GCC's enum _mm_hint, clang's int
template <typename T>
struct Ahead {
  const T* next;
  int phase, period;
};

// One tile: TM rows of x against TN outputs (TM <= MR, TN <= NR), over all of K. x's rows are K apart (as
// W::X); xs: each row's scale (int8 only: x = xq * xs); xf: the float32 rows (the int8 path's last K % kStep).
template <typename W, int TM, int TN>
inline void tile(const typename W::X* x, const float* xs, const float* xf, int64_t K, const typename W::T* w,
                 int64_t ldw, const float* scale, const float* bias, float* y, int64_t ldy, Op op,
                 Ahead<typename W::T> ahead) {
  float sum[TM][TN] = {};
  int turn = ahead.phase;  // steps to this tile's next prefetch
  const int64_t Ks = K - K % W::kStep;
  for (int64_t k0 = 0; k0 < Ks; k0 += KC) {
    const int64_t k1 = Ks - k0 < KC ? Ks : k0 + KC;
    typename W::Acc acc[TM][TN];
    for (int i = 0; i < TM; ++i)
      for (int j = 0; j < TN; ++j) acc[i][j] = W::zero();
    for (int64_t k = k0; k < k1; k += W::kStep) {
      const bool fetch = ahead.next && turn == 0;
      turn = turn == 0 ? ahead.period - 1 : turn - 1;
      decltype(W::load_x(x)) xv[TM];
      for (int i = 0; i < TM; ++i) xv[i] = W::load_x(x + i * K + k);
      for (int j = 0; j < TN; ++j) {
        // the same place in the next group's rows, so that memory streams ahead of the products (prefetches
        // never fault, also past the last row; one per step measured faster than one per cache line)
        if (fetch) _mm_prefetch(reinterpret_cast<const char*>(ahead.next + j * ldw + k), kAhead);
        const auto wv = W::load_w(w + j * ldw + k);
        for (int i = 0; i < TM; ++i) acc[i][j] = W::fma(xv[i], wv, acc[i][j]);
      }
    }
    for (int i = 0; i < TM; ++i)
      for (int j = 0; j < TN; ++j) sum[i][j] += hsum(acc[i][j]);
  }
  for (int i = 0; i < TM; ++i) {
    for (int j = 0; j < TN; ++j) {
      float s = sum[i][j];
      if (xs) {  // int8: the int16 sums in x's units, then the float32 tail
        s *= xs[i];
        for (int64_t k = Ks; k < K; ++k) s += xf[i * K + k] * static_cast<float>(w[j * ldw + k]);
      } else {
        for (int64_t k = Ks; k < K; ++k) s += static_cast<float>(x[i * K + k]) * static_cast<float>(w[j * ldw + k]);
      }
      if (scale) s *= scale[j];
      if (bias) s += bias[j];
      finish(op, s, y + i * ldy + j);
    }
  }
}

template <typename W>
struct Rows {  // rows of x as the tiles read them
  const typename W::X* x;  // [M, K]
  const float* xs;         // [M]: int8 only, each row's scale (x = xq * xs)
  const float* xf;         // [M, K]: int8 only, the float32 rows
  Rows from(int64_t m, int64_t K) const {
    return {x + m * K, xs ? xs + m : nullptr, xf ? xf + m * K : nullptr};
  }
};

// One tile of TM rows of x against the nr (<= NR) outputs at w: the tile<W, TM, nr> of that nr.
template <typename W, int TM, int TN = NR>
inline void tile_rows(Rows<W> x, int64_t K, const typename W::T* w, int64_t ldw, const float* scale,
                      const float* bias, float* y, int64_t ldy, int nr, Op op, Ahead<typename W::T> ahead) {
  if constexpr (TN > 1) {
    if (nr < TN) return tile_rows<W, TM, TN - 1>(x, K, w, ldw, scale, bias, y, ldy, nr, op, ahead);
  }
  tile<W, TM, TN>(x.x, x.xs, x.xf, K, w, ldw, scale, bias, y, ldy, op, ahead);
}

// The last `rest` (< MR) rows of x: one tile of that many rows.
template <typename W, int TM = MR - 1>
inline void last_rows(int64_t rest, Rows<W> x, int64_t K, const typename W::T* w, int64_t ldw, const float* scale,
                      const float* bias, float* y, int64_t ldy, int nr, Op op, Ahead<typename W::T> ahead) {
  if constexpr (TM >= 1) {
    if (rest == TM) return tile_rows<W, TM>(x, K, w, ldw, scale, bias, y, ldy, nr, op, ahead);
    last_rows<W, TM - 1>(rest, x, K, w, ldw, scale, bias, y, ldy, nr, op, ahead);
  }
}

// nr (<= NR) outputs, from w, for every row of x: W's nr rows stay in cache while the row tiles go by, and
// between them they prefetch `next` (null: nothing).
template <typename W>
inline void rows_of(Rows<W> x, int64_t M, int64_t K, const typename W::T* w, int64_t ldw, const float* scale,
                    const float* bias, float* y, int64_t N, int nr, Op op, const typename W::T* next) {
  const int period = static_cast<int>((M + MR - 1) / MR);  // row tiles
  int64_t m = 0;
  int phase = 0;
  for (; m + MR <= M; m += MR, ++phase)
    tile_rows<W, MR>(x.from(m, K), K, w, ldw, scale, bias, y + m * N, N, nr, op, {next, phase, period});
  if (m < M) last_rows<W>(M - m, x.from(m, K), K, w, ldw, scale, bias, y + m * N, N, nr, op, {next, phase, period});
}

// Outputs [g * NR, g * NR + NR) (fewer in the last group) for every row of x.
template <typename W>
inline void group(Rows<W> x, int64_t M, int64_t K, const typename W::T* w, int64_t ldw, const float* scale,
                  const float* bias, float* y, int64_t N, int64_t g, Op op) {
  const int64_t n0 = g * NR;
  const int nr = static_cast<int>(N - n0 < NR ? N - n0 : NR);
  w += n0 * ldw, y += n0;
  scale = scale ? scale + n0 : nullptr, bias = bias ? bias + n0 : nullptr;
  const typename W::T* next = w + NR * ldw;  // the next group's rows
#ifdef __AVX512F__
  if (M <= 2) {  // one row of x (a batch-1 step): W's rows one after another, a single sequential stream, which
    // the hardware prefetchers follow better than a tile's NR rows at once with ours ahead of them. Measured
    // on a 2-core Zen 4 host: 150 MB of float32 W at 37 against 22-27 GB/s (2 threads, as fast as a plain
    // sum); a batch-1 step of gpt2-small 18.1 -> 13.6 ms in float32, 7.5 -> 3.8 ms in int8; prefetching in
    // the stream made it slower. The AVX2 build keeps the prefetching tiles, measured on a Zen 1 host
    // (where the hardware prefetchers alone left int8 at a third of the bandwidth).
    // Two rows (a batch-2 step) take the same stream, each row of W against both rows of x. Measured on a
    // 2-core Zen 5 host, 2 threads, A/B in one process: float32, the 48 block matrices 10.9-11.5 -> 8.5-8.7
    // ms and the LM head 4.8-4.9 -> 3.4-3.5 while memory read at 35-41 GB/s, 7.0-7.2 -> 6.3-6.5 and 3.0-3.1
    // -> 2.4-2.5 at 55-78, a fused decode step of 2 rows at 200 positions 14.0-14.5 -> 13.0-13.3 ms; int8
    // (the same sums, bit for bit), the block matrices 3.13-3.38 -> 2.85-3.28 ms and the LM head 1.17-1.26 ->
    // 1.04-1.13. At 3 and 4 rows the stream was even or slower in float32 (its few accumulators wait on the
    // FMA's latency): those keep the tiles.
    for (int j = 0; j < nr; ++j) {
      const float* s = scale ? scale + j : nullptr;
      const float* b = bias ? bias + j : nullptr;
      if (M == 1)
        tile<W, 1, 1>(x.x, x.xs, x.xf, K, w + j * ldw, ldw, s, b, y + j, N, op, {nullptr, 0, 1});
      else
        tile<W, 2, 1>(x.x, x.xs, x.xf, K, w + j * ldw, ldw, s, b, y + j, N, op, {nullptr, 0, 1});
    }
    return;
  }
#endif
  rows_of<W>(x, M, K, w, ldw, scale, bias, y, N, nr, op, next);
}

// Rows of x per pass over W (a multiple of MR): a decode step's products, and a server step's at its default
// batch size and prompt chunk (up to 96 rows), read W once. Fewer rows per pass, to keep x's block in L2,
// measured slower at 2 threads on an AVX2 host (73 rows, K 3072: 50 vs 57 GFLOP/s; the 48 block matrices
// 4-14% faster in one pass): reading W again costs more than x's rows coming from L3.
constexpr int64_t kRowBlock = 96;

// ---- Many rows of x: outer products over x's rows ----
//
// From 32 rows on, the dot-product tiles above spend a good part of their time summing lanes and reloading
// x's rows. Here a block of x is transposed once into xt [K, Mp] (its m rows padded with zeros to Mp, a
// multiple of the vector's L lanes: 16 with AVX-512, 8 with AVX2), so that one vector holds L rows of x at
// one k, and a tile of MV vectors (L MV rows) against NC outputs accumulates
//     acc[i][j] += xt[k, L i : L i + L] * W[n + j, k]        (the weight broadcast to every lane)
// in MV * NC registers: no sums across lanes, each weight loaded once for the tile's rows, W's rows read in
// order as stored. The threads take pieces of the outputs (contiguous slabs of W, `outer_product`), each in
// chunks of about kChunk outputs, whose sums stay in L1 ([chunk, Mp], outputs by rows), over blocks of
// kBlockK of K (xt's block stays in L2). With AVX-512's 32 registers one tile holds every row of a block (up
// to 6 vectors, 96 rows); AVX2's 16 hold at most 3 vectors against 4 outputs, so there a chunk's tile of
// outputs runs over the block's rows MV vectors at a time (`outer_column`), its rows of W then in L1. A
// tile's registers start from zero every kSubK of K and are then added to the chunk's sums, so that no
// float32 sum runs over more than kSubK products one after another (one chain over all of K = 768 had 8x the
// rounding error of the lane-split tiles; with 64, the same 1.4e-6). At the end each chunk is transposed
// back, L x L at a time, and stored into y's rows with the bias (or added, `op`). int8 weights (AVX2 only,
// `kOuterInt8`) go through in int16 (`OuterI16`): x's rows, rounded as for the dot-product tiles, are
// transposed in pairs of k, and each chunk's block of W is widened to int16 into a buffer the tiles then read
// from cache; the scales are applied as the sums go back to rows.
// Measured on a 2-core Zen 4 host against the tiles above, gpt2-small's four block products, median of
// interleaved runs: 1.11x at 32 rows, 1.08x at 64, 1.09x at 80 (a server step), 1.22x at 96, 1.17-1.21x at
// 128-1024 rows (183 GFLOP/s at 2 threads, where torch's GEMM, MKL, made 133-146); padded rows cost as much
// as real ones, so a block goes this way only when at least 7/8 of its padded rows are real (`outer_pays`):
// at 33 rows (48 padded) it was 0.83x, at 65 0.89x. A product as wide as the LM head (kWideN outputs or more:
// 154 MB of W streaming from memory) goes this way from 8 rows, in one vector: 50257 outputs, K 768, 2
// threads, 1.09x at 8 rows, 1.38x at 12, 1.43-1.48x at 16 (0.99x at 4, 0.97-1.01x at 20-24, where the
// padding rule keeps it off), while a block's products at 16 rows were 0.93-0.97x. The AVX2 build (the same
// host), 2 threads, against its dot-product tiles, the 48 block matrices and the LM head: 16 rows 1.2x and
// 1.4x (23.1-27.3 -> 18.5-22.0 ms, 10.9-12.4 -> 8.0-8.8), 24 rows 1.15-1.25x and 1.25-1.5x, 32 rows 1.2x
// and 1.5x (46.8 -> 38.2, 25.4 -> 17.4), 80 rows 1.25x and 1.6x (130.6-133.8 -> 90.1-105.3, 61.9-65.6 ->
// 38.5-41.9); so there from 16 rows (at 8, 0.7x on the block matrices).

#ifdef __AVX512F__
struct Lanes {  // a vector of 16 float32 lanes
  using V = __m512;
  static constexpr int64_t kN = 16;
  static inline V zero() { return _mm512_setzero_ps(); }
  static inline V load(const float* p) { return _mm512_load_ps(p); }  // 64-byte aligned
  static inline void store(float* p, V v) { _mm512_store_ps(p, v); }
  static inline V set1(float s) { return _mm512_set1_ps(s); }
  static inline V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static inline V add(V a, V b) { return _mm512_add_ps(a, b); }
  static inline V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static inline V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static inline V max(V a, V b) { return _mm512_max_ps(a, b); }
  static inline int above(V a, float s) { return _mm512_cmp_ps_mask(a, _mm512_set1_ps(s), _CMP_NLE_UQ); }  // or NaN
  static inline V exp(V x) { return exp16(x); }
  static inline __mmask16 first(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }
  static inline V load_first(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(first(n), p); }  // rest 0
  static inline void store_first(float* p, int64_t n, V v) { _mm512_mask_storeu_ps(p, first(n), v); }
  // r[0..15] transposed in place (r[i][j] <- r[j][i]): pairs of lanes, then quarters, then halves of the 4 x 4
  // blocks of 128-bit lanes.
  static inline void transpose(V r[16]) {
    V t[16];
    for (int i = 0; i < 16; i += 2) {
      t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
      t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
      r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
      r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
      r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
      r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; ++i) {
      t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
      t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
      t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
      t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
    }
    for (int i = 0; i < 4; ++i) {
      r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
      r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
      r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
      r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xDD);
    }
  }
};
#else
struct Lanes {  // a vector of 8 float32 lanes
  using V = __m256;
  static constexpr int64_t kN = 8;
  static inline V zero() { return _mm256_setzero_ps(); }
  static inline V load(const float* p) { return _mm256_load_ps(p); }  // 32-byte aligned
  static inline void store(float* p, V v) { _mm256_store_ps(p, v); }
  static inline V set1(float s) { return _mm256_set1_ps(s); }
  static inline V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static inline V add(V a, V b) { return _mm256_add_ps(a, b); }
  static inline V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static inline V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static inline V max(V a, V b) { return _mm256_max_ps(a, b); }
  static inline int above(V a, float s) {  // the lanes where a > s or a is NaN, as bits
    return _mm256_movemask_ps(_mm256_cmp_ps(a, _mm256_set1_ps(s), _CMP_NLE_UQ));
  }
  static inline V exp(V x) { return exp8(x); }
  static inline __m256i first(int64_t n) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n < 8 ? n : 8)), lane);
  }
  static inline V load_first(const float* p, int64_t n) {  // the rest 0
    return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, first(n));
  }
  static inline void store_first(float* p, int64_t n, V v) {
    if (n >= 8)
      _mm256_storeu_ps(p, v);
    else
      _mm256_maskstore_ps(p, first(n), v);
  }
  // r[0..7] transposed in place (r[i][j] <- r[j][i]): pairs of lanes, then quarters, then the 128-bit halves.
  static inline void transpose(V r[8]) {
    V t[8];
    for (int i = 0; i < 8; i += 2) {
      t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
      t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
      r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
      r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
      r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
      r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; ++i) {
      t[i] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x20);
      t[i + 4] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x31);
    }
    for (int i = 0; i < 8; ++i) r[i] = t[i];
  }
};
#endif
constexpr int64_t kLanes = Lanes::kN;  // L below

constexpr int64_t kChunk = 64;    // outputs whose sums a thread keeps in L1 at once (rounded to the tile's NC)
constexpr int64_t kBlockK = 768;  // K per block of xt (96 x 768 floats at most, 288 KiB: in L2)
constexpr int64_t kSubK = 64;     // K per chain of float32 sums in a tile's registers
constexpr int64_t kWideN = 16384; // outputs from which a product is as wide as an LM head
constexpr int64_t kMaxVectors = kRowBlock / kLanes;  // vectors of rows in a block (kOuter)

static_assert(kRowBlock % kLanes == 0 && kRowBlock <= 96, "a block of rows is at most 96 rows, whole vectors");

// Whether int8 products take outer products too (in int16, `OuterI16`): with AVX2, where an int16 dot-product
// tile spends its time as a float32 one does, they pay as for float32 (the AVX2 build on a Zen 4 host, the 48
// block matrices and the LM head, against float32 outer products over weights dequantized a chunk at a time:
// 24 rows 29.2-31.6 against 34.6-36.8 ms and 12.8-14.3 against 14.8-16.6, 32 rows 31.4-42.8 against
// 43.2-51.6 and 15.0-15.3 against 18.1-19.7, even at 48-96 rows; against int16 dot-product tiles 1.2-1.35x
// at 24-32 rows). AVX-512 with VNNI's dot-product tiles reach about 1.5x a float32 outer product's rate, and
// an int16 outer product there ran 0.64-0.7x them on the block matrices (32-96 rows; on a Zen 5 host, with
// `_mm512_dpwssd_epi32`, 0.58-0.68x at 16-1024 rows), so there int8 keeps them (the AVX-512 build without
// VNNI too, not measured apart).
#ifdef __AVX512F__
constexpr bool kOuterInt8 = false;
#else
constexpr bool kOuterInt8 = true;
#endif

// How many 512-bit FMAs a core starts each cycle: 2 on Zen 5 and most AVX-512 Xeons, 1 on Zen 4, which runs
// each as two 256-bit halves (and on Xeons with one 512-bit FMA unit). No CPUID bit says which, so it is
// measured once: the same number of independent FMAs on 16 lanes and on 8, best of 5 tries each; with two
// 512-bit pipes both take the same time, with one the 16-lane run takes twice as long (Zen 5: 2.6 us each,
// about 30 us in all). `set_fma_ports` overrides it (1 or 2; tests run both rules on
// any host). The AVX2 build never asks.
#ifdef __AVX512F__
template <typename V, V (*Fma)(V, V, V), V (*Set)(float)>
inline double fma_run_seconds() {
  V a0 = Set(1.0f), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0, a9 = a0;
  const V b = Set(0.999f), c = Set(1e-6f);
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 2000; ++i) {
    __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7), "+v"(a8),
                     "+v"(a9));  // ten chains, kept in registers, none folded away
    a0 = Fma(a0, b, c), a1 = Fma(a1, b, c), a2 = Fma(a2, b, c), a3 = Fma(a3, b, c), a4 = Fma(a4, b, c);
    a5 = Fma(a5, b, c), a6 = Fma(a6, b, c), a7 = Fma(a7, b, c), a8 = Fma(a8, b, c), a9 = Fma(a9, b, c);
  }
  __asm__ volatile("" : : "v"(a0), "v"(a1), "v"(a2), "v"(a3), "v"(a4), "v"(a5), "v"(a6), "v"(a7), "v"(a8), "v"(a9));
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}
inline __m512 fma16(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
inline __m512 set16(float s) { return _mm512_set1_ps(s); }
inline __m256 fma8(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
inline __m256 set8(float s) { return _mm256_set1_ps(s); }

inline int measure_fma_ports() {
  double wide = 1e9, narrow = 1e9;
  fma_run_seconds<__m512, fma16, set16>();  // a first run to wake the 512-bit units (slow for a while on Intel)
  for (int i = 0; i < 5; ++i) {
    wide = std::min(wide, fma_run_seconds<__m512, fma16, set16>());
    narrow = std::min(narrow, fma_run_seconds<__m256, fma8, set8>());
  }
  return wide < 1.5 * narrow ? 2 : 1;
}
#else
inline int measure_fma_ports() { return 1; }
#endif

inline std::atomic<int>& fma_ports_override() {
  static std::atomic<int> ports{0};  // 0: as measured
  return ports;
}
inline int fma_ports() {
  static const int measured = measure_fma_ports();
  const int forced = fma_ports_override().load(std::memory_order_relaxed);
  return forced ? forced : measured;
}
inline void set_fma_ports(int ports) { fma_ports_override().store(ports == 1 || ports == 2 ? ports : 0); }

// Whether a block of m rows against K x N weights takes outer products (none without K or N: the tiles store
// the bias there, and pieces of no outputs are not defined). With two 512-bit FMA pipes, every block of 8 rows
// or more, padded or not: the products of a few rows are then bound by how fast W streams in, which one
// vector's outer product against 8 outputs at a time does better than the dot-product tiles, and the padding
// of a block costs less than it saves (measured on a 2-core Zen 5 host, 2 threads, gpt2-small's 48 block
// matrices, dot-product tiles -> outer products: 8 rows 10.0-10.5 -> 9.5-9.7 ms, 12 rows 11.0-11.7 -> 9.6-9.8,
// 16 rows 13.6-14.6 -> 9.6-9.8, 17 rows 16.6 -> 13.9, 24 rows 19.4-22.2 -> 15.2, 31 rows 27.1 -> 15.1, 33 rows
// 26.4 -> 21.3, 40 rows 31.1 -> 21.5; the LM head 16 rows 5.6 -> 4.9, 17 rows 8.7 -> 6.6, 24 rows 10.1 -> 6.5).
// With one, blocks of 32 to 96 rows at least 7/8 full, every block of 10 to 16 rows (one vector, padded), and
// 8 or 9 rows of a product as wide as the LM head. Measured on a 2-core Zen 4 host, 2 threads, the 48 block
// matrices, tiles -> outer products, medians of interleaved runs in one process: 10 rows 17.0-18.4 ->
// 15.9-16.6 ms, 12 rows 17.5-20.9 -> 16.7-18.2, 14 rows 20.9-27.1 -> 16.7-22.2, 16 rows 21.0-27.2 ->
// 16.5-22.3 (1.2-1.3x); 8 rows 15.6-16.0 -> 16.9-18.4 and 9 rows 16.7 -> 16.9 (so not there), 18-20 rows
// 0.85-0.9x (their padding); a fused pass of 16 decode rows at about 200 positions 42.0 -> 34.6 ms, 15 rows
// 35.6 -> 31.2, 12 rows 31.9 -> 30.4. (An earlier Zen 4 host had found 16 rows of a block 0.93-0.97x, when
// the outer tiles did not yet prefetch W's next rows.)
inline bool outer_pays(int64_t m, int64_t K, int64_t N) {
  if (K == 0 || N == 0) return false;
  const int64_t padded = (m + kLanes - 1) / kLanes * kLanes;
#ifdef __AVX512F__
  if (fma_ports() == 2) return m >= 8 && m <= kRowBlock;
  const int64_t one_vector_from = N >= kWideN ? 8 : 10;  // rows from which one padded vector pays
  return (m >= 32 && m <= kRowBlock && 8 * m >= 7 * padded) || (m >= one_vector_from && m <= 16);
#else
  return m >= 16 && m <= kRowBlock && 8 * m >= 7 * padded;
#endif
}

// xt[K, Mp] = x[m, K]^T, rows m..Mp-1 zero; xt aligned to a vector, Mp a multiple of L.
inline void transpose_rows(const float* x, int64_t m, int64_t K, float* xt, int64_t Mp) {
  for (int64_t k0 = 0; k0 < K; k0 += kLanes) {
    const int64_t kn = K - k0 < kLanes ? K - k0 : kLanes;
    for (int64_t i0 = 0; i0 < Mp; i0 += kLanes) {
      Lanes::V r[kLanes];
      for (int i = 0; i < kLanes; ++i) r[i] = i0 + i < m ? Lanes::load_first(x + (i0 + i) * K + k0, kn) : Lanes::zero();
      Lanes::transpose(r);
      for (int64_t k = 0; k < kn; ++k) Lanes::store(xt + (k0 + k) * Mp + i0, r[k]);
    }
  }
}

// What an outer-product tile multiplies. float32: one element of xt is one row's x at one k, the weight is
// broadcast to every lane, and an FMA adds one product per lane. int8 weights (widened to int16 a chunk at a
// time) against x rounded to int16 (`prepare`): one element of xt is one row's x at k and k + 1 (two int16 in
// 32 bits), the weights' pair at k and k + 1 is broadcast, and a multiply-add adds two products per lane into
// int32 (`_mm256_madd_epi16`), turned into float32 every kSubK of K. (AVX2 only: see kOuterInt8.)
struct OuterF32 {
  using X = float;  // an element of xt
  using T = float;  // a weight as the tiles read it
  using Acc = Lanes::V;
  static constexpr int64_t kStep = 1;  // K per element of xt
  static constexpr bool kFetch = true;  // whether the tiles prefetch the next tile's rows (W from memory)
  static inline Acc zero() { return Lanes::zero(); }
  static inline Acc load_x(const float* p) { return Lanes::load(p); }
  static inline Acc load_w(const float* p) { return Lanes::set1(*p); }
  static inline Acc fma(Acc x, Acc w, Acc acc) { return Lanes::fma(x, w, acc); }
  static inline Lanes::V to_float(Acc a) { return a; }
};

#ifdef __AVX512F__
template <typename W>
using OuterKind = OuterF32;  // int8 keeps its dot-product tiles (kOuterInt8)
#else
struct OuterI16 {
  using X = int32_t;
  using T = int16_t;
  using Acc = __m256i;  // 8 int32 lanes
  static constexpr int64_t kStep = 2;
  static constexpr bool kFetch = false;  // W is a widened copy, in cache
  static inline Acc zero() { return I8::zero(); }
  static inline Acc load_x(const int32_t* p) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(p)); }
  static inline Acc load_w(const int16_t* p) {
    int32_t pair;
    std::memcpy(&pair, p, sizeof pair);
    return _mm256_set1_epi32(pair);
  }
  static inline Acc fma(Acc x, Acc w, Acc acc) { return I8::fma(x, w, acc); }
  static inline Lanes::V to_float(Acc a) { return _mm256_cvtepi32_ps(a); }
};
static_assert(kSubK % 2 == 0 && kSubK / 2 * 2 * 32767LL * 128 < (1LL << 31), "no int32 lane overflows in kSubK");
static_assert(kBlockK % OuterI16::kStep == 0, "a block of K is whole pairs");

template <typename W>
using OuterKind = std::conditional_t<std::is_same<W, F32>::value, OuterF32, OuterI16>;
#endif

// sums[j, :] (+)= xt[0:kn, :]^T . w[j, 0:kn] for the NC outputs j whose weights are at w (rows ldw apart), for
// the MV vectors of rows at xt (rows Mp apart, as the sums' rows; one row of xt per kStep of K): stored where
// `first`, else added. Each new cache line of its rows (every 16 of k), a float32 tile prefetches the same
// line of the next tile's rows (the next NC outputs, past the last one harmlessly) into L2, as the
// dot-product tiles do (`kAhead`): the LM head at 8-16 rows about 15% faster (8.7 -> 7.4 ms at 8, 8.9 -> 7.6
// at 16), a server step's block products (80 rows) 2-4%. (Where those rows are already in cache, the tiles
// after a column's first, it costs less than a test to skip it: with one, the LM head at 12-16 rows 4-8%
// slower.)
template <typename Kind, int MV, int NC>
inline void outer_tile(const typename Kind::X* xt, int64_t Mp, int64_t kn, const typename Kind::T* w, int64_t ldw,
                       float* sums, bool first) {
  for (int64_t k0 = 0; k0 < kn; k0 += kSubK) {
    const int64_t k1 = kn - k0 < kSubK ? kn : k0 + kSubK;
    typename Kind::Acc acc[MV][NC];
    for (int i = 0; i < MV; ++i)
      for (int j = 0; j < NC; ++j) acc[i][j] = Kind::zero();
    for (int64_t k = k0; k < k1; k += Kind::kStep) {
      if constexpr (Kind::kFetch) {
        if (k % 16 == 0)
          for (int j = 0; j < NC; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + (NC + j) * ldw + k), kAhead);
      }
      typename Kind::Acc xv[MV];
      for (int i = 0; i < MV; ++i) xv[i] = Kind::load_x(xt + k / Kind::kStep * Mp + kLanes * i);
      for (int j = 0; j < NC; ++j) {
        const typename Kind::Acc wv = Kind::load_w(w + j * ldw + k);
        for (int i = 0; i < MV; ++i) acc[i][j] = Kind::fma(xv[i], wv, acc[i][j]);
      }
    }
    const bool store = first && k0 == 0;
    for (int j = 0; j < NC; ++j)
      for (int i = 0; i < MV; ++i) {
        float* s = sums + j * Mp + kLanes * i;
        const Lanes::V v = Kind::to_float(acc[i][j]);
        Lanes::store(s, store ? v : Lanes::add(Lanes::load(s), v));
      }
  }
}

// n (1 to NC) outputs: the outer_tile<Kind, MV, n>.
template <typename Kind, int MV, int NC>
inline void outer_n(int64_t n, const typename Kind::X* xt, int64_t Mp, int64_t kn, const typename Kind::T* w,
                    int64_t ldw, float* sums, bool first) {
  if constexpr (NC > 1) {
    if (n < NC) return outer_n<Kind, MV, NC - 1>(n, xt, Mp, kn, w, ldw, sums, first);
  }
  outer_tile<Kind, MV, NC>(xt, Mp, kn, w, ldw, sums, first);
}

// n (<= NC) outputs for all NV vectors of rows: MV vectors at a time, the last NV % MV together.
template <typename Kind, int NV, int MV, int NC>
inline void outer_column(int64_t n, const typename Kind::X* xt, int64_t kn, const typename Kind::T* w, int64_t ldw,
                         float* sums, bool first) {
  constexpr int64_t Mp = kLanes * NV;
  int64_t v = 0;
  for (; v + MV <= NV; v += MV) outer_n<Kind, MV, NC>(n, xt + kLanes * v, Mp, kn, w, ldw, sums + kLanes * v, first);
  if constexpr (NV % MV > 0)
    outer_n<Kind, NV % MV, NC>(n, xt + kLanes * v, Mp, kn, w, ldw, sums + kLanes * v, first);
}

// A thread's buffer for a chunk of W widened to int16 (one for every tile shape).
inline std::vector<int16_t>& widened() {
  thread_local std::vector<int16_t> buffer;
  return buffer;
}

// Outputs [n0, n1) of y for the m rows of x in xt (NV vectors, one row per kStep of K; xs: int8 only, each
// row's scale), one piece (a function of its own, see `groups`), in tiles of MV vectors against NC outputs.
// int8: each chunk's block of W is widened to int16 first (K padded to even with zeros).
template <typename W, int NV, int MV, int NC>
__attribute__((noinline)) void outer_outputs(const void* xt_, const float* xs, int64_t m, int64_t K,
                                             const typename W::T* w, int64_t ldw, const float* scale,
                                             const float* bias, float* y, int64_t N, int64_t n0, int64_t n1, Op op) {
  using Kind = OuterKind<W>;
  const auto* xt = static_cast<const typename Kind::X*>(xt_);
  constexpr int64_t Mp = kLanes * NV, chunk = (kChunk + NC - 1) / NC * NC;
  const int64_t Kp = (K + Kind::kStep - 1) / Kind::kStep * Kind::kStep;
  alignas(64) float sums[chunk * Mp];  // [outputs, Mp]
  for (int64_t c = n0; c < n1; c += chunk) {
    const int64_t nc = n1 - c < chunk ? n1 - c : chunk;
    for (int64_t k0 = 0; k0 < Kp; k0 += kBlockK) {
      const int64_t kn = Kp - k0 < kBlockK ? Kp - k0 : kBlockK;
      const typename Kind::T* wk;  // the chunk's weights for this block of K, rows ld apart
      int64_t ld;
      if constexpr (std::is_same<W, I8>::value) {
        std::vector<int16_t>& buffer = widened();  // [chunk, kn]
        buffer.resize(static_cast<size_t>(chunk * kBlockK));
        const int64_t real = std::min(kn, K - k0);  // the rest of kn is K's padding
        for (int64_t j = 0; j < nc; ++j) {
          const int8_t* q = w + (c + j) * ldw + k0;
          const int8_t* ahead = q + chunk * ldw;  // the same place in the next chunk (past W's end harmlessly)
          int16_t* d = buffer.data() + j * kn;
          int64_t k = 0;
          for (; k + 16 <= real; k += 16) {
            if (k % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(ahead + k), kAhead);
            const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + k), _mm256_cvtepi8_epi16(v));
          }
          for (; k < kn; ++k) d[k] = k < real ? q[k] : 0;
        }
        wk = buffer.data(), ld = kn;
      } else {
        wk = w + c * ldw + k0, ld = ldw;
      }
      for (int64_t j = 0; j < nc; j += NC)
        outer_column<Kind, NV, MV, NC>(std::min<int64_t>(NC, nc - j), xt + k0 / Kind::kStep * Mp, kn, wk + j * ld,
                                       ld, sums + j * Mp, k0 == 0);
    }
    for (int64_t j0 = 0; j0 < nc; j0 += kLanes) {  // back to rows: L outputs x L rows at a time
      const int64_t real = nc - j0;  // outputs here (L or more: all lanes)
      const Lanes::V b = bias ? Lanes::load_first(bias + c + j0, real) : Lanes::zero();
      const Lanes::V s = scale ? Lanes::load_first(scale + c + j0, real) : Lanes::set1(1.0f);
      for (int64_t i0 = 0; i0 < m; i0 += kLanes) {
        Lanes::V r[kLanes];
        for (int j = 0; j < kLanes; ++j)  // past the chunk's last output: zeros (its sums were never written)
          r[j] = j0 + j < nc ? Lanes::load(sums + (j0 + j) * Mp + i0) : Lanes::zero();
        Lanes::transpose(r);
        for (int64_t i = 0; i < kLanes && i0 + i < m; ++i) {
          float* yr = y + (i0 + i) * N + c + j0;
          Lanes::V v = r[i];
          if (xs) v = Lanes::mul(Lanes::mul(v, Lanes::set1(xs[i0 + i])), s);  // int8: in x's and W's units
          v = Lanes::add(v, b);
          if (op == Op::kAdd) v = Lanes::add(v, Lanes::load_first(yr, real));
          Lanes::store_first(yr, real, v);
        }
      }
    }
  }
}

template <typename W>
using OuterOutputs = void (*)(const void*, const float*, int64_t, int64_t, const typename W::T*, int64_t,
                              const float*, const float*, float*, int64_t, int64_t, int64_t, Op);
template <typename W>
struct Outer {
  OuterOutputs<W> outputs;
  int64_t nc;  // outputs per tile
};
// The tiles for NV vectors of rows. AVX-512: all NV in one tile, against as many outputs as leave registers
// for NV x values and the broadcast weight (NV NC + NV + 1 <= 32); at one vector 8: on a Zen 4 host 12 and 16
// ran alike on the LM head (24 half as fast), and on a Zen 5 host, where one vector's products wait on W
// streaming in, 8 at a time beat 16 (the 48 block matrices at 16 rows 9.6-10.4 against 11.6-12.2 ms, the LM
// head 4.4 against 4.9; 6 as fast as 8, 12 between). AVX2 (16 registers): 2 vectors (16 rows) against 6 outputs at a time,
// or, where NV is odd, 3 against 4 (the last one or two vectors together): measured on a Zen 4 host (the
// AVX2 build) 2 x 6 as fast as 3 x 4 or faster from 32 to 96 rows, 3 x 4 faster at 24 rows than 2 x 6 and a
// lone vector after it (the 48 block matrices 27.7-33.8 against 35.0-38.6 ms).
#ifdef __AVX512F__
constexpr int outer_mv(int nv) { return nv; }
constexpr int outer_nc(int mv) { return mv == 1 ? 8 : mv == 2 ? 10 : mv == 3 ? 8 : mv == 4 ? 6 : mv == 5 ? 5 : 4; }
#else
constexpr int outer_mv(int nv) { return nv % 2 == 0 || nv == 1 ? std::min(nv, 2) : 3; }
constexpr int outer_nc(int mv) { return mv == 1 ? 12 : mv == 2 ? 6 : 4; }
#endif
template <typename W, int NV>
constexpr Outer<W> outer() {
  if constexpr (std::is_same<W, I8>::value) {  // AVX2: a multiply-add needs a register for its products, so
    // 2 x 4 (with 2 x 5, 2 x 6 or 3 x 3 the registers spilled: 32 rows 42.1 against 48.6 ms)
    constexpr int mv = std::min(NV, 2), nc = NV == 1 ? 8 : 4;
    return {outer_outputs<W, NV, mv, nc>, nc};
  } else {
    return {outer_outputs<W, NV, outer_mv(NV), outer_nc(outer_mv(NV))>, outer_nc(outer_mv(NV))};
  }
}
template <typename W, int... NV>
constexpr std::array<Outer<W>, sizeof...(NV) + 1> outer_table(std::integer_sequence<int, NV...>) {
  return {Outer<W>{nullptr, 0}, outer<W, NV + 1>()...};
}
template <typename W>
constexpr auto kOuter = outer_table<W>(std::make_integer_sequence<int, kMaxVectors>());  // [vectors of rows]

// y[m, N] (op) x[m, K] @ w[N, K]^T (* scale) + bias for one block of rows (m <= kRowBlock, as the tiles read
// them: float32, or int16 with a scale per row for int8), on `threads` threads.
template <typename W>
inline void outer_product(Rows<W> rows, int64_t m, int64_t K, const typename W::T* w, int64_t ldw, const float* scale,
                          const float* bias, float* y, int64_t N, int threads, Op op) {
  using Kind = OuterKind<W>;
  const int64_t nv = (m + kLanes - 1) / kLanes, Mp = kLanes * nv, Kx = (K + Kind::kStep - 1) / Kind::kStep;
  thread_local std::vector<float> store;
  store.resize(static_cast<size_t>(Kx * Mp + 16));
  float* xt = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(store.data()) + 63) & ~uintptr_t{63});
  if constexpr (std::is_same<W, F32>::value) {
    transpose_rows(rows.x, m, K, xt, Mp);
  } else {  // int16 pairs, moved as 32-bit lanes (moves and shuffles only: every bit kept); K odd: a zero after
    const int16_t* xq = rows.x;
    thread_local std::vector<int16_t> even;
    if (K % 2) {
      even.assign(static_cast<size_t>(m * (K + 1)), 0);
      for (int64_t i = 0; i < m; ++i) std::copy(xq + i * K, xq + i * K + K, even.data() + i * (K + 1));
      xq = even.data();
    }
    transpose_rows(reinterpret_cast<const float*>(xq), m, Kx, xt, Mp);
  }
  const Outer<W> tiles = kOuter<W>[nv];
  // The outputs in about 8 pieces a thread (whole tiles; each a contiguous slab of W), each taken by whichever
  // thread is free: where another process holds a core for a while (the server's HTTP side, a neighbour on
  // the host), the other thread takes more pieces instead of waiting for it at the end. A server step beside
  // a process spinning a fifth of a core: median 131.7-145.6 -> 127.7-140.9 ms; alone, the same.
  const int64_t piece = ((N + 8 * threads - 1) / (8 * threads) + tiles.nc - 1) / tiles.nc * tiles.nc;
  const int64_t pieces = (N + piece - 1) / piece;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
  for (int64_t p = 0; p < pieces; ++p)
    tiles.outputs(xt, rows.xs, m, K, w, ldw, scale, bias, y, N, p * piece, std::min(N, p * piece + piece), op);
}

// x's rows as W's tiles read them: as they are for float32; rounded to int16 with a scale per row for int8
// (into `xq` and `xs`, which must outlive the product).
inline Rows<F32> prepare(const float* x, int64_t, int64_t, std::vector<int16_t>&, std::vector<float>&, F32) {
  return {x, nullptr, nullptr};
}

inline Rows<I8> prepare(const float* x, int64_t M, int64_t K, std::vector<int16_t>& xq, std::vector<float>& xs, I8) {
  xq.resize(static_cast<size_t>(M * K));
  xs.resize(static_cast<size_t>(M));
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));  // clears the sign bit
  for (int64_t m = 0; m < M; ++m) {  // 8 lanes at a time (scalar, 32 rows took 5 ms of a 63 ms step)
    const float* r = x + m * K;
    int16_t* q = xq.data() + m * K;
    __m256 top = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      const __m256 v = _mm256_loadu_ps(r + k);
      top = _mm256_max_ps(top, _mm256_and_ps(v, magnitude));
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float lanes[8], amax = 0;
    _mm256_storeu_ps(lanes, top);
    for (float v : lanes) amax = v > amax ? v : amax;
    bool any_nan = _mm256_movemask_ps(nan) != 0;
    for (; k < K; ++k) {
      amax = std::fabs(r[k]) > amax ? std::fabs(r[k]) : amax;
      any_nan = any_nan || std::isnan(r[k]);
    }
    // A NaN or an infinity in the row makes its scale NaN, so its outputs are NaN, non-finite as float32's
    // would be (rounded to int16, a NaN would become a plain number). A row whose largest |x| is below 1e-30
    // counts as zero (scale 1, each x rounds to 0): its scale's inverse would overflow float32.
    const bool finite = !any_nan && amax <= std::numeric_limits<float>::max();
    xs[m] = !finite ? std::numeric_limits<float>::quiet_NaN() : amax > 1e-30f ? amax / 32767.0f : 1.0f;
    const float inv = 1.0f / xs[m];
    const __m256 scale = _mm256_set1_ps(inv);
    for (k = 0; k + 16 <= K; k += 16) {  // rounded to nearest, ties to even (as lrintf for finite x), to int16
      const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(r + k), scale));
      const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(r + k + 8), scale));
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8);  // back in order
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k), packed);
    }
    for (; k < K; ++k) q[k] = static_cast<int16_t>(std::lrintf(r[k] * inv));
  }
  return {xq.data(), xs.data(), x};
}

// Groups [g0, g1) for rows x (a thread's share). A function of its own, called with its arguments by value:
// inlined into an OpenMP parallel region, whose body reads every shared variable through a pointer, the
// same tiles ran 25% slower (73 rows, K 768, N 3072, 2 threads: 51 vs 66 GFLOP/s on an AVX2 host).
template <typename W>
__attribute__((noinline)) void groups(Rows<W> x, int64_t M, int64_t K, const typename W::T* w, int64_t ldw,
                                      const float* scale, const float* bias, float* y, int64_t N, int64_t g0,
                                      int64_t g1, Op op) {
  for (int64_t g = g0; g < g1; ++g) group<W>(x, M, K, w, ldw, scale, bias, y, N, g, op);
}

// y[M, N] (op) x[M, K] @ w[N, K]^T * scale + bias, on `threads` threads (scale: int8 only; bias may be null).
template <typename W>
void matmul(const float* x, int64_t M, int64_t K, const typename W::T* w, int64_t ldw, const float* scale,
            const float* bias, float* y, int64_t N, int threads, Op op = Op::kStore) {
  thread_local std::vector<int16_t> xq;
  thread_local std::vector<float> xs;
  const Rows<W> rows = prepare(x, M, K, xq, xs, W());
  const int64_t n_groups = (N + NR - 1) / NR;
  for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {  // one pass over W per block of rows
    const int64_t m = M - m0 < kRowBlock ? M - m0 : kRowBlock;
    const Rows<W> xb = rows.from(m0, K);
    float* yb = y + m0 * N;
    if constexpr (std::is_same<W, F32>::value || kOuterInt8) {
      if (outer_pays(m, K, N)) {
        outer_product<W>(xb, m, K, w, ldw, scale, bias, yb, N, threads, op);
        continue;
      }
    }
    // static split: each thread one contiguous run of outputs, so one contiguous slab of W
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
      const int64_t id = omp_get_thread_num(), nt = omp_get_num_threads();
      groups<W>(xb, m, K, w, ldw, scale, bias, yb, N, n_groups * id / nt, n_groups * (id + 1) / nt, op);
    }
  }
}

}  // namespace gpt2

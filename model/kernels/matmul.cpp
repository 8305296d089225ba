// Small-M matrix products for the decode step: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), M a few rows.
//
// W is stored [N, K] row-major (nn.Linear's layout: one output's weights contiguous), so every output is a
// dot product over a contiguous row and each thread streams one contiguous slab of W: the threads split the
// outputs N, not K, and never share a cache line of W. A tile holds MR rows of x against NR rows of W in
// MR * NR AVX2 accumulators (8 lanes of K each), summed across lanes at the end. Two weight types: float32,
// and int8 with one float32 scale per output (symmetric, per output channel), dequantized in registers
// (int8 -> int32 -> float32) and accumulated in float32.
//
// Plain C ABI, no torch headers: compiled in a second with -mavx2 -mfma -fopenmp. OpenMP here is torch's own
// runtime (libgomp.so.1 is already loaded by torch when this library is), and the thread count is the
// caller's (torch.get_num_threads()).
#include <immintrin.h>
#include <stdint.h>

#include <type_traits>
#include <vector>

namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

struct F32 {  // float32 weights
  using T = float;
  static inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
  static inline float at(const float* w) { return *w; }
};

struct I8 {  // int8 weights, dequantized in registers (the scale is applied once per output, at the end)
  using T = int8_t;
  static inline __m256 load8(const int8_t* w) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
  }
  static inline float at(const int8_t* w) { return static_cast<float>(*w); }
};

// One tile: rows m0..m0+MR of x against outputs n0..n0+NR, over all of K.
template <typename W, int MR, int NR>
inline void tile(const float* x, int64_t K, const typename W::T* w, int64_t ldw, const float* scale,
                 const float* bias, float* y, int64_t ldy) {
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  const int64_t K8 = K & ~int64_t(7);
  for (int64_t k = 0; k < K8; k += 8) {
    __m256 xv[MR];
    for (int i = 0; i < MR; ++i) xv[i] = _mm256_loadu_ps(x + i * K + k);
    for (int j = 0; j < NR; ++j) {
      const __m256 wv = W::load8(w + j * ldw + k);
      for (int i = 0; i < MR; ++i) acc[i][j] = _mm256_fmadd_ps(xv[i], wv, acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) {
      float s = hsum(acc[i][j]);
      for (int64_t k = K8; k < K; ++k) s += x[i * K + k] * W::at(w + j * ldw + k);
      if (scale) s *= scale[j];
      if (bias) s += bias[j];
      y[i * ldy + j] = s;
    }
  }
}

template <typename W, int MR>
inline void tile_rows(const float* x, int64_t K, const typename W::T* w, int64_t ldw, const float* scale,
                      const float* bias, float* y, int64_t ldy, int nr) {
  switch (nr) {
    case 4: tile<W, MR, 4>(x, K, w, ldw, scale, bias, y, ldy); break;
    case 3: tile<W, MR, 3>(x, K, w, ldw, scale, bias, y, ldy); break;
    case 2: tile<W, MR, 2>(x, K, w, ldw, scale, bias, y, ldy); break;
    default: tile<W, MR, 1>(x, K, w, ldw, scale, bias, y, ldy); break;
  }
}

constexpr int NR = 4;  // outputs per tile
constexpr int MR = 3;  // rows of x per tile: 3 x 4 accumulators, 3 x values and a weight vector in 16 registers

// nr (<= NR) outputs for every row of x: W's nr rows stay in cache while the row blocks go by. w, scale, bias
// and y point at the first of these outputs; y's rows are ldy apart.
template <typename W>
inline void outputs(const float* x, int64_t M, int64_t K, const typename W::T* w, int64_t ldw, const float* scale,
                    const float* bias, float* y, int64_t ldy, int nr) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR) tile_rows<W, MR>(x + m * K, K, w, ldw, scale, bias, y + m * ldy, ldy, nr);
  if (M - m == 2) tile_rows<W, 2>(x + m * K, K, w, ldw, scale, bias, y + m * ldy, ldy, nr);
  if (M - m == 1) tile_rows<W, 1>(x + m * K, K, w, ldw, scale, bias, y + m * ldy, ldy, nr);
}

// Outputs [g * NR, g * NR + NR) (fewer in the last group).
template <typename W>
inline void group(const float* x, int64_t M, int64_t K, const typename W::T* w, int64_t ldw, const float* scale,
                  const float* bias, float* y, int64_t N, int64_t g) {
  const int64_t n0 = g * NR;
  const int nr = static_cast<int>(N - n0 < NR ? N - n0 : NR);
  const float* bg = bias ? bias + n0 : nullptr;
  if (std::is_same<W, F32>::value || M <= MR) {
    outputs<W>(x, M, K, w + n0 * ldw, ldw, scale ? scale + n0 : nullptr, bg, y + n0, N, nr);
    return;
  }
  // int8 and more rows than one tile: dequantize these nr rows of W once (scale folded in) into a buffer that
  // stays in cache and run float32 tiles over it, rather than converting every weight once per row block.
  thread_local std::vector<float> buffer;
  buffer.resize(static_cast<size_t>(NR * K));
  for (int j = 0; j < nr; ++j) {
    const typename W::T* q = w + (n0 + j) * ldw;
    float* d = buffer.data() + j * K;
    const __m256 sv = _mm256_set1_ps(scale[n0 + j]);
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) _mm256_storeu_ps(d + k, _mm256_mul_ps(W::load8(q + k), sv));
    for (; k < K; ++k) d[k] = W::at(q + k) * scale[n0 + j];
  }
  outputs<F32>(x, M, K, buffer.data(), K, nullptr, bg, y + n0, N, nr);
}

// Rows of x per pass over W: as many as keep the block in L2 (about 256 KiB), a multiple of MR.
inline int64_t row_block(int64_t K) {
  int64_t rows = 65536 / (K > 0 ? K : 1);
  rows = rows < 2 * MR ? 2 * MR : rows > 16 * MR ? 16 * MR : rows;
  return rows / MR * MR;
}

template <typename W>
void matmul(const float* x, int64_t M, int64_t K, const typename W::T* w, int64_t ldw, const float* scale,
            const float* bias, float* y, int64_t N, int threads) {
  const int64_t groups = (N + NR - 1) / NR;
  const int64_t rb = row_block(K);
  for (int64_t m0 = 0; m0 < M; m0 += rb) {  // one pass over W per block of rows
    const int64_t m = M - m0 < rb ? M - m0 : rb;
    const float* xb = x + m0 * K;
    float* yb = y + m0 * N;
    if (threads <= 1) {
      for (int64_t g = 0; g < groups; ++g) group<W>(xb, m, K, w, ldw, scale, bias, yb, N, g);
      continue;
    }
    // static schedule: each thread one contiguous run of outputs, so one contiguous slab of W
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t g = 0; g < groups; ++g) group<W>(xb, m, K, w, ldw, scale, bias, yb, N, g);
  }
}

}  // namespace

extern "C" {

// y[M, N] = x[M, K] @ w[N, K]^T + bias[N]; w's rows ldw apart; bias may be null. x and y contiguous.
void gpt2_matmul_f32(const float* x, int64_t M, int64_t K, const float* w, int64_t ldw, const float* bias, float* y,
                     int64_t N, int threads) {
  matmul<F32>(x, M, K, w, ldw, nullptr, bias, y, N, threads);
}

// y[M, N] = (x[M, K] @ q[N, K]^T) * scale[N] + bias[N], q int8; bias may be null.
void gpt2_matmul_i8(const float* x, int64_t M, int64_t K, const int8_t* q, int64_t ldw, const float* scale,
                    const float* bias, float* y, int64_t N, int threads) {
  matmul<I8>(x, M, K, q, ldw, scale, bias, y, N, threads);
}

int gpt2_kernels_version(void) { return 1; }
}

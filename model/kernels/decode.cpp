// A forward pass of GPT-2 over new tokens of rows of the KV cache in one call, as a decode step (one token
// per row) or a prompt needs: the embedding, every block (LayerNorm, Q/K/V, the new keys and values into the cache,
// attention over each row's keys, the output projection and residual add, LayerNorm, MLP and residual add),
// the final LayerNorm and the LM head. The same math as GPT.forward (model/gpt.py) without the ATen calls
// and Python of an eager step, which cost a batch-1 step on a 2-core CPU as much as its matrix products.
// Any tokens of rows of the cache can go in one pass, so a continuous batch's decode tokens and prompt
// chunks share it. model/kernels/decode.py hands it the weights (float32, or int8 with a scale per output)
// and the cache; shapes in the comments.
#include <float.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "matmul.h"

namespace {

using gpt2::Op;

struct Linear {       // y = x @ w^T * scale + bias, w [n_out, n_in] with contiguous rows
  const void* w;      // float32, or int8 when scale is set
  const float* scale;  // [n_out] or null
  const float* bias;  // [n_out] or null
};

struct Norm {
  const float* gain;  // [C]
  const float* bias;  // [C]
};

struct Block {
  Norm ln_1;
  Linear c_attn;     // [3C, C]: Q, K, V
  Linear attn_proj;  // [C, C]
  Norm ln_2;
  Linear c_fc;       // [4C, C]
  Linear mlp_proj;   // [C, 4C]
};

struct Model {
  int64_t n_layer, n_embd, n_head, d_mlp, vocab;
  float eps;
  const float* wte;  // [vocab, C]: the token embedding
  const float* wpe;  // [n_positions, C]
  const Block* blocks;
  Norm ln_f;
  Linear lm_head;  // [vocab, C]
};

struct Cache {
  float* k;  // [n_layer, capacity, H, max_len, D]
  float* v;
  int64_t capacity, max_len;
};

void linear(const Linear& f, const float* x, int64_t M, int64_t K, float* y, int64_t N, int threads, Op op) {
  if (f.scale)
    gpt2::matmul<gpt2::I8>(x, M, K, static_cast<const int8_t*>(f.w), K, f.scale, f.bias, y, N, threads, op);
  else
    gpt2::matmul<gpt2::F32>(x, M, K, static_cast<const float*>(f.w), K, nullptr, f.bias, y, N, threads, op);
}

// y[m] = (x[m] - mean) / sqrt(var + eps) * gain + bias for one row of C (statistics in double, 4 lanes of
// it at a time; the rest of C one by one).
void layer_norm_row(const Norm& n, const float* r, int64_t C, float eps, float* y) {
  const int64_t Cv = C - C % 8;
  __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
  for (int64_t c = 0; c < Cv; c += 8) {
    s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm_loadu_ps(r + c)));
    s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm_loadu_ps(r + c + 4)));
  }
  double sum = gpt2::hsum(_mm256_add_pd(s0, s1));
  for (int64_t c = Cv; c < C; ++c) sum += r[c];
  const double mean = sum / C;
  const __m256d mu_d = _mm256_set1_pd(mean);
  s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
  for (int64_t c = 0; c < Cv; c += 8) {
    const __m256d a = _mm256_sub_pd(_mm256_cvtps_pd(_mm_loadu_ps(r + c)), mu_d);
    const __m256d b = _mm256_sub_pd(_mm256_cvtps_pd(_mm_loadu_ps(r + c + 4)), mu_d);
    s0 = _mm256_fmadd_pd(a, a, s0), s1 = _mm256_fmadd_pd(b, b, s1);
  }
  double squares = gpt2::hsum(_mm256_add_pd(s0, s1));
  for (int64_t c = Cv; c < C; ++c) squares += (r[c] - mean) * (r[c] - mean);
  const float rstd = static_cast<float>(1.0 / std::sqrt(squares / C + eps));
  const float mu = static_cast<float>(mean);
  const __m256 mu_f = _mm256_set1_ps(mu), rstd_f = _mm256_set1_ps(rstd);
  for (int64_t c = 0; c < Cv; c += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(r + c), mu_f), rstd_f);
    _mm256_storeu_ps(y + c, _mm256_fmadd_ps(v, _mm256_loadu_ps(n.gain + c), _mm256_loadu_ps(n.bias + c)));
  }
  for (int64_t c = Cv; c < C; ++c) y[c] = (r[c] - mu) * rstd * n.gain[c] + n.bias[c];
}

// layer_norm_row for each of M rows, split among the threads from 8 rows on (at 80 rows of a server step,
// on one thread, 3.4 ms of its 100).
void layer_norm(const Norm& n, const float* x, int64_t M, int64_t C, float eps, float* y, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (M >= 8 && threads > 1)
  for (int64_t m = 0; m < M; ++m) layer_norm_row(n, x + m * C, C, eps, y + m * C);
}

void gelu(float* x, int64_t n, int threads) {  // in place, in blocks of 1024 floats split among the threads
  const int64_t blocks = (n + 1023) / 1024;
#pragma omp parallel for schedule(static) num_threads(threads) if (blocks > 1)
  for (int64_t i = 0; i < blocks; ++i) gpt2::gelu(x + i * 1024, i * 1024 + 1024 <= n ? 1024 : n - i * 1024);
}

// out[i] = (q . k_i) * scale for R keys k_0, k_1, ... (D apart): R independent sums in flight (one key's dot
// product alone waits on its FMA chain), each in the order of d.
template <int R>
inline void dots(const float* q, const float* k, int64_t D, float scale, float* out) {
  const int64_t Dv = D - D % 8;
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t d = 0; d < Dv; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    for (int i = 0; i < R; ++i) acc[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + i * D + d), acc[i]);
  }
  for (int i = 0; i < R; ++i) {
    float r = gpt2::hsum(acc[i]);
    for (int64_t d = Dv; d < D; ++d) r += q[d] * k[i * D + d];
    out[i] = r * scale;
  }
}

// How far ahead of a decode token's reads its keys and values are prefetched. A row's keys of one head are
// one short run ([n, D] floats: 51 KB at 200 positions), then its values another, and the hardware's
// prefetchers restart at every 4 KB page; ours keep each run streaming. Measured on a 2-core Zen 5 host,
// gpt2-small, 2 threads, fused passes (median, A/B in one process): 16 decode rows at about 200 positions
// 26.7 -> 23.6 ms (their attention 9.1 -> 7.2 ms), 8 rows at 400 positions 26.2 -> 23.2, one row at 300
// 9.5 -> 8.7, a server step (12 rows beside a 64-token chunk) 50.9 -> 48.3; 1 KB and 8 KB ahead were
// slower than 4 KB. The 16-client replay of bench_server's level: 279 -> 291 tok/s.
constexpr int64_t kKVAhead = 4096;  // bytes

// Prefetches [p, end) of a run of keys or values that ends at `end`, at most `bytes` of it.
inline void fetch_run(const float* p, const float* end, int64_t bytes) {
  const char* a = reinterpret_cast<const char*>(p);
  const char* stop = std::min(a + bytes, reinterpret_cast<const char*>(end));
  for (; a < stop; a += 64) _mm_prefetch(a, _MM_HINT_T0);
}

// out[s] = (q . keys[s]) * scale for the n keys, keys [n, D]: four keys at a time, the four keys' bytes
// kKVAhead further on prefetched as they go.
inline void scores(const float* q, const float* keys, int64_t n, int64_t D, float scale, float* out) {
  const float* end = keys + n * D;
  int64_t s = 0;
  for (; s + 4 <= n; s += 4) {
    fetch_run(keys + s * D + kKVAhead / 4, end, 4 * D * 4);
    dots<4>(q, keys + s * D, D, scale, out + s);
  }
  for (; s < n; ++s) dots<1>(q, keys + s * D, D, scale, out + s);
}

// out[d0, d0 + 8 V) = sum over the n keys of weights[s] * values[s][d0, d0 + 8 V), values [n, D]: V vectors
// of out held in registers across the keys.
template <int V>
inline void weighted_sum(const float* weights, const float* values, int64_t n, int64_t D, int64_t d0, float* out) {
  const float* end = values + n * D;
  __m256 acc[V];
  for (int i = 0; i < V; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t s = 0; s < n; ++s) {
    fetch_run(values + s * D + d0 + kKVAhead / 4, end, 8 * V * 4);  // this key's part, kKVAhead ahead
    const __m256 w = _mm256_set1_ps(weights[s]);
    for (int i = 0; i < V; ++i) acc[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(values + s * D + d0 + 8 * i), acc[i]);
  }
  for (int i = 0; i < V; ++i) _mm256_storeu_ps(out + d0 + 8 * i, acc[i]);
}

// Offset of (cache row, head h) in layer `layer` of the cache: [max_len, D] of keys (or values) there.
inline int64_t head_offset(const Cache& cache, int64_t layer, int64_t row, int64_t H, int64_t h, int64_t D) {
  return ((layer * cache.capacity + row) * H + h) * cache.max_len * D;
}

// One query (token t, head h, at position p) over keys 0..p of its row: scores, softmax, the weighted sum of
// the values, into z's row t. Where torch's softmax is NaN (a score NaN or +inf, every score -inf: scores
// out of float32's range), so is the output, as transformers' is (exp's clamp would make a plain average of
// the values of it), and the logits' check then refuses the step. (torch's fused CPU attention, which the
// eager pass takes where no hook reads the pattern, gives finite values there: 0 where every score is -inf.)
void attend_one(const float* qkv, int64_t C, int64_t h, int64_t t, int64_t p, const float* keys, const float* values,
                int64_t D, float scale, float* z, std::vector<float>& weights) {
  const float* q = qkv + t * 3 * C + h * D;  // [D]
  const int64_t n = p + 1;  // keys
  weights.resize(static_cast<size_t>(n + 7));  // room for exp8's last vector
  fetch_run(values, values + n * D, kKVAhead);  // the values' first lines, while the scores run
  fetch_run(keys, keys + n * D, kKVAhead);
  scores(q, keys, n, D, scale, weights.data());
  float best = -INFINITY;
  bool broken = false;
  for (int64_t s = 0; s < n; ++s) {
    broken |= !(weights[s] <= FLT_MAX);  // NaN or +inf
    best = weights[s] > best ? weights[s] : best;
  }
  float* out = z + t * C + h * D;  // [D]
  if (broken || best == -INFINITY) {
    std::fill(out, out + D, NAN);
    return;
  }
  const __m256 top = _mm256_set1_ps(best);
  for (int64_t s = 0; s < n; s += 8)  // softmax, unnormalised (what it makes of the padding is not used)
    _mm256_storeu_ps(&weights[s], gpt2::exp8(_mm256_sub_ps(_mm256_loadu_ps(&weights[s]), top)));
  float total = 0;
  for (int64_t s = 0; s < n; ++s) total += weights[s];
  int64_t d = 0;
  for (; d + 64 <= D; d += 64) weighted_sum<8>(weights.data(), values, n, D, d, out);
  for (; d + 8 <= D; d += 8) weighted_sum<1>(weights.data(), values, n, D, d, out);
  for (; d < D; ++d) {
    float sum = 0;
    for (int64_t s = 0; s < n; ++s) sum += weights[s] * values[s * D + d];
    out[d] = sum;
  }
  const float inv = 1.0f / total;
  for (d = 0; d < D; ++d) out[d] *= inv;
}

using gpt2::Lanes;
constexpr int64_t kL = gpt2::kLanes;  // lanes of a vector: 16 with AVX-512, 8 with AVX2
constexpr int64_t kBlockD = 64;       // the head size the blocks of queries take (every GPT-2's)

// st[r][i] = (q_i . k_r) * scale for R keys (D apart) and the L queries of qt [D, L], one vector per key:
// each d of a key broadcast against that d of every query, R keys' sums in flight.
template <int R>
inline void block_scores(const float* qt, const float* k, Lanes::V scale, float* st) {
  Lanes::V acc[R];
  for (int r = 0; r < R; ++r) acc[r] = Lanes::zero();
  for (int64_t d = 0; d < kBlockD; ++d) {
    const Lanes::V qv = Lanes::load(qt + d * kL);
    for (int r = 0; r < R; ++r) acc[r] = Lanes::fma(qv, Lanes::set1(k[r * kBlockD + d]), acc[r]);
  }
  for (int r = 0; r < R; ++r) Lanes::store(st + r * kL, Lanes::mul(acc[r], scale));
}

// A block of Tq (2 to L) queries of one prompt chunk, tokens t0.. at positions p0.. of one row, head h, over
// keys 0..p0 + Tq - 1, all at once. The queries are transposed (one vector holds one d of every query), and
// each key's d is broadcast against them: one pass over the row's keys serves the whole block, and no sum
// runs across lanes (attend_one sums a dot product's lanes for every key). The scores [n, L] are masked
// where a key lies after a query, and the softmax runs per lane; then each query's weighted sum of the
// values, G queries at a time against all of D, in the order of attend_one's (its scores sum d in another
// order: the two agree to float32 rounding). Measured on a 2-core Zen 5 host, gpt2-small, 2 threads, a pass
// of a 64-token chunk alone (median, A/B in one process): at positions 0-63 31.9 -> 30.8 ms, 200-263 47.2 ->
// 41.3, 600-663 45.1 -> 34.4 (its attention about 3.5x faster); with 16 decode rows beside it 56.1 -> 53.1.
// A query whose softmax torch makes NaN gives NaN, as attend_one's.
void attend_block(const float* qkv, int64_t C, int64_t h, int64_t t0, int64_t Tq, int64_t p0, const float* keys,
                  const float* values, float scale, float* z, std::vector<float>& buffer) {
  constexpr int64_t D = kBlockD, DV = D / kL;
  constexpr int G = kL == 16 ? 4 : 1;  // queries a weighted-sum tile: G x DV accumulators (16 with AVX-512, 8 AVX2)
  const int64_t n = p0 + Tq;          // keys
  buffer.resize(static_cast<size_t>((D + n + 1) * kL + 16));
  float* qt = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t{63});  // [D, L]
  float* st = qt + D * kL;  // [n, L]
  for (int64_t d = 0; d < D; ++d)
    for (int64_t i = 0; i < kL; ++i) qt[d * kL + i] = i < Tq ? qkv[(t0 + i) * 3 * C + h * D + d] : 0.0f;
  const Lanes::V sv = Lanes::set1(scale);
  int64_t s = 0;
  for (; s + 8 <= n; s += 8) block_scores<8>(qt, keys + s * D, sv, st + s * kL);
  for (; s < n; ++s) block_scores<1>(qt, keys + s * D, sv, st + s * kL);
  for (s = p0 + 1; s < n; ++s)  // query i (position p0 + i) sees keys up to p0 + i
    for (int64_t i = 0; i < s - p0; ++i) st[s * kL + i] = -INFINITY;
  Lanes::V top = Lanes::set1(-INFINITY);
  int broken = 0;  // the queries with a score NaN or +inf, or (below) every score they see -inf, as bits
  for (s = 0; s < n; ++s) {
    const Lanes::V v = Lanes::load(st + s * kL);
    top = Lanes::max(top, v);
    broken |= Lanes::above(v, FLT_MAX);
  }
  alignas(64) float tops[kL];
  Lanes::store(tops, top);
  for (int64_t i = 0; i < Tq; ++i) broken |= (tops[i] == -INFINITY) << i;
  for (s = 0; s < n; ++s)  // softmax, unnormalised; the masked keys' weights exactly 0
    Lanes::store(st + s * kL, Lanes::exp(Lanes::sub(Lanes::load(st + s * kL), top)));
  for (s = p0 + 1; s < n; ++s)
    for (int64_t i = 0; i < s - p0; ++i) st[s * kL + i] = 0.0f;
  Lanes::V total = Lanes::zero();
  for (s = 0; s < n; ++s) total = Lanes::add(total, Lanes::load(st + s * kL));
  alignas(64) float totals[kL];
  Lanes::store(totals, total);
  for (int64_t i0 = 0; i0 < Tq; i0 += G) {
    Lanes::V acc[G][DV];
    for (int g = 0; g < G; ++g)
      for (int v = 0; v < DV; ++v) acc[g][v] = Lanes::zero();
    const int64_t last = std::min(n, p0 + i0 + G);  // the keys these queries see (the block's padding: more)
    for (s = 0; s < last; ++s) {
      Lanes::V vv[DV];
      for (int v = 0; v < DV; ++v) vv[v] = Lanes::load_first(values + s * D + v * kL, kL);
      for (int g = 0; g < G; ++g) {
        const Lanes::V w = Lanes::set1(st[s * kL + i0 + g]);
        for (int v = 0; v < DV; ++v) acc[g][v] = Lanes::fma(w, vv[v], acc[g][v]);
      }
    }
    for (int g = 0; g < G && i0 + g < Tq; ++g) {
      const Lanes::V inv = Lanes::set1((broken >> (i0 + g)) & 1 ? NAN : 1.0f / totals[i0 + g]);
      float* out = z + (t0 + i0 + g) * C + h * D;
      for (int v = 0; v < DV; ++v) Lanes::store_first(out + v * kL, kL, Lanes::mul(acc[g][v], inv));
    }
  }
}

struct Span {  // tokens t0..t0 + n - 1, at consecutive positions of one row (a decode token alone: n = 1)
  int64_t t0, n;
};

// The N tokens as spans of at most L: a prompt chunk's runs of consecutive positions of one row (with a head
// size other than kBlockD, every token alone).
std::vector<Span> spans_of(const int64_t* rows, const int64_t* positions, int64_t N, int64_t D) {
  std::vector<Span> spans;
  for (int64_t t = 0; t < N; ++t) {
    if (D == kBlockD && !spans.empty()) {
      Span& last = spans.back();
      const int64_t end = last.t0 + last.n - 1;
      if (last.n < kL && rows[t] == rows[end] && positions[t] == positions[end] + 1) {
        ++last.n;
        continue;
      }
    }
    spans.push_back({t, 1});
  }
  return spans;
}

// Tasks first, first + stride, ... below `tasks` (spans x H heads) of attention: each a span's queries of
// head h attending over keys 0..positions[t] of their row, a block of a prompt chunk's (attend_block) or one
// token's (attend_one). Head by head, so that a prompt chunk's spans, which share their row's keys and
// values, find them in cache (token by token, every task read another head's: the attention of a 62-token
// chunk at 300-360 positions took 20% longer); interleaved among the threads, because a chunk's later
// tokens attend over more keys, with each head's spans rotated by h, so that a token's heads spread over
// the threads even when their count divides the spans (two decode rows, one long and one short, would
// otherwise each go to one thread). A function of its own with its arguments by value, as matmul.h's
// `groups` (an OpenMP body reads shared variables through pointers).
__attribute__((noinline)) void attend(const float* qkv, int64_t C, int64_t H, const Span* spans, int64_t S,
                                      const int64_t* rows, const int64_t* positions, Cache cache, int64_t layer,
                                      float* z, int64_t first, int64_t stride) {
  const int64_t D = C / H;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  thread_local std::vector<float> buffer;
  for (int64_t task = first; task < S * H; task += stride) {
    const int64_t h = task / S;
    const Span span = spans[(task + h) % S];
    const int64_t t = span.t0, p = positions[t];
    const float* keys = cache.k + head_offset(cache, layer, rows[t], H, h, D);  // [max_len, D]
    const float* values = cache.v + head_offset(cache, layer, rows[t], H, h, D);
    if (span.n == 1)
      attend_one(qkv, C, h, t, p, keys, values, D, scale, z, buffer);
    else
      attend_block(qkv, C, h, t, span.n, p, keys, values, scale, z, buffer);
  }
}

// The keys and values of N new tokens (qkv [N, 3C]) into the cache: token t's at position positions[t] of
// cache row rows[t].
void store_kv(const float* qkv, int64_t N, int64_t C, int64_t H, const int64_t* rows, const int64_t* positions,
              const Cache& cache, int64_t layer) {
  const int64_t D = C / H;
  for (int64_t t = 0; t < N; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const float* kv = qkv + t * 3 * C + C + h * D;  // its key; its value C further on
      float* keys = cache.k + head_offset(cache, layer, rows[t], H, h, D) + positions[t] * D;
      float* values = cache.v + head_offset(cache, layer, rows[t], H, h, D) + positions[t] * D;
      for (int64_t d = 0; d < D; ++d) keys[d] = kv[d], values[d] = kv[C + d];
    }
}

// Causal self-attention of N new tokens whose keys and values are in the cache (store_kv): qkv [N, 3C] ->
// z [N, C], each query attending over keys 0..positions[t] of its row rows[t] (its own row's earlier tokens,
// stored before or in this pass). One task per (span, head): a prompt chunk's tokens in blocks of L, each
// decode token alone (`spans_of`).
void attention(const float* qkv, int64_t N, int64_t C, int64_t H, const int64_t* rows, const int64_t* positions,
               const Cache& cache, int64_t layer, float* z, int threads) {
  const std::vector<Span> spans = spans_of(rows, positions, N, C / H);
  const int64_t S = static_cast<int64_t>(spans.size());
#pragma omp parallel num_threads(threads) if (threads > 1)
  attend(qkv, C, H, spans.data(), S, rows, positions, cache, layer, z, omp_get_thread_num(), omp_get_num_threads());
}

}  // namespace

extern "C" {

// A forward pass over N new tokens of rows of the cache: token t, id tokens[t], goes at position positions[t]
// of cache row rows[t] (a row's tokens in order, every earlier position of the row already stored or in this
// pass: the caller checks). Logits [n_out, vocab] of the tokens outputs[0..n_out) (distinct, so n_out <= N:
// the caller checks). A decode step is one token per row, at the row's length; a prompt chunk is a run of
// tokens of one row. Past the last layer's keys and values only the output tokens go on: the others' last
// attention and MLP would feed nothing (a prompt chunk's, in a 12-layer model, a 14th of its products).
void gpt2_forward(const Model* m, const Cache* cache, const int64_t* tokens, const int64_t* rows,
                  const int64_t* positions, int64_t N, const int64_t* outputs, int64_t n_out, float* logits,
                  int threads) {
  const int64_t C = m->n_embd;
  std::vector<float> x(N * C), h(N * C), qkv(N * 3 * C), z(N * C), u(N * m->d_mlp);  // the stream and scratch
  std::vector<int64_t> kept_rows, kept_positions;  // of the output tokens, in the last layer
  for (int64_t t = 0; t < N; ++t)
    for (int64_t c = 0; c < C; ++c) x[t * C + c] = m->wte[tokens[t] * C + c] + m->wpe[positions[t] * C + c];
  for (int64_t l = 0; l < m->n_layer; ++l) {
    const Block& w = m->blocks[l];
    layer_norm(w.ln_1, x.data(), N, C, m->eps, h.data(), threads);
    linear(w.c_attn, h.data(), N, C, qkv.data(), 3 * C, threads, Op::kStore);
    store_kv(qkv.data(), N, C, m->n_head, rows, positions, *cache, l);
    if (l == m->n_layer - 1) {  // from here on, the output tokens' rows only, in the order of outputs
      std::vector<float> x_out(n_out * C), qkv_out(n_out * 3 * C);
      kept_rows.resize(n_out), kept_positions.resize(n_out);
      for (int64_t o = 0; o < n_out; ++o) {
        const int64_t t = outputs[o];
        std::copy(x.begin() + t * C, x.begin() + (t + 1) * C, x_out.begin() + o * C);
        std::copy(qkv.begin() + t * 3 * C, qkv.begin() + (t + 1) * 3 * C, qkv_out.begin() + o * 3 * C);
        kept_rows[o] = rows[t], kept_positions[o] = positions[t];
      }
      x.swap(x_out), qkv.swap(qkv_out);
      N = n_out, rows = kept_rows.data(), positions = kept_positions.data();
    }
    attention(qkv.data(), N, C, m->n_head, rows, positions, *cache, l, z.data(), threads);
    linear(w.attn_proj, z.data(), N, C, x.data(), C, threads, Op::kAdd);  // x += attn(ln_1(x))
    layer_norm(w.ln_2, x.data(), N, C, m->eps, h.data(), threads);
    linear(w.c_fc, h.data(), N, C, u.data(), m->d_mlp, threads, Op::kStore);
    gelu(u.data(), N * m->d_mlp, threads);
    linear(w.mlp_proj, u.data(), N, m->d_mlp, x.data(), C, threads, Op::kAdd);  // x += mlp(ln_2(x))
  }
  layer_norm(m->ln_f, x.data(), n_out, C, m->eps, h.data(), threads);  // x: the output tokens' rows
  linear(m->lm_head, h.data(), n_out, C, logits, m->vocab, threads, Op::kStore);
}
}

// A forward pass of GPT-2 over a few new tokens in one call, as a decode step needs (one token per row of
// the KV cache): the embedding, every block (LayerNorm, Q/K/V, the new keys and values into the cache,
// attention over each row's keys, the output projection and residual add, LayerNorm, MLP and residual add),
// the final LayerNorm and the LM head. The same math as GPT.forward (model/gpt.py) without the ATen calls
// and Python of an eager step, which cost a batch-1 step on a 2-core CPU as much as its matrix products.
// Any few tokens of rows of the cache can go in one pass, so a continuous batch's decode tokens and prompt
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

// y[m] = (x[m] - mean) / sqrt(var + eps) * gain + bias for each of M rows of C (statistics in double)
void layer_norm(const Norm& n, const float* x, int64_t M, int64_t C, float eps, float* y) {
  for (int64_t m = 0; m < M; ++m) {
    const float* r = x + m * C;
    double sum = 0, squares = 0;
    for (int64_t c = 0; c < C; ++c) sum += r[c];
    const double mean = sum / C;
    for (int64_t c = 0; c < C; ++c) squares += (r[c] - mean) * (r[c] - mean);
    const float rstd = static_cast<float>(1.0 / std::sqrt(squares / C + eps));
    const float mu = static_cast<float>(mean);
    for (int64_t c = 0; c < C; ++c) y[m * C + c] = (r[c] - mu) * rstd * n.gain[c] + n.bias[c];
  }
}

void gelu(float* x, int64_t n, int threads) {  // in place, in blocks of 8 floats split among the threads
  const int64_t blocks = (n + 1023) / 1024;
#pragma omp parallel for schedule(static) num_threads(threads) if (blocks > 1)
  for (int64_t i = 0; i < blocks; ++i) gpt2::gelu(x + i * 1024, i * 1024 + 1024 <= n ? 1024 : n - i * 1024);
}

inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = gpt2::hsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float a, const float* x, float* y, int64_t n) {  // y += a x
  const __m256 av = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += a * x[i];
}

// Offset of (cache row, head h) in layer `layer` of the cache: [max_len, D] of keys (or values) there.
inline int64_t head_offset(const Cache& cache, int64_t layer, int64_t row, int64_t H, int64_t h, int64_t D) {
  return ((layer * cache.capacity + row) * H + h) * cache.max_len * D;
}

// Tasks first, first + stride, ... below `tasks` of attention: task = (token t, head h), its query attending
// over keys 0..positions[t] of its row. Interleaved among the threads, because a prompt chunk's later tokens
// attend over more keys. A function of its own with its arguments by value, as matmul.h's `groups` (an
// OpenMP body reads shared variables through pointers).
__attribute__((noinline)) void attend(const float* qkv, int64_t C, int64_t H, const int64_t* rows,
                                      const int64_t* positions, Cache cache, int64_t layer, float* z, int64_t first,
                                      int64_t stride, int64_t tasks) {
  const int64_t D = C / H;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  thread_local std::vector<float> weights;
  for (int64_t task = first; task < tasks; task += stride) {
    const int64_t t = task / H, h = task % H, p = positions[t];
    const float* q = qkv + t * 3 * C + h * D;  // [D]
    const float* keys = cache.k + head_offset(cache, layer, rows[t], H, h, D);  // [max_len, D]
    const float* values = cache.v + head_offset(cache, layer, rows[t], H, h, D);
    weights.resize(static_cast<size_t>(p + 1));
    float best = -FLT_MAX;
    for (int64_t s = 0; s <= p; ++s) {
      weights[s] = dot(q, keys + s * D, D) * scale;
      best = weights[s] > best ? weights[s] : best;
    }
    float total = 0;
    for (int64_t s = 0; s <= p; ++s) total += (weights[s] = std::exp(weights[s] - best));  // softmax, unnormalised
    float* out = z + t * C + h * D;  // [D]
    for (int64_t d = 0; d < D; ++d) out[d] = 0;
    for (int64_t s = 0; s <= p; ++s) axpy(weights[s], values + s * D, out, D);
    const float inv = 1.0f / total;
    for (int64_t d = 0; d < D; ++d) out[d] *= inv;
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
// stored before or in this pass). One task per (token, head).
void attention(const float* qkv, int64_t N, int64_t C, int64_t H, const int64_t* rows, const int64_t* positions,
               const Cache& cache, int64_t layer, float* z, int threads) {
#pragma omp parallel num_threads(threads) if (threads > 1)
  attend(qkv, C, H, rows, positions, cache, layer, z, omp_get_thread_num(), omp_get_num_threads(), N * H);
}

}  // namespace

extern "C" {

// A forward pass over N new tokens of rows of the cache: token t, id tokens[t], goes at position positions[t]
// of cache row rows[t] (a row's tokens in order, every earlier position of the row already stored or in this
// pass: the caller checks). Logits [n_out, vocab] of the tokens outputs[0..n_out). A decode step is one token
// per row, at the row's length; a prompt chunk is a run of tokens of one row. Past the last layer's keys and
// values only the output tokens go on: the others' last attention and MLP would feed nothing (a prompt
// chunk's, in a 12-layer model, a 14th of its products).
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
    layer_norm(w.ln_1, x.data(), N, C, m->eps, h.data());
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
    layer_norm(w.ln_2, x.data(), N, C, m->eps, h.data());
    linear(w.c_fc, h.data(), N, C, u.data(), m->d_mlp, threads, Op::kStore);
    gelu(u.data(), N * m->d_mlp, threads);
    linear(w.mlp_proj, u.data(), N, m->d_mlp, x.data(), C, threads, Op::kAdd);  // x += mlp(ln_2(x))
  }
  layer_norm(m->ln_f, x.data(), n_out, C, m->eps, h.data());  // x: the output tokens' rows
  linear(m->lm_head, h.data(), n_out, C, logits, m->vocab, threads, Op::kStore);
}
}

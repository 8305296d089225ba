// The matrix products of matmul.h with a plain C ABI (no torch headers), for model/kernels/__init__.py:
// compiled with -fopenmp and the flags of the build model/kernels/__init__.py chooses (AVX2, AVX-512 or AVX-512
// with VNNI), together with decode.cpp, about 12 s once per source version. OpenMP here is torch's own
// runtime (libgomp.so.1 is already loaded by torch when this library is), and the thread count is the
// caller's (torch.get_num_threads()).
#include "matmul.h"

extern "C" {

// y[M, N] = x[M, K] @ w[N, K]^T + bias[N]; w's rows ldw apart; bias may be null. x and y contiguous.
void gpt2_matmul_f32(const float* x, int64_t M, int64_t K, const float* w, int64_t ldw, const float* bias, float* y,
                     int64_t N, int threads) {
  gpt2::matmul<gpt2::F32>(x, M, K, w, ldw, nullptr, bias, y, N, threads);
}

// y[M, N] = (x[M, K] @ q[N, K]^T) * scale[N] + bias[N], q int8; bias may be null.
void gpt2_matmul_i8(const float* x, int64_t M, int64_t K, const int8_t* q, int64_t ldw, const float* scale,
                    const float* bias, float* y, int64_t N, int threads) {
  gpt2::matmul<gpt2::I8>(x, M, K, q, ldw, scale, bias, y, N, threads);
}

// The 512-bit FMAs a core starts each cycle (1 or 2), as the products choose their tiles by it (matmul.h's
// `fma_ports`: measured once; 1 in the AVX2 build, which does not use it); `set` 1 or 2 overrides it, 0 goes
// back to the measured count, anything below 0 leaves it as it is.
int gpt2_fma_ports(int set) {
  if (set >= 0) gpt2::set_fma_ports(set);
  return gpt2::fma_ports();
}

}

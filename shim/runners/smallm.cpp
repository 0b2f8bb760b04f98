// Small-M float32 linear, y = x @ w^T (+ b), for 1 to 8 rows: each weight row is read once from memory and
// multiplied into every input row while it is in registers, several weight rows at a time (more weight
// streams in flight), with a software prefetch ahead on each. AVX-512 intrinsics where the compiler
// targets AVX-512 (-march=native), GCC vector code otherwise. Built and loaded by smallm.py beside it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int L = 16;           // floats per vector (one zmm; two ymm or four xmm in the generic code)
constexpr int64_t AHEAD = 128;  // floats prefetched ahead on each weight row

#if defined(__AVX512F__)
typedef __m512 vec;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float hsum(vec v) { return _mm512_reduce_add_ps(v); }
#else
typedef float vec __attribute__((vector_size(L * sizeof(float))));
typedef float uvec __attribute__((vector_size(L * sizeof(float)), aligned(4), may_alias));
inline vec vzero() { return vec{}; }
inline vec vload(const float* p) { return *reinterpret_cast<const uvec*>(p); }
inline vec vfma(vec a, vec b, vec c) { return a * b + c; }
inline float hsum(vec v) {
  float s = 0.f;
  _Pragma("GCC unroll 16") for (int i = 0; i < L; ++i) s += v[i];
  return s;
}
#endif

// Rows [n0, n1) of w, NB at a time; K % L tail in scalar code.
template <int M, int NB>
void rows(const float* x, const float* w, const float* b, float* out, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const int64_t kv = K - K % L;
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) {
    vec acc[NB][M];
    _Pragma("GCC unroll 16") for (int j = 0; j < NB; ++j)
      _Pragma("GCC unroll 16") for (int m = 0; m < M; ++m) acc[j][m] = vzero();
    for (int64_t k = 0; k < kv; k += L) {
      vec wv[NB];
      _Pragma("GCC unroll 16") for (int j = 0; j < NB; ++j) {
        const float* row = w + (n + j) * K + k;
        __builtin_prefetch(row + AHEAD);
        wv[j] = vload(row);
      }
      _Pragma("GCC unroll 16") for (int m = 0; m < M; ++m) {
        const vec xv = vload(x + m * K + k);
        _Pragma("GCC unroll 16") for (int j = 0; j < NB; ++j) acc[j][m] = vfma(wv[j], xv, acc[j][m]);
      }
    }
    _Pragma("GCC unroll 16") for (int j = 0; j < NB; ++j) {
      _Pragma("GCC unroll 16") for (int m = 0; m < M; ++m) {
        float s = hsum(acc[j][m]);
        for (int64_t k = kv; k < K; ++k) s += w[(n + j) * K + k] * x[m * K + k];
        out[m * N + n + j] = b ? s + b[n + j] : s;
      }
    }
  }
  if (n < n1) rows<M, 1>(x, w, b, out, K, N, n, n1);
}

template <int M>
void run(const float* x, const float* w, const float* b, float* out, int64_t K, int64_t N) {
  constexpr int NB = M <= 4 ? 8 : 4;
  const int64_t blocks = N / NB;
  if (blocks == 0) {  // fewer weight rows than one block: one at a time
    rows<M, NB>(x, w, b, out, K, N, 0, N);
    return;
  }
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    rows<M, NB>(x, w, b, out, K, N, b0 * NB, b1 == blocks ? N : b1 * NB);
  });
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "smallm.linear: x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "smallm.linear: float32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "smallm.linear: contiguous x and w only");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(M >= 1 && M <= 8, "smallm.linear: 1 to 8 rows");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N, "smallm.linear: bias");
    bp = bias->data_ptr<float>();
  }
  at::Tensor out = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  switch (M) {
    case 1: run<1>(xp, wp, bp, op, K, N); break;
    case 2: run<2>(xp, wp, bp, op, K, N); break;
    case 3: run<3>(xp, wp, bp, op, K, N); break;
    case 4: run<4>(xp, wp, bp, op, K, N); break;
    case 5: run<5>(xp, wp, bp, op, K, N); break;
    case 6: run<6>(xp, wp, bp, op, K, N); break;
    case 7: run<7>(xp, wp, bp, op, K, N); break;
    default: run<8>(xp, wp, bp, op, K, N); break;
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(specheads_smallm, m) { m.def("linear(Tensor x, Tensor w, Tensor? bias=None) -> Tensor"); }
TORCH_LIBRARY_IMPL(specheads_smallm, CPU, m) { m.impl("linear", &linear); }

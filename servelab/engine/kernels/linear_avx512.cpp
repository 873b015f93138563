// Matmul y = x W^T for decoding on AVX-512 CPUs, with W stored so that it is read as one stream.
//
// Layout "blocked16": W (N, K) becomes (N/16, K, 16) in fp32, or (N/16, K/2, 16, 2) in bf16: each
// 64-byte line holds one k (fp32) or two adjacent k (bf16) of 16 consecutive outputs. A block of 16
// outputs is streamed once from memory and, while it sits in L1/L2, serves every row of x. At small
// batch this runs near the memory bandwidth, where MKL's GEMV and oneDNN's packed matmul reach about
// half of it on this CPU class. Accumulation is fp32 in both precisions (bf16: vdpbf16ps, the result
// rounded to bf16 once, as oneDNN does).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int64_t kBlock = 16;
constexpr int kMaxRows = 8;  // rows of x per pass over a block: 8 zmm accumulators

// R rows of x times C adjacent blocks (16 C outputs): R x C accumulators, each weight line used R times.
template <int R, int C>
void block_f32(const float* w, const float* x, int64_t K, float* y, int64_t ldy) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = _mm512_loadu_ps(w + c * K * kBlock + k * kBlock);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * K + k]);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(wv[c], xv, acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(y + r * ldy + c * kBlock, acc[r][c]);
}

#ifdef __AVX512BF16__
template <int R, int C>
void block_bf16(const uint16_t* w, const uint16_t* x, int64_t K, uint16_t* y, int64_t ldy) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < K / 2; ++p) {
    __m512bh wv[C];
    for (int c = 0; c < C; ++c) wv[c] = (__m512bh)_mm512_loadu_si512(w + c * K * kBlock + p * 2 * kBlock);
    for (int r = 0; r < R; ++r) {
      int32_t pair;  // x[2p], x[2p + 1], broadcast to every lane
      std::memcpy(&pair, x + r * K + 2 * p, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], wv[c], xv);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      _mm256_storeu_si256((__m256i*)(y + r * ldy + c * kBlock), (__m256i)_mm512_cvtneps_pbh(acc[r][c]));
}
#endif

// fn(rows, blocks) with both as compile-time constants: rows 1..8, blocks 1 or 2.
template <typename Fn>
void dispatch(int rows, int blocks, Fn&& fn) {
  auto with_rows = [&](auto b) {
    switch (rows) {
      case 1: fn(std::integral_constant<int, 1>{}, b); break;
      case 2: fn(std::integral_constant<int, 2>{}, b); break;
      case 3: fn(std::integral_constant<int, 3>{}, b); break;
      case 4: fn(std::integral_constant<int, 4>{}, b); break;
      case 5: fn(std::integral_constant<int, 5>{}, b); break;
      case 6: fn(std::integral_constant<int, 6>{}, b); break;
      case 7: fn(std::integral_constant<int, 7>{}, b); break;
      default: fn(std::integral_constant<int, 8>{}, b); break;
    }
  };
  if (blocks == 2) with_rows(std::integral_constant<int, 2>{});
  else with_rows(std::integral_constant<int, 1>{});
}

// Every block pair once from memory; all rows of x against it while it is in cache.
template <typename T, typename Kernel>
void run_blocks(const T* W, const T* X, T* Y, int64_t M, int64_t K, int64_t num_blocks, Kernel&& kernel) {
  const int64_t num_pairs = (num_blocks + 1) / 2;
  at::parallel_for(0, num_pairs, 2, [&](int64_t p0, int64_t p1) {
    for (int64_t pair = p0; pair < p1; ++pair) {
      const int64_t b = 2 * pair;
      const int blocks = static_cast<int>(std::min<int64_t>(2, num_blocks - b));
      for (int64_t m = 0; m < M; m += kMaxRows) {
        dispatch(static_cast<int>(std::min<int64_t>(kMaxRows, M - m)), blocks, [&](auto rows, auto cols) {
          kernel(rows, cols, W + b * K * kBlock, X + m * K, Y + m * (num_blocks * kBlock) + b * kBlock);
        });
      }
    }
  });
}

}  // namespace

// W (N, K), N a multiple of 16 (bf16: K even too) -> the blocked layout, flat.
torch::Tensor pack(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) % kBlock == 0, "pack: weight must be (N, K) with N % 16 == 0");
  const int64_t N = weight.size(0), K = weight.size(1);
  if (weight.scalar_type() == torch::kFloat32) {
    return weight.view({N / kBlock, kBlock, K}).transpose(1, 2).contiguous();  // (N/16, K, 16)
  }
  TORCH_CHECK(weight.scalar_type() == torch::kBFloat16 && K % 2 == 0, "pack: bf16 weight needs an even K");
  return weight.view({N / kBlock, kBlock, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();  // (N/16, K/2, 16, 2)
}

// x (M, K) contiguous, packed from pack() -> y (M, N) in x's dtype.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "linear: x must be a contiguous (M, K) tensor");
  TORCH_CHECK(x.scalar_type() == packed.scalar_type(), "linear: x and weight dtypes differ");
  const int64_t M = x.size(0), K = x.size(1), num_blocks = packed.size(0), N = num_blocks * kBlock;
  TORCH_CHECK(packed.numel() == N * K, "linear: x has K=", K, " but the weight does not");
  auto y = torch::empty({M, N}, x.options());
  if (x.scalar_type() == torch::kFloat32) {
    run_blocks(packed.data_ptr<float>(), x.data_ptr<float>(), y.data_ptr<float>(), M, K, num_blocks,
               [&](auto rows, auto cols, const float* w, const float* xr, float* yr) {
                 block_f32<decltype(rows)::value, decltype(cols)::value>(w, xr, K, yr, N);
               });
    return y;
  }
#ifdef __AVX512BF16__
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "linear: fp32 or bf16 only");
  run_blocks(reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()),
             reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()),
             reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), M, K, num_blocks,
             [&](auto rows, auto cols, const uint16_t* w, const uint16_t* xr, uint16_t* yr) {
               block_bf16<decltype(rows)::value, decltype(cols)::value>(w, xr, K, yr, N);
             });
  return y;
#else
  TORCH_CHECK(false, "linear: this build has no AVX-512 bf16 path");
#endif
}

bool has_bf16() {
#ifdef __AVX512BF16__
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "W (N, K) -> the blocked16 layout");
  m.def("linear", &linear, "x (M, K) @ W^T with W in the blocked16 layout");
  m.def("has_bf16", &has_bf16, "whether the bf16 path was compiled (AVX-512 BF16)");
}

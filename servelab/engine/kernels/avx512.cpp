// servelab's CPU kernels for decoding on AVX-512: the matmul y = x W^T with W stored so that it is read
// as one stream, and the attention of one new query per row over the KV cache.
//
// Matmul.
// Layout "blocked16": W (N, K) becomes (N/16, K, 16) in fp32, or (N/16, K/2, 16, 2) in bf16: each
// 64-byte line holds one k (fp32) or two adjacent k (bf16) of 16 consecutive outputs. A block of 16
// outputs is streamed once from memory and, while it sits in L1/L2, serves every row of x. At small
// batch this runs near the memory bandwidth, where MKL's GEMV and oneDNN's packed matmul reach about
// half of it on this CPU class. Accumulation is fp32 in both precisions (bf16: vdpbf16ps, the result
// rounded to bf16 once, as oneDNN does).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <type_traits>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kBlock = 16;
constexpr int kMaxRows = 8;  // rows of x per pass over a block: 8 zmm accumulators

// R rows of x times C adjacent blocks (16 C outputs): R x C accumulators, each weight line used R times.
// (R x C > 16 only arises with R <= 4, C = 4.)
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

// fn(rows, blocks) with both as compile-time constants: rows 1..8, blocks 1..4.
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
  switch (blocks) {
    case 1: with_rows(std::integral_constant<int, 1>{}); break;
    case 2: with_rows(std::integral_constant<int, 2>{}); break;
    case 3: with_rows(std::integral_constant<int, 3>{}); break;
    default: with_rows(std::integral_constant<int, 4>{}); break;
  }
}

// Every span of blocks once from memory; all rows of x against it while it is in cache. Few rows: spans of
// 4 blocks (4 weight streams in flight, measured 5-15 % faster at 1-4 rows); more rows: spans of 2, so that
// 8 rows x 2 blocks of accumulators fit the 32 registers.
template <typename T, typename Kernel>
void run_blocks(const T* W, const T* X, T* Y, int64_t M, int64_t K, int64_t num_blocks, Kernel&& kernel) {
  const int64_t span = M <= 4 ? 4 : 2;
  const int64_t num_spans = (num_blocks + span - 1) / span;
  at::parallel_for(0, num_spans, 2, [&](int64_t s0, int64_t s1) {
    for (int64_t i = s0; i < s1; ++i) {
      const int64_t b = span * i;
      const int blocks = static_cast<int>(std::min<int64_t>(span, num_blocks - b));
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

namespace {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(at::BFloat16* p, __m512 v) {
#ifdef __AVX512BF16__
  _mm256_storeu_si256((__m256i*)p, (__m256i)_mm512_cvtneps_pbh(v));
#else
  alignas(64) float tmp[16];
  _mm512_store_ps(tmp, v);
  for (int i = 0; i < 16; ++i) p[i] = at::BFloat16(tmp[i]);
#endif
}

// One row, one kv head: the G query heads of its group against S cached keys and values, all in fp32.
template <typename Q, typename KV>
void attend_group(const Q* q, int64_t q_head_stride, const KV* k, const KV* v, int64_t s_stride, int64_t S,
                  int64_t D, const bool* mask, float scale, int64_t G, Q* out, int64_t out_head_stride,
                  float* scores) {
  for (int64_t g = 0; g < G; ++g) {
    const Q* qg = q + g * q_head_stride;
    float* sc = scores + g * S;
    float max_score = -INFINITY;
    for (int64_t s = 0; s < S; ++s) {
      if (mask && !mask[s]) { sc[s] = -INFINITY; continue; }
      __m512 acc = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 16) acc = _mm512_fmadd_ps(load16(qg + d), load16(k + s * s_stride + d), acc);
      sc[s] = _mm512_reduce_add_ps(acc) * scale;
      max_score = std::max(max_score, sc[s]);
    }
    float total = 0.f;
    for (int64_t s = 0; s < S; ++s) {
      sc[s] = sc[s] == -INFINITY ? 0.f : std::exp(sc[s] - max_score);
      total += sc[s];
    }
    for (int64_t s = 0; s < S; ++s) sc[s] /= total;
  }
  for (int64_t d = 0; d < D; d += 16) {
    __m512 acc[16];  // G <= 16 query heads per kv head
    for (int64_t g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
    for (int64_t s = 0; s < S; ++s) {
      const __m512 vv = load16(v + s * s_stride + d);
      for (int64_t g = 0; g < G; ++g) acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g * S + s]), vv, acc[g]);
    }
    for (int64_t g = 0; g < G; ++g) store16(out + g * out_head_stride + d, acc[g]);
  }
}

template <typename Q, typename KV>
void decode_attention_impl(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                           const c10::optional<torch::Tensor>& mask, double scale, torch::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), H_kv = keys.size(1), S = keys.size(2), G = H / H_kv;
  const Q* Qp = q.data_ptr<Q>();
  const KV* Kp = keys.data_ptr<KV>();
  const KV* Vp = values.data_ptr<KV>();
  const bool* M = mask ? mask->data_ptr<bool>() : nullptr;
  Q* Op = out.data_ptr<Q>();
  at::parallel_for(0, B * H_kv, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores(G * S);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / H_kv, h = i % H_kv;
      attend_group(Qp + b * q.stride(0) + h * G * q.stride(1), q.stride(1),
                   Kp + b * keys.stride(0) + h * keys.stride(1), Vp + b * values.stride(0) + h * values.stride(1),
                   keys.stride(2), S, D, M ? M + b * mask->stride(0) : nullptr, static_cast<float>(scale), G,
                   Op + b * out.stride(0) + h * G * out.stride(1), out.stride(1), scores.data());
    }
  });
}

}  // namespace

// q (B, H, D); keys, values (B, H_kv, S, D), rows of D contiguous (views into the cache are fine); mask
// (B, S) bool or None -> (B, H, D) in q's dtype. Softmax and sums in fp32; a masked column weighs 0.
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                               const c10::optional<torch::Tensor>& mask, double scale) {
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 4 && values.sizes() == keys.sizes(), "decode_attention: shapes");
  TORCH_CHECK(q.size(2) % 16 == 0 && q.size(2) == keys.size(3), "decode_attention: head_dim must be a multiple of 16");
  TORCH_CHECK(q.size(1) % keys.size(1) == 0 && q.size(1) / keys.size(1) <= 16, "decode_attention: heads per kv head");
  TORCH_CHECK(q.stride(2) == 1 && keys.stride(3) == 1 && values.stride(3) == 1 && keys.strides() == values.strides(),
              "decode_attention: head_dim must be contiguous");
  TORCH_CHECK(!mask || (mask->scalar_type() == torch::kBool && mask->size(1) == keys.size(2) && mask->stride(1) == 1),
              "decode_attention: mask must be (B, S) bool");
  auto out = torch::empty(q.sizes(), q.options());
  const auto qt = q.scalar_type(), kt = keys.scalar_type();
  if (qt == torch::kFloat32 && kt == torch::kFloat32) decode_attention_impl<float, float>(q, keys, values, mask, scale, out);
  else if (qt == torch::kFloat32 && kt == torch::kBFloat16) decode_attention_impl<float, at::BFloat16>(q, keys, values, mask, scale, out);
  else if (qt == torch::kBFloat16 && kt == torch::kBFloat16) decode_attention_impl<at::BFloat16, at::BFloat16>(q, keys, values, mask, scale, out);
  else if (qt == torch::kBFloat16 && kt == torch::kFloat32) decode_attention_impl<at::BFloat16, float>(q, keys, values, mask, scale, out);
  else TORCH_CHECK(false, "decode_attention: fp32 or bf16 queries and cache");
  return out;
}

namespace {

inline __m512 round_to_bf16(__m512 v) {  // what storing to bf16 and loading back gives (round to nearest even)
  alignas(64) at::BFloat16 tmp[16];
  store16(tmp, v);
  return load16(tmp);
}

template <typename T>
void rms_norm_impl(const torch::Tensor& x, const torch::Tensor& weight, double eps, torch::Tensor& out) {
  const int64_t C = x.size(-1), rows = x.numel() / C;
  const T* X = x.data_ptr<T>();
  const T* W = weight.data_ptr<T>();
  T* Y = out.data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = X + r * C;
      __m512 squares = _mm512_setzero_ps();
      for (int64_t c = 0; c < C; c += 16) {
        const __m512 v = load16(xr + c);
        squares = _mm512_fmadd_ps(v, v, squares);
      }
      const __m512 scale = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(squares) / C + static_cast<float>(eps)));
      for (int64_t c = 0; c < C; c += 16) {
        __m512 normed = _mm512_mul_ps(load16(xr + c), scale);
        if constexpr (std::is_same_v<T, at::BFloat16>) normed = round_to_bf16(normed);  // cast back, then scale
        store16(Y + r * C + c, _mm512_mul_ps(load16(W + c), normed));
      }
    }
  });
}

}  // namespace

// transformers' LlamaRMSNorm: weight * (x * rsqrt(mean(x^2) + eps)) with the mean in fp32 and the normalised
// x cast back to x's dtype before the weight multiplies it. x (..., C) contiguous, C % 16 == 0.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && x.size(-1) % 16 == 0 && weight.numel() == x.size(-1) &&
              weight.scalar_type() == x.scalar_type(), "rms_norm: x (..., C) contiguous, C % 16 == 0, weight (C,)");
  auto out = torch::empty_like(x);
  if (x.scalar_type() == torch::kFloat32) rms_norm_impl<float>(x, weight.contiguous(), eps, out);
  else if (x.scalar_type() == torch::kBFloat16) rms_norm_impl<at::BFloat16>(x, weight.contiguous(), eps, out);
  else TORCH_CHECK(false, "rms_norm: fp32 or bf16");
  return out;
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
  m.def("rms_norm", &rms_norm, "transformers' LlamaRMSNorm, in one pass");
  m.def("decode_attention", &decode_attention, "one query per row against the KV cache (grouped heads)");
}

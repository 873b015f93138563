// servelab's CPU kernels for decoding: the matmul y = x W^T with W stored so that it is read as one
// stream, the attention of one new query per row over the KV cache, and RMSNorm.
//
// One source, two builds (kernels/__init__.py): AVX-512 (-march=native on an AVX-512 CPU) and AVX2 + FMA
// (-mavx2 -mfma, runs on both CPU kinds). Only the small vector layer below differs between them
// (`Vec`: 16 fp32 lanes in a zmm, or 8 in a ymm, and the register tiling that fits 32 or 16 registers);
// the weight layout, the loops and the arithmetic are shared, so both builds give the same results.
//
// Matmul.
// Layout "blocked16": W (N, K) becomes (N/16, K, 16) in fp32, or (N/16, K/2, 16, 2) in bf16: each
// 64-byte line holds one k (fp32) or two adjacent k (bf16) of 16 consecutive outputs. A block of 16
// outputs is streamed once from memory and, while it sits in L1/L2, serves every row of x. At small
// batch this runs near the memory bandwidth, where MKL's GEMV and oneDNN's packed matmul reach about
// half of it on these CPUs. Accumulation is fp32 in both precisions. bf16 weights: with AVX-512 BF16,
// vdpbf16ps on bf16 activations; without it, each 32-bit lane of a line (two adjacent k of one output)
// becomes two fp32 values by a shift and a mask, and the activations are fp32 (half the weight bytes of
// fp32, fp32 arithmetic). Either way the result is rounded to bf16 once (round to nearest even). In the
// AVX-512 BF16 build without AMX, bf16 keeps those lines but interleaves each 2 consecutive blocks' lines
// (kBf16Unit, bf16_lines): a pass over 2 blocks is one stream (measured faster at every row count there).
//
// Threads. Every kernel splits its work with at::parallel_for, torch's own pool (OpenMP in torch's CPU builds; the
// extension is compiled with -fopenmp, without which at::parallel_for runs everything on the calling thread), so
// torch.set_num_threads governs servelab's kernels as it does torch's. The unit a thread takes is whole: an even
// share of the output blocks (matmuls: every row's outputs of those blocks; over_blocks), a row (RMSNorm, SwiGLU,
// activation quantisation), a block (dequantisation), computed by the same code in the same order whatever the
// thread count, so the results do not depend on it. A second thread is woken only for at least min_thread_bytes of
// work (grain_for).
// NOTE: torch/types.h (tensors, torch:: factories) and torch's pybind11 casters, not torch/extension.h: that one also
// brings the whole C++ frontend (nn, optim, data), half of this file's compile time, and nothing here uses it
#include <torch/types.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <type_traits>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

constexpr int64_t kBlock = 16;
constexpr int64_t kMaxHeadDim = 256;  // a paged cache's head_dim, at most (attend_group_paged's key and query buffers)

#if defined(__AVX512F__)
constexpr const char* kIsa = "avx512";
constexpr int kLanes = 16;
constexpr int kMaxRows = 8;  // rows of x per pass over a span: 8 rows x 2 blocks of zmm accumulators
constexpr int kF32Rows = kMaxRows;
inline int64_t span_for(int64_t M) { return M <= 4 ? 4 : 2; }  // 4 weight streams in flight at 1-4 rows
using Vec = __m512;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vset1(float x) { return _mm512_set1_ps(x); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec vdiv(Vec a, Vec b) { return _mm512_div_ps(a, b); }
inline Vec vfnma(Vec a, Vec b, Vec c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a b
inline Vec vmin(Vec a, Vec b) { return _mm512_min_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec vandnot(Vec a, Vec b) { return _mm512_andnot_ps(a, b); }  // ~a & b
inline Vec vround(Vec a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec vpow2(Vec n) {  // 2^n for integral n in [-126, 127]
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
inline float vmaxall(Vec v) { return _mm512_reduce_max_ps(v); }
inline uint32_t veq_mask(Vec v, float m) { return _mm512_cmp_ps_mask(v, _mm512_set1_ps(m), _CMP_EQ_OQ); }  // lane i: bit i
inline Vec vload(const at::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline Vec vload(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
inline Vec vload_u8(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p))); }
inline Vec vload(const int8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))); }
// A line of bf16 pairs (lane j: k in the low half, k + 1 in the high half) -> the k and k + 1 fp32 vectors.
inline void vload_pairs(const uint16_t* p, Vec& even, Vec& odd) {
  const __m512i raw = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
#ifndef __AVX512BF16__
// v rounded to bf16 (nearest even; NaN stays NaN) in the high half of each lane's bits, the low half left over
inline __m512i bf16_rounded_bits(Vec v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
  return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
}
#endif
inline void vstore(at::BFloat16* p, Vec v) {
#ifdef __AVX512BF16__
  _mm256_storeu_si256((__m256i*)p, (__m256i)_mm512_cvtneps_pbh(v));
#else
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_rounded_bits(v), 16)));
#endif
}
// What storing v to bf16 and loading it back gives, in registers (the same rounding as vstore)
inline Vec round_to_bf16(Vec v) {
#ifdef __AVX512BF16__
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
#else
  return _mm512_castsi512_ps(_mm512_and_si512(bf16_rounded_bits(v), _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
#endif
}
#else  // AVX2 + FMA: 16 ymm registers
constexpr const char* kIsa = "avx2";
constexpr int kLanes = 8;
constexpr int kMaxRows = 4;  // 4 rows x 1 block = 8 accumulators
// fp32 weights: 6 rows x 1 block, 12 accumulators, 2 weight vectors and a broadcast in the 16 registers; two FMA
// pipes of 4 cycles' latency need 8 independent sums in flight, and 12 leave room for the loads (bf16's converted
// weights need more registers than that leaves: 4 rows)
constexpr int kF32Rows = 6;
inline int64_t span_for(int64_t M) { return M == 1 ? 4 : M == 2 ? 2 : 1; }  // 8 accumulators each
using Vec = __m256;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset1(float x) { return _mm256_set1_ps(x); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec vdiv(Vec a, Vec b) { return _mm256_div_ps(a, b); }
inline Vec vfnma(Vec a, Vec b, Vec c) { return _mm256_fnmadd_ps(a, b, c); }  // c - a b
inline Vec vmin(Vec a, Vec b) { return _mm256_min_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec vandnot(Vec a, Vec b) { return _mm256_andnot_ps(a, b); }  // ~a & b
inline Vec vround(Vec a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec vpow2(Vec n) {  // 2^n for integral n in [-126, 127]
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline float vsum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}
inline float vmaxall(Vec v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_shuffle_ps(s, s, 1)));
}
inline uint32_t veq_mask(Vec v, float m) { return _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(m), _CMP_EQ_OQ)); }
inline Vec vload(const at::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline Vec vload(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
inline Vec vload_u8(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
inline Vec vload(const int8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
inline void vload_pairs(const uint16_t* p, Vec& even, Vec& odd) {
  const __m256i raw = _mm256_loadu_si256((const __m256i*)p);
  even = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
// v rounded to bf16 (nearest even; NaN stays NaN) in the high half of each lane's bits, the low half left over
inline __m256i bf16_rounded_bits(Vec v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC00000), nan);
}
inline void vstore(at::BFloat16* p, Vec v) {
  const __m256i halves = _mm256_srli_epi32(bf16_rounded_bits(v), 16);  // 8 values in the low 16 bits of each lane
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(halves, halves), 0x08);
  _mm_storeu_si128((__m128i*)p, _mm256_castsi256_si128(packed));
}
// What storing v to bf16 and loading it back gives, in registers (the same rounding as vstore)
inline Vec round_to_bf16(Vec v) {
  return _mm256_castsi256_ps(_mm256_and_si256(bf16_rounded_bits(v), _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
#endif

constexpr int kVecs = kBlock / kLanes;  // vectors per 16-output block line

// The least work (bytes read, weights times row passes for a matmul) worth waking a thread for: waking the pool
// and joining it costs a few microseconds, about what one core streams 32 KB in. thread_grain() sets it (the
// grain measurement in bench/thread_grain.py); 0 splits any work.
std::atomic<int64_t> min_thread_bytes{32 << 10};
// at::parallel_for's grain (items per thread at least) for items of `item_bytes` each.
inline int64_t grain_for(int64_t item_bytes) {
  const int64_t item = std::max<int64_t>(item_bytes, 1);
  return std::max<int64_t>(1, (min_thread_bytes.load(std::memory_order_relaxed) + item - 1) / item);
}

// A per-call buffer of n values left uninitialised (std::vector would zero it first, on the calling thread alone,
// while the others wait: 3 % of an int4 prefill at 2 threads): for buffers the kernel writes in full.
template <typename T>
std::unique_ptr<T[]> scratch(int64_t n) {
  return std::unique_ptr<T[]>(new T[n]);
}

// A team: the threads of one parallel region that a fused step (DecodeStack) opens once for all its layers,
// where every kernel would otherwise open and join its own (about 2.5 us each at 2 threads on an AVX2 EPYC, 150 a
// step). Inside it, split_for gives each thread its static share of a kernel's items, as at::parallel_for would
// split them, then waits at a barrier; outside one, it is at::parallel_for.
// A team of one (`alone`) is a thread of a team doing the whole of a kernel by itself, with no barrier: the few rows
// of a norm or an activation's quantisation every thread repeats for its own copy, where splitting them would cost
// a barrier for a microsecond of work.
struct Team {
  int64_t rank, size;
  bool alone = false;
};
thread_local const Team* current_team = nullptr;

template <typename F>
void split_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (current_team == nullptr) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  if (current_team->alone) {
    if (end > begin) f(begin, end);
    return;
  }
  const int64_t range = end - begin;
  if (range > 0) {
    const int64_t used = std::min<int64_t>(current_team->size, (range + grain - 1) / std::max<int64_t>(grain, 1));
    const int64_t chunk = (range + used - 1) / used, first = begin + current_team->rank * chunk;
    if (first < end) f(first, std::min(end, first + chunk));
  }
#ifdef _OPENMP
#pragma omp barrier
#endif
}


// e^x to about 1 ulp (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, times 2^n), x clamped to
// [-87, 88], where e^x and 2^n are normal floats (what lies beyond only feeds silu, where it rounds away).
inline Vec vexp(Vec x) {
  x = vmin(vmax(x, vset1(-87.f)), vset1(88.f));
  const Vec n = vround(vmul(x, vset1(1.44269504088896341f)));
  Vec r = vfnma(n, vset1(0.693359375f), x);
  r = vfnma(n, vset1(-2.12194440e-4f), r);
  Vec p = vset1(1.9875691500e-4f);
  p = vfma(p, r, vset1(1.3981999507e-3f));
  p = vfma(p, r, vset1(8.3334519073e-3f));
  p = vfma(p, r, vset1(4.1665795894e-2f));
  p = vfma(p, r, vset1(1.6666665459e-1f));
  p = vfma(p, r, vset1(5.0000001201e-1f));
  p = vfma(p, vmul(r, r), vadd(r, vset1(1.f)));
  return vmul(p, vpow2(n));
}

// The output of a matmul, optionally with a residual r added: r + y as `r + x @ W^T` computes it unfused, y
// rounded to the output dtype first, so fusing the add changes no result.
template <typename TY>
inline void store_out(TY* y, Vec acc, const TY* r) {
  if (r != nullptr) {
    if constexpr (std::is_same_v<TY, at::BFloat16>) acc = round_to_bf16(acc);
    acc = vadd(acc, vload(r));
  }
  vstore(y, acc);
}
// Each block's stream of a dense matmul is prefetched some lines ahead of its loads. Where a pass streams 4 blocks
// at once (the few-row passes, whose bound is the weights' stream), where to and how far is chosen by the CPU's
// vendor, as measured; other passes (more rows, fewer blocks) prefetch 32 lines into L1 on every CPU. A prefetch past
// the end of the weights is harmless. weight_prefetch() reads or sets the 4-stream setting; bench/prefetch.py compares
// settings on a model's weights.
// - Intel Xeon (both builds): 32 lines (2 KB) into L1 measured +10-30 % at 4 rows and in bf16 against none, the
//   same at 1 fp32 row.
// - AMD EPYC (CPU family 25, AVX-512): that prefetch into L1 cost 15-17 % at 1 row. 16 lines into L2 streamed a
//   model's weights x1.15-1.33 faster at 1 and 4 rows (fp32 and bf16, 1 and 2 threads; AVX-512 build, 4 blocks a
//   pass) and at 1 row in the AVX2 build (x1.06-1.21), but x0.68-0.87 at 4 and 16 rows there (1 block a pass) and
//   x0.98-1.00 at 16 rows in the AVX-512 build (2 blocks): hence 4 streams only. In the engine: bf16 decode at batch
//   1 x1.24 at one thread.
struct WeightPrefetch {
  bool to_l2;
  int64_t lines;
};
constexpr WeightPrefetch kL1Prefetch{false, 32};
const WeightPrefetch kVendorPrefetch = [] {
  __builtin_cpu_init();
  return __builtin_cpu_is("amd") ? WeightPrefetch{true, 16} : kL1Prefetch;
}();
std::atomic<bool> prefetch_to_l2{kVendorPrefetch.to_l2};
std::atomic<int64_t> prefetch_lines{kVendorPrefetch.lines};
// The prefetch of a pass streaming `blocks` blocks at once.
inline WeightPrefetch prefetch_for(int blocks) {
  if (blocks < 4) return kL1Prefetch;
  return {prefetch_to_l2.load(std::memory_order_relaxed), prefetch_lines.load(std::memory_order_relaxed)};
}
// The 64-byte line at p into L1 or L2.
inline void prefetch_ahead(const void* p, bool to_l2) {
  if (to_l2) _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1);
  else _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
}

// bf16 weights in the AVX-512 BF16 build without AMX: each 2 consecutive blocks (a unit; the last block alone where
// the blocks are odd) interleaved line by line, so a pass over a unit reads one sequential stream, where 2 or 4
// blocks side by side were 2 or 4 streams of a few KB each. A bf16 pass takes one unit: 1-4 rows x 2 blocks with the
// vendor's prefetch (AMD: 16 lines into L2), 5-8 rows x 2 blocks with 32 lines into L1 (bf16_span_for has the one
// exception). The same process, old source against new, SmolLM2-135M's 30 layers of weights from memory on huge
// pages, 2-core AMD EPYC (Zen 4, AVX-512 BF16): x1.03-1.16 at 1-4 rows on one thread, x1.14-1.18 at 8, x1.02-1.03
// at 64 and 512; on two threads, where the host's memory moved most, x0.99-1.11 at 1-4 rows and x0.93-1.15 at 8-512
// across runs. (In blocked16, bf16 read 8-13 % fewer bytes a second than fp32 at one row. 4 blocks interleaved read as
// fast at 1-4 rows, but its 8-row passes lost x0.88-0.94; fp32 gained nothing from interleaving.) AMX's tiles read a
// block's lines at a stride of one line: the AMX build keeps blocked16. A block's outputs are the same bits in
// either layout (the same sums in the same order).
#if defined(__AVX512BF16__) && !(defined(__AMX_TILE__) && defined(__AMX_BF16__))
constexpr int64_t kBf16Unit = 2;
#else
constexpr int64_t kBf16Unit = 1;
#endif
// Where the lines of a pass's C bf16 blocks are, in uint16 (a line: 16 outputs x 2 adjacent k): block c's line p at
// at[c] + p step[c] (a pass of 4 blocks in units reads 2 streams; a last block alone has a step of one line).
template <int C>
struct Bf16Lines {
  const uint16_t* at[C];
  int64_t step[C];
};
template <int C>
inline Bf16Lines<C> bf16_lines(const uint16_t* W, int64_t b, int64_t num_blocks, int64_t K) {
  Bf16Lines<C> lines;
  for (int c = 0; c < C; ++c) {
    const int64_t block = b + c, unit = block - block % kBf16Unit;
    lines.at[c] = W + unit * K * kBlock + (block - unit) * 2 * kBlock;
    lines.step[c] = std::min<int64_t>(kBf16Unit, num_blocks - unit) * 2 * kBlock;
  }
  return lines;
}
// The blocks a bf16 pass takes at M rows (converted: the weights made fp32 in registers, fp32 rows). In units: one
// unit a pass, but a converted pass of 3-4 rows takes 2 units (2 streams): its broadcasts of x, one per row and k,
// over one unit's 2 blocks cost it x0.76 / x0.87 on 1 / 2 threads at 4 rows
inline int64_t bf16_span_for(int64_t M, bool converted) {
  if (kBf16Unit == 1) return span_for(M);
  return converted && M > 2 && M <= 4 ? 2 * kBf16Unit : kBf16Unit;
}
// The prefetch of a bf16 pass of R rows x C blocks: in units, a pass of 1-4 rows is bound by the weights' stream.
inline WeightPrefetch bf16_prefetch_for(int R, int C) {
  if (kBf16Unit > 1) return R <= 4 ? prefetch_for(4) : kL1Prefetch;
  return prefetch_for(C);
}

// R rows of x times C adjacent blocks (16 C outputs): R x C x kVecs accumulators, each weight line used R times.
// y (and the residual r added to it, when given) has row stride ldy.
template <int R, int C, typename TY>
void block_f32(const float* w, const float* x, int64_t K, TY* y, int64_t ldy, const TY* res) {
  Vec acc[R][C][kVecs];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      for (int v = 0; v < kVecs; ++v) acc[r][c][v] = vzero();
  const auto [to_l2, ahead] = prefetch_for(C);
  for (int64_t k = 0; k < K; ++k) {
    for (int c = 0; c < C; ++c) prefetch_ahead(w + c * K * kBlock + (k + ahead) * kBlock, to_l2);
    Vec wv[C][kVecs];
    for (int c = 0; c < C; ++c)
      for (int v = 0; v < kVecs; ++v) wv[c][v] = vload(w + c * K * kBlock + k * kBlock + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const Vec xv = vset1(x[r * K + k]);
      for (int c = 0; c < C; ++c)
        for (int v = 0; v < kVecs; ++v) acc[r][c][v] = vfma(wv[c][v], xv, acc[r][c][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      for (int v = 0; v < kVecs; ++v) {
        const int64_t at = r * ldy + c * kBlock + v * kLanes;
        store_out(y + at, acc[r][c][v], res ? res + at : nullptr);
      }
}

// bf16 weights converted to fp32 in registers, fp32 activations x, bf16 or fp32 output y.
template <int R, int C, typename TY>
void block_bf16_converted(const Bf16Lines<C>& w, const float* x, int64_t K, TY* y, int64_t ldy, const TY* res) {
  Vec acc[R][C][kVecs];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      for (int v = 0; v < kVecs; ++v) acc[r][c][v] = vzero();
  const auto [to_l2, ahead] = bf16_prefetch_for(R, C);
  for (int64_t p = 0; p < K / 2; ++p) {
    const uint16_t* at[C];
    for (int c = 0; c < C; ++c) at[c] = w.at[c] + p * w.step[c];
    for (int c = 0; c < C; ++c) prefetch_ahead(at[c] + ahead * 2 * kBlock, to_l2);
    Vec even[C][kVecs], odd[C][kVecs];
    for (int c = 0; c < C; ++c)
      for (int v = 0; v < kVecs; ++v) vload_pairs(at[c] + v * 2 * kLanes, even[c][v], odd[c][v]);
    for (int r = 0; r < R; ++r) {
      const Vec xe = vset1(x[r * K + 2 * p]), xo = vset1(x[r * K + 2 * p + 1]);
      for (int c = 0; c < C; ++c)
        for (int v = 0; v < kVecs; ++v) acc[r][c][v] = vfma(odd[c][v], xo, vfma(even[c][v], xe, acc[r][c][v]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      for (int v = 0; v < kVecs; ++v) {
        const int64_t at = r * ldy + c * kBlock + v * kLanes;
        store_out(y + at, acc[r][c][v], res ? res + at : nullptr);
      }
}

#ifdef __AVX512BF16__
// x: rows of pairs from ready_bf16_rows (row stride K / 2 pairs), as uint16
template <int R, int C>
void block_bf16(const Bf16Lines<C>& w, const uint16_t* x, int64_t K, at::BFloat16* y, int64_t ldy, const at::BFloat16* res) {
  const auto* xp = reinterpret_cast<const uint32_t*>(x);
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const auto [to_l2, ahead] = bf16_prefetch_for(R, C);
  for (int64_t p = 0; p < K / 2; ++p) {
    const uint16_t* at[C];
    for (int c = 0; c < C; ++c) at[c] = w.at[c] + p * w.step[c];
    for (int c = 0; c < C; ++c) prefetch_ahead(at[c] + ahead * 2 * kBlock, to_l2);
    __m512bh wv[C];
    for (int c = 0; c < C; ++c) wv[c] = (__m512bh)_mm512_rol_epi32(_mm512_loadu_si512(at[c]), 16);
    for (int r = 0; r < R; ++r) {
      // x[2p + 1], x[2p] (halves swapped as the weights' are), broadcast to every lane
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(xp[r * (K / 2) + p]));
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], wv[c], xv);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      const int64_t at = r * ldy + c * kBlock;
      store_out(y + at, acc[r][c], res ? res + at : nullptr);
    }
}
#endif

#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
// AMX (Intel Xeon from the 4th generation: -march=native on such a CPU defines __AMX_BF16__). The blocked16 bf16
// layout is already AMX's B-tile layout: 16 consecutive lines of a block (16 outputs x 2 adjacent k each, 64 bytes)
// are one tile of 32 k x 16 outputs, read with a stride of 64 bytes. A tile of x is 16 rows x 32 k of the rows
// themselves (stride K). TDPBF16PS accumulates each output in fp32 over the k pairs as vdpbf16ps does, and the
// result is rounded to bf16 once, so the two paths agree to fp32 rounding in the sums (they are not bit for bit
// equal: a row's bits may differ between a batch served by tiles and one served by vdpbf16ps, as between
// oneDNN and servelab). At few rows the weights' stream is the bound and vdpbf16ps keeps it; from min_amx_rows up the
// tiles serve (4: against vdpbf16ps the tiles measured x0.92-0.99 at 1-2 rows and x1.06-1.31 at 3-4 on a 2-core AMX
// Xeon, the model's four projections; docs/engine.md).
constexpr bool kAmx = true;
std::atomic<int64_t> min_amx_rows{4};

// Linux hands a process the tiles' register state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); asked once per process, for all its threads. A kernel that refuses leaves vdpbf16ps serving.
bool amx_ready() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// Whether M rows of K inputs run on the tiles: enough rows, whole tiles of 32 k, and the process holds the tile state.
inline bool amx_serves(int64_t M, int64_t K) {
  return M >= min_amx_rows.load(std::memory_order_relaxed) && K % 32 == 0 && amx_ready();
}

// Palette 1, the eight tiles 16 rows x 64 bytes: tmm0-3 the fp32 sums of 2 x 2 (16-row, 16-output) tiles, tmm4-5 two
// row tiles of x, tmm6-7 two blocks' weight tiles.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
inline void amx_configure() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
}

// RA x 16 rows of x (bf16, row stride K) against CB adjacent blocks of w over all K (a multiple of 32) -> the fp32
// sums in c (RA x 16 rows of 32 floats; blocks side by side).
template <int RA, int CB>
void amx_block(const uint16_t* w, const uint16_t* x, int64_t K, float* c) {
  _tile_zero(0);
  if constexpr (CB == 2) _tile_zero(1);
  if constexpr (RA == 2) {
    _tile_zero(2);
    if constexpr (CB == 2) _tile_zero(3);
  }
  const int64_t x_stride = K * 2;
  for (int64_t k = 0; k < K; k += 32) {
    _tile_loadd(4, x + k, x_stride);
    if constexpr (RA == 2) _tile_loadd(5, x + 16 * K + k, x_stride);
    _tile_loadd(6, w + k * kBlock, 64);  // lines k/2 .. k/2 + 15 of the block: k * 16 uint16 in
    if constexpr (CB == 2) _tile_loadd(7, w + K * kBlock + k * kBlock, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (CB == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (RA == 2) {
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (CB == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  constexpr int64_t ldc = 2 * kBlock * sizeof(float);
  _tile_stored(0, c, ldc);
  if constexpr (CB == 2) _tile_stored(1, c + kBlock, ldc);
  if constexpr (RA == 2) {
    _tile_stored(2, c + 16 * 2 * kBlock, ldc);
    if constexpr (CB == 2) _tile_stored(3, c + 16 * 2 * kBlock + kBlock, ldc);
  }
}

// The threads the kernels split work over now: a team's (or one, for a thread doing a kernel alone), else torch's.
inline int64_t split_threads() {
  if (current_team != nullptr) return current_team->alone ? 1 : current_team->size;
  return at::get_num_threads();
}

// Parts the tiles split M rows into: the most that divide the threads and keep 128 rows (4 groups of 32) or more
// each; each part's threads split its pairs of blocks. With as many parts as threads, a thread multiplies the rows
// the norm or the activation before it wrote on that thread (they split by rows) and writes the rows they read on it
// after: a 512-token bf16 prefill on the 2-core Xeon ran x1.06 faster at 2 threads than with each thread on every row
// (whose first pass reads half of x from the other core's cache, a tile of strided lines at a time), although each
// thread then reads every weight.
inline int64_t amx_row_parts(int64_t M) {
  const int64_t threads = split_threads(), groups = (M + 31) / 32;
  int64_t parts = 1;
  for (int64_t p = 2; p <= threads; ++p)
    if (threads % p == 0 && groups / p >= 4) parts = p;
  return parts;
}

// Y (M, N) = X (M, K) W^T (+ res) in bf16 on the tiles: the rows in `parts` parts (whole groups of 32), each part's
// pairs of blocks split over its threads; a thread runs every row group of its part against a pair while the pair's
// weights sit in L1 / L2. pair_weights(b, cb, buffer) gives blocks b.. b + cb - 1 in the blocked16 pairs layout, side
// by side: a pointer into a bf16 weight, or (int4) the pair dequantised into `buffer`, the thread's own buffer_bytes.
// A row group meets a pair the same way whatever the parts: the same bits. Rows past the last whole 16 are served
// from a copy of x padded with zero rows.
template <typename PairWeights>
void amx_tiles(const PairWeights& pair_weights, int64_t buffer_bytes, int64_t parts, const uint16_t* X,
               at::BFloat16* Y, const at::BFloat16* res, int64_t M, int64_t K, int64_t num_blocks) {
  const int64_t Mp = (M + 15) / 16 * 16, N = num_blocks * kBlock, pairs = (num_blocks + 1) / 2;
  std::unique_ptr<uint16_t[]> padded;
  if (Mp != M) {  // x's rows, then zero rows to the last whole 16 (each byte written once)
    padded = scratch<uint16_t>(Mp * K);
    std::memcpy(padded.get(), X, M * K * sizeof(uint16_t));
    std::memset(padded.get() + M * K, 0, (Mp - M) * K * sizeof(uint16_t));
    X = padded.get();
  }
  const int64_t groups = (Mp + 31) / 32;
  const int64_t item_bytes = 2 * K * kBlock * static_cast<int64_t>(sizeof(uint16_t)) * (groups / parts);
  // NOTE: items part-major: each thread's contiguous share lies within one part of the rows
  split_for(0, pairs * parts, grain_for(item_bytes), [&](int64_t i0, int64_t i1) {
    amx_configure();
    alignas(64) float c[32 * 2 * kBlock];
    const auto buffer = scratch<uint8_t>(buffer_bytes);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t part = i / pairs, b = 2 * (i % pairs);
      const int cb = static_cast<int>(std::min<int64_t>(2, num_blocks - b));
      const uint16_t* w = pair_weights(b, cb, buffer.get());
      const int64_t m1 = std::min(Mp, (part + 1) * groups / parts * 32);
      for (int64_t m = part * groups / parts * 32; m < m1; m += 32) {
        const int ra = Mp - m >= 32 ? 2 : 1;
        if (ra == 2 && cb == 2) amx_block<2, 2>(w, X + m * K, K, c);
        else if (ra == 2) amx_block<2, 1>(w, X + m * K, K, c);
        else if (cb == 2) amx_block<1, 2>(w, X + m * K, K, c);
        else amx_block<1, 1>(w, X + m * K, K, c);
        const int64_t rows = std::min<int64_t>(32, M - m);
        for (int64_t r = 0; r < rows; ++r)
          for (int j = 0; j < cb; ++j) {
            const int64_t at = (m + r) * N + (b + j) * kBlock;
            store_out(Y + at, vload(c + r * 2 * kBlock + j * kBlock), res ? res + at : nullptr);
          }
      }
    }
    _tile_release();
  });
}

void amx_bf16(const uint16_t* W, const uint16_t* X, at::BFloat16* Y, const at::BFloat16* res, int64_t M, int64_t K,
              int64_t num_blocks) {
  amx_tiles([&](int64_t b, int, uint8_t*) { return W + b * K * kBlock; }, 0, amx_row_parts(M), X, Y, res, M, K,
            num_blocks);
}
#else
constexpr bool kAmx = false;
std::atomic<int64_t> min_amx_rows{0};
inline bool amx_ready() { return false; }
#endif

// fn(rows, blocks) with both as compile-time constants: rows 1..MaxRows (at most 8), blocks 1..4.
template <int MaxRows = kMaxRows, typename Fn>
void dispatch(int rows, int blocks, Fn&& fn) {
  static_assert(MaxRows >= 4 && MaxRows <= 8, "a pass takes 4 to 8 rows");
  auto with_rows = [&](auto b) {
    switch (std::min(rows, MaxRows)) {
      case 1: fn(std::integral_constant<int, 1>{}, b); break;
      case 2: fn(std::integral_constant<int, 2>{}, b); break;
      case 3: fn(std::integral_constant<int, 3>{}, b); break;
      case 4: fn(std::integral_constant<int, 4>{}, b); break;
      case 5: if constexpr (MaxRows >= 5) fn(std::integral_constant<int, 5>{}, b); break;
      case 6: if constexpr (MaxRows >= 6) fn(std::integral_constant<int, 6>{}, b); break;
      case 7: if constexpr (MaxRows >= 7) fn(std::integral_constant<int, 7>{}, b); break;
      default: if constexpr (MaxRows >= 8) fn(std::integral_constant<int, 8>{}, b); break;
    }
  };
  switch (blocks) {
    case 1: with_rows(std::integral_constant<int, 1>{}); break;
    case 2: with_rows(std::integral_constant<int, 2>{}); break;
    case 3: with_rows(std::integral_constant<int, 3>{}); break;
    default: with_rows(std::integral_constant<int, 4>{}); break;
  }
}

// Blocks 0.. num_blocks - 1 split over the threads as evenly as whole blocks allow (whole spans would not: the 9 spans
// of 4 blocks of a 576-output projection go 5 and 4 to 2 threads), each thread's share in passes of up to `span`
// blocks that never cross a multiple of span (int4's quads): fn(first block, blocks). block_bytes: what one block
// costs a thread to stream (the grain). A block's outputs are the same bits in a pass of any width.
template <typename Fn>
void over_blocks(int64_t num_blocks, int64_t span, int64_t block_bytes, Fn&& fn) {
  split_for(0, num_blocks, grain_for(block_bytes), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1;) {
      const int64_t end = std::min(b1, (b / span + 1) * span);
      fn(b, static_cast<int>(end - b));
      b = end;
    }
  });
}

// Every span of blocks once from memory; all rows of x against it while it is in cache: kernel(rows, blocks, first
// block, rows of x, of y, of the residual).
// Rows: the most rows of x one pass takes (a register tile of Rows x the span's blocks); weight_bytes: one weight's.
template <int Rows = kMaxRows, typename TX, typename TY, typename Kernel>
void run_blocks(int64_t weight_bytes, int64_t span, const TX* X, TY* Y, const TY* res, int64_t M, int64_t K,
                int64_t num_blocks, Kernel&& kernel) {
  const int64_t block_bytes = K * kBlock * weight_bytes * ((M + Rows - 1) / Rows);
  over_blocks(num_blocks, span, block_bytes, [&](int64_t b, int blocks) {
    for (int64_t m = 0; m < M; m += Rows) {
      dispatch<Rows>(static_cast<int>(std::min<int64_t>(Rows, M - m)), blocks, [&](auto rows, auto cols) {
        const int64_t at = m * (num_blocks * kBlock) + b * kBlock;
        kernel(rows, cols, b, X + m * K, Y + at, res ? res + at : nullptr);
      });
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
  const int64_t num_blocks = N / kBlock;
  auto blocked = weight.view({num_blocks, kBlock, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();  // (N/16, K/2, 16, 2)
  const int64_t whole = num_blocks - num_blocks % kBf16Unit;  // blocks in whole units
  if (kBf16Unit == 1 || whole == 0) return blocked;
  // each unit's lines interleaved: (units, K/2, kBf16Unit, 32); a last odd block stays as it is; same shape as blocked
  auto units = blocked.slice(0, 0, whole).view({whole / kBf16Unit, kBf16Unit, K / 2, 2 * kBlock}).transpose(1, 2);
  auto interleaved = torch::cat({units.reshape({-1}), blocked.slice(0, whole).reshape({-1})});
  return interleaved.view({num_blocks, K / 2, kBlock, 2});
}

// Rows `ids` of a bf16 weight from pack() (an embedding lookup): ids (n,) int64 -> (n, K) bf16, read from
// either layout.
torch::Tensor bf16_rows(const torch::Tensor& ids, const torch::Tensor& packed) {
  TORCH_CHECK(packed.scalar_type() == torch::kBFloat16 && packed.dim() == 4 && packed.is_contiguous(),
              "bf16_rows: a bf16 weight from pack()");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kLong, "bf16_rows: ids must be a 1-d int64 tensor");
  const int64_t n = ids.size(0), num_blocks = packed.size(0), K = 2 * packed.size(1);
  const auto ids_c = ids.contiguous();
  const int64_t* id = ids_c.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < num_blocks * kBlock, "bf16_rows: id ", id[i], " is not a row of the weight (",
                num_blocks * kBlock, " rows)");
  auto out = torch::empty({n, K}, packed.options());
  const auto* W = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  auto* Y = reinterpret_cast<uint32_t*>(out.data_ptr<at::BFloat16>());  // a k pair of one output: 32 bits
  split_for(0, n, grain_for(K * 2), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const auto lines = bf16_lines<1>(W, id[i] / kBlock, num_blocks, K);
      const uint16_t* at = lines.at[0] + 2 * (id[i] % kBlock);
      for (int64_t p = 0; p < K / 2; ++p) std::memcpy(Y + i * (K / 2) + p, at + p * lines.step[0], sizeof(uint32_t));
    }
  });
  return out;
}

// A residual to add to a matmul's output: (M, N) contiguous, in the output's dtype, or none.
static const void* residual_of(const c10::optional<torch::Tensor>& residual, const torch::Tensor& y, const char* what) {
  if (!residual) return nullptr;
  TORCH_CHECK(residual->sizes() == y.sizes() && residual->scalar_type() == y.scalar_type() && residual->is_contiguous(),
              what, ": the residual must be a contiguous (M, N) tensor in the output's dtype");
  return residual->data_ptr();
}

// Whether bf16 rows meet bf16 weights as fp32 rows in this build (no AVX-512 BF16): converted once, exactly.
constexpr bool kBf16RowsAsFp32 =
#ifdef __AVX512BF16__
    false;
#else
    true;
#endif

// bf16 rows as this build's bf16 kernel reads them (vdpbf16ps's or AMX's rows aside): with AVX-512 BF16, as pairs
// with their halves swapped (x[2i + 1] in the low half, x[2i] in the high one), as block_bf16 broadcasts them;
// without, in fp32 (exact). Made once per projection, by the caller (linear(), or DecodeStack's prepare, split over
// its team), never in a pass: a pass over a unit of 2 blocks has half of blocked16's weight lines to spread each row's
// swap over, and with the swap in every pass 4 rows read x0.86 of blocked16 on one thread (docs/performance.md).
using Bf16Ready = std::conditional_t<kBf16RowsAsFp32, float, uint32_t>;
constexpr int64_t kValuesPerReady = kBf16RowsAsFp32 ? 1 : 2;

// Rows [m0, m1) of x (rows of K values, K even) -> the same rows of out (K / kValuesPerReady each).
inline void ready_bf16_rows(const at::BFloat16* x, int64_t m0, int64_t m1, int64_t K, Bf16Ready* out) {
  const int64_t begin = m0 * K / kValuesPerReady, end = m1 * K / kValuesPerReady;
  for (int64_t i = begin; i < end; ++i) {
    if constexpr (kBf16RowsAsFp32) {
      out[i] = static_cast<float>(x[i]);
    } else {
      uint32_t pair;
      std::memcpy(&pair, x + 2 * i, sizeof(pair));
      out[i] = (pair << 16) | (pair >> 16);
    }
  }
}

// Whether M rows of K inputs against bf16 weights run on AMX tiles (which read the rows as they are).
inline bool bf16_on_tiles(int64_t M, int64_t K) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  return amx_serves(M, K);
#else
  (void)M, (void)K;
  return false;
#endif
}

// fp32 rows xf (M, K) against bf16 weights Wb -> Y (M, N) in fp32 (linear's mixed path) or bf16 (a build without
// AVX-512 BF16), + res as dense_path takes it.
template <typename TY>
void converted_path(const uint16_t* Wb, const float* xf, TY* Y, const TY* res, int64_t M, int64_t K,
                    int64_t num_blocks) {
  const int64_t N = num_blocks * kBlock;
  run_blocks(sizeof(uint16_t), bf16_span_for(M, true), xf, Y, res, M, K, num_blocks,
             [&](auto rows, auto cols, int64_t b, const float* xr, TY* yr, const TY* rr) {
               block_bf16_converted<decltype(rows)::value, decltype(cols)::value>(
                   bf16_lines<decltype(cols)::value>(Wb, b, num_blocks, K), xr, K, yr, N, rr);
             });
}

// Rows X (M, K) in T against W in the blocked16 layout in T's precision -> Y (M, N) (+ res, which may be Y itself:
// each output is read, then written, by the thread that computes it). ready: where T is bf16, X as ready_bf16_rows
// makes it (the caller makes it), or none where bf16_on_tiles said the rows run on AMX tiles; else unused.
template <typename T>
void dense_path(const void* W, const T* X, const Bf16Ready* ready, T* Y, const T* res, int64_t M, int64_t K,
                int64_t num_blocks) {
  const int64_t N = num_blocks * kBlock;
  if constexpr (std::is_same_v<T, float>) {
    const auto* Wf = static_cast<const float*>(W);
    run_blocks<kF32Rows>(sizeof(float), span_for(M), X, Y, res, M, K, num_blocks,
                         [&](auto rows, auto cols, int64_t b, const float* xr, float* yr, const float* rr) {
                           block_f32<decltype(rows)::value, decltype(cols)::value>(Wf + b * K * kBlock, xr, K, yr, N, rr);
                         });
  } else {
    const auto* Wb = static_cast<const uint16_t*>(W);
#ifdef __AVX512BF16__
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (ready == nullptr) {  // NOTE: the caller found that the rows run on the tiles (one reading of the threshold)
      amx_bf16(Wb, reinterpret_cast<const uint16_t*>(X), Y, res, M, K, num_blocks);
      return;
    }
#endif
    run_blocks(sizeof(uint16_t), bf16_span_for(M, false), reinterpret_cast<const uint16_t*>(ready), Y, res, M, K,
               num_blocks,
               [&](auto rows, auto cols, int64_t b, const uint16_t* xr, at::BFloat16* yr, const at::BFloat16* rr) {
                 block_bf16<decltype(rows)::value, decltype(cols)::value>(
                     bf16_lines<decltype(cols)::value>(Wb, b, num_blocks, K), xr, K, yr, N, rr);
               });
#else
    converted_path(Wb, ready, Y, res, M, K, num_blocks);
#endif
  }
}

// x (M, K) contiguous, packed from pack() -> y (M, N) in x's dtype, plus the residual (M, N) when given.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "linear: x must be a contiguous (M, K) tensor");
  const bool mixed = x.scalar_type() == torch::kFloat32 && packed.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(mixed || x.scalar_type() == packed.scalar_type(), "linear: x and weight dtypes differ");
  const int64_t M = x.size(0), K = x.size(1), num_blocks = packed.size(0), N = num_blocks * kBlock;
  TORCH_CHECK(packed.numel() == N * K, "linear: x has K=", K, " but the weight does not");
  auto y = torch::empty({M, N}, x.options());
  const void* res = residual_of(residual, y, "linear");
  if (mixed) {  // bf16 weights, fp32 activations and output: fp32 arithmetic on half the weight bytes
    converted_path(reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), x.data_ptr<float>(),
                   y.data_ptr<float>(), static_cast<const float*>(res), M, K, num_blocks);
    return y;
  }
  if (x.scalar_type() == torch::kFloat32) {
    dense_path<float>(packed.data_ptr(), x.data_ptr<float>(), nullptr, y.data_ptr<float>(),
                      static_cast<const float*>(res), M, K, num_blocks);
    return y;
  }
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "linear: fp32 or bf16 only");
  const auto* X = x.data_ptr<at::BFloat16>();
  std::unique_ptr<Bf16Ready[]> ready;
  if (!bf16_on_tiles(M, K)) {
    ready = scratch<Bf16Ready>(M * K / kValuesPerReady);
    split_for(0, M, grain_for(K * 2), [&](int64_t m0, int64_t m1) { ready_bf16_rows(X, m0, m1, K, ready.get()); });
  }
  dense_path<at::BFloat16>(packed.data_ptr(), X, ready.get(), y.data_ptr<at::BFloat16>(),
                           static_cast<const at::BFloat16*>(res), M, K, num_blocks);
  return y;
}

namespace {

// ---- int4 weights (AWQ: group-wise asymmetric int4 with zero points) ----------------------------------------
// Layout "int4x16": W (N, K) of 4-bit values q becomes (N/16, K/8, 64 bytes): per block of 16 outputs and per
// 8 consecutive k, byte 4 j + t holds q[output j][k0 + t] in its low nibble and q[output j][k0 + 4 + t] in its
// high one (j < 16, t < 4). So one 32-bit lane holds 4 consecutive k of one output: the low nibbles of a
// 64-byte line are 16 lanes x k0..k0+3 and the high nibbles k0+4..k0+7, which is what an integer dot product
// of 4 unsigned bytes against 4 signed ones per lane takes (AVX-512 VNNI vpdpbusd, or vpmaddubsw + vpmaddwd),
// and an AVX2 build reads the same line as two 32-byte halves (outputs 0-7, 8-15). Each 4 consecutive blocks (a
// "quad") are interleaved unit by unit, so the 1-4 blocks a pass reads side by side come as one sequential stream,
// not 4 streams of a few KB each; quad_at() says where a block starts and how far apart its units are. Per
// block and group: the
// 16 outputs' scales s in fp16 (as AWQ stores them) and zero points z as bytes, so that w = s (q - z): 3 bytes
// per output and group (fp32 s and s z took 8, a fifth of what a step read at group 64).
//
// Few rows (decode): each row's activations are quantised per group to int8 (symmetric, d = max|x| / 127),
// and y = sum over groups of s (d sum_k xi q - z d sum_k xi): the integer sums run over the group, the
// weights are read once as a stream. Or (float_activations) the rows stay fp32 and the nibbles are made floats in
// registers for fp32 FMAs (block_int4_float): the same stream, no rounding of x, about 4x the instructions per
// weight byte. Many rows (prefill): the weight is dequantised once to an fp32 tile in the
// blocked16 layout and torch's GEMM (MKL / oneDNN) multiplies every row by it, as an fp32 model's prefill runs:
// the dequantisation is N x K operations against M x N x K for the product (a tile of at most a few MB, freed
// at once). Measured on an AVX-512 EPYC: the earlier register-tiled fp32 pass over per-span tiles made int4
// prefill 2.6x slower than fp32's, where MKL serves fp32.

#if defined(__AVX512F__)
using IVec = __m512i;
inline IVec iload(const void* p) { return _mm512_loadu_si512(p); }
inline IVec iset1(int32_t x) { return _mm512_set1_epi32(x); }
inline IVec izero() { return _mm512_setzero_si512(); }
inline IVec iand(IVec a, IVec b) { return _mm512_and_si512(a, b); }
inline IVec isrl(IVec a, int n) { return _mm512_srli_epi32(a, n); }
inline IVec isll(IVec a, int n) { return _mm512_slli_epi32(a, n); }
// (a & mask) | bits in one instruction (vpternlogd: A & B | C)
inline Vec ibits_as_float(IVec a, IVec mask, IVec bits) { return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(a, mask, bits, 0xEA)); }
constexpr int kFloatRows = 8;  // rows per pass of the fp32-activation int4 path: 8 sums + 8 accumulators
inline Vec itof(IVec a) { return _mm512_cvtepi32_ps(a); }
#ifdef __AVX512VNNI__
inline IVec idot(IVec acc, IVec u8, IVec s8) { return _mm512_dpbusd_epi32(acc, u8, s8); }
inline IVec idot8(IVec acc, IVec b, IVec s8) { return _mm512_dpbusd_epi32(acc, b, s8); }
inline IVec idot2(IVec acc, IVec u8a, IVec s8a, IVec u8b, IVec s8b) { return idot(idot(acc, u8a, s8a), u8b, s8b); }
constexpr int kInt8Offset = 128;
constexpr const char* kInt8Dot = "AVX-512 VNNI vpdpbusd";
#else
inline IVec idot(IVec acc, IVec u8, IVec s8) {
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u8, s8), _mm512_set1_epi16(1)));
}
inline IVec idot2(IVec acc, IVec u8a, IVec s8a, IVec u8b, IVec s8b) {  // both pairs' int16 sums added first (below)
  const IVec pairs = _mm512_add_epi16(_mm512_maddubs_epi16(u8a, s8a), _mm512_maddubs_epi16(u8b, s8b));
  return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
}
inline IVec idot8(IVec acc, IVec b, IVec s8) {  // |q| and s8 with q's sign: both <= 127, no int16 saturation
  const IVec q = _mm512_xor_si512(b, _mm512_set1_epi8(static_cast<char>(0x80)));
  const IVec negated = _mm512_mask_sub_epi8(s8, _mm512_movepi8_mask(q), _mm512_setzero_si512(), s8);
  return idot(acc, _mm512_abs_epi8(q), negated);
}
constexpr int kInt8Offset = 0;
constexpr const char* kInt8Dot = "AVX-512 vpmaddubsw + vpmaddwd";
#endif
#else
using IVec = __m256i;
inline IVec iload(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }
inline IVec iset1(int32_t x) { return _mm256_set1_epi32(x); }
inline IVec izero() { return _mm256_setzero_si256(); }
inline IVec iand(IVec a, IVec b) { return _mm256_and_si256(a, b); }
inline IVec isrl(IVec a, int n) { return _mm256_srli_epi32(a, n); }
inline IVec isll(IVec a, int n) { return _mm256_slli_epi32(a, n); }
inline Vec ibits_as_float(IVec a, IVec mask, IVec bits) { return _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(a, mask), bits)); }
constexpr int kFloatRows = 2;  // 2 rows x 2 blocks: 8 sums + 8 accumulators of the 16 ymm registers
inline Vec itof(IVec a) { return _mm256_cvtepi32_ps(a); }
#ifdef __AVXVNNI__
inline IVec idot(IVec acc, IVec u8, IVec s8) { return _mm256_dpbusd_avx_epi32(acc, u8, s8); }
inline IVec idot8(IVec acc, IVec b, IVec s8) { return _mm256_dpbusd_avx_epi32(acc, b, s8); }
inline IVec idot2(IVec acc, IVec u8a, IVec s8a, IVec u8b, IVec s8b) { return idot(idot(acc, u8a, s8a), u8b, s8b); }
constexpr int kInt8Offset = 128;
constexpr const char* kInt8Dot = "AVX-VNNI vpdpbusd";
#else
// q <= 15 and |xi| <= 127: a pair of products sums to at most 3810, so vpmaddubsw's int16 never saturates.
inline IVec idot(IVec acc, IVec u8, IVec s8) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u8, s8), _mm256_set1_epi16(1)));
}
// Two int4 dot products into one accumulator: vpmaddubsw's pair sums (|.| <= 3810) of both added in int16 (<= 7620,
// exact), then one vpmaddwd + add instead of two: 5 instructions for 6, the same integer sums.
inline IVec idot2(IVec acc, IVec u8a, IVec s8a, IVec u8b, IVec s8b) {
  const IVec pairs = _mm256_add_epi16(_mm256_maddubs_epi16(u8a, s8a), _mm256_maddubs_epi16(u8b, s8b));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
inline IVec idot8(IVec acc, IVec b, IVec s8) {  // |q| and s8 with q's sign: both <= 127, no int16 saturation
  const IVec q = _mm256_xor_si256(b, _mm256_set1_epi8(static_cast<char>(0x80)));
  return idot(acc, _mm256_abs_epi8(q), _mm256_sign_epi8(s8, q));
}
constexpr int kInt8Offset = 0;
constexpr const char* kInt8Dot = "AVX2 vpmaddubsw + vpmaddwd";
#endif
#endif
// idot8: full 8-bit weights stored as b = q + 128 (q in -127..127, i.e. q's bits with the top one flipped) against
// int8 activations: vpdpbusd takes b as it is and the 128 x sum(x) it adds is taken off per group (kInt8Offset);
// vpmaddubsw would saturate at 255 x 127, so without VNNI the product is |q| x (x with q's sign) instead.

constexpr int64_t kUnit = 64;  // bytes per 16 outputs x 8 k
// Blocks per pass: each block takes 2 x kVecs registers of unpacked weights and kVecs integer sums per row.
// The AVX2 build takes a whole quad a pass up to 4 rows, so a pass reads one sequential stream where passes of 1-2
// blocks read every other (or every fourth) 128 bytes of it and came back for the rest; the quad's sums spill from 2
// rows on, and still it streams faster. Measured on a Zen 3 EPYC (AVX2 only; int4_linear over the bundled model's 30
// layers of projections on huge pages, old and new source side by side, with the prefetch below), against 2 blocks
// at 1 row and 1 block above: x1.21-1.30 at 1 row, x1.70-1.89 at 2, x1.15-1.29 at 3-4 (1 and 2 threads). Half
// quads from 5 to 32 rows: x1.10-1.15 at 8, x1.07-1.09 at 16, x1.01-1.08 at 32. One block above, as before: at
// 128-512 rows (a prompt chunk, compute-bound) whole quads ran x0.88-0.97 and half quads x0.97-1.04. The fp32-
// activation path (block_int4_float) gained x1.13-1.46 at every row count, the int8 head x1.24-1.38 at 1 row.
#if defined(__AVX512F__)
inline int64_t int4_span_for(int64_t M) { return M <= 2 ? 4 : M <= 4 ? 2 : 1; }
#else
inline int64_t int4_span_for(int64_t M) { return M <= 4 ? 4 : M <= 32 ? 2 : 1; }
#endif

// Software prefetch of the weights 8 units ahead into L1 where a pass has this many rows, as a unit takes long
// enough there. At 1-2 rows (decode): none in the AVX-512 build, where the hardware prefetcher alone streamed faster
// (on huge pages, one thread, AVX-512 EPYC: 31.8 against 24.4 GB/s at one row); 16 units ahead into L2 in the AVX2
// build on AMD (the Zen 3 EPYC above: with the whole quads, x1.24 at 1 row and 1 thread against none, and 16 units
// x1.0-1.1 over 4 or 8), as the dense kernels' 4-block passes on AMD; none on Intel, not measured. The choice is a
// template argument of the pass (L2): tested inside the unit loop it cost most of the gain (x1.08 for x1.24).
constexpr int kPrefetchRows = 3;
#if defined(__AVX512F__)
constexpr bool kMayPrefetchL2 = false;
#else
constexpr bool kMayPrefetchL2 = true;
#endif

// The prefetch for unit u of a pass of R rows x C blocks (first: its first block's first unit).
template <int R, int C, bool L2>
inline void prefetch_units(const uint8_t* first, int64_t unit_stride, int64_t u) {
  if constexpr (R >= kPrefetchRows) {
    for (int c = 0; c < C; ++c) prefetch_ahead(first + c * kUnit + (u + 8) * unit_stride, false);
  } else if constexpr (L2) {
    for (int c = 0; c < C; ++c) prefetch_ahead(first + c * kUnit + (u + 16) * unit_stride, true);
  }
}

struct QuadAt {  // a block in a quad-interleaved layout: its first unit, and the bytes from one of its units to the next
  const uint8_t* first;
  int64_t unit_stride;
};
inline QuadAt quad_at(const uint8_t* W, int64_t b, int64_t num_blocks, int64_t block_bytes) {
  const int64_t quad = b / 4 * 4;
  return {W + quad * block_bytes + (b - quad) * kUnit, std::min<int64_t>(4, num_blocks - quad) * kUnit};
}

struct Int4Rows {  // the rows of x, quantised per group: xi (M, K) int8, d (M, groups), d * sum(xi) (M, groups)
  const int8_t* xi;
  const float* d;
  const float* dsum;
  int64_t K, groups;
};

// R rows x C adjacent blocks, integer dot products per group. w: the first block's bytes; s, z: its (groups, 16)
// scales and zero points; y and the residual (when given) have row stride ldy.
template <int R, int C, bool L2, typename TY>
void block_int4(QuadAt w, const at::Half* s, const uint8_t* z, const Int4Rows& x, int64_t group, int64_t row0,
                TY* y, int64_t ldy, const TY* res) {
  const int64_t K = x.K, units_per_group = group / 8, block_groups = x.groups * kBlock;
  const IVec low = iset1(0x0F0F0F0F);
  Vec acc[R][C][kVecs];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      for (int v = 0; v < kVecs; ++v) acc[r][c][v] = vzero();
  for (int64_t g = 0; g < x.groups; ++g) {
    IVec dots[R][C][kVecs];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c)
        for (int v = 0; v < kVecs; ++v) dots[r][c][v] = izero();
    for (int64_t u = g * units_per_group; u < (g + 1) * units_per_group; ++u) {
      prefetch_units<R, C, L2>(w.first, w.unit_stride, u);
      IVec lo[C][kVecs], hi[C][kVecs];
      for (int c = 0; c < C; ++c)
        for (int v = 0; v < kVecs; ++v) {
          const IVec raw = iload(w.first + c * kUnit + u * w.unit_stride + v * (kUnit / kVecs));
          lo[c][v] = iand(raw, low);
          hi[c][v] = iand(isrl(raw, 4), low);
        }
      for (int r = 0; r < R; ++r) {
        int32_t first, second;  // xi[k0..k0+3] and xi[k0+4..k0+7], broadcast
        std::memcpy(&first, x.xi + (row0 + r) * K + u * 8, 4);
        std::memcpy(&second, x.xi + (row0 + r) * K + u * 8 + 4, 4);
        const IVec xa = iset1(first), xb = iset1(second);
        for (int c = 0; c < C; ++c)
          for (int v = 0; v < kVecs; ++v) dots[r][c][v] = idot2(dots[r][c][v], lo[c][v], xa, hi[c][v], xb);
      }
    }
    Vec scale[C][kVecs], zero[C][kVecs];
    for (int c = 0; c < C; ++c)
      for (int v = 0; v < kVecs; ++v) {
        const int64_t at = c * block_groups + g * kBlock + v * kLanes;
        scale[c][v] = vload(s + at);
        zero[c][v] = vload_u8(z + at);
      }
    for (int r = 0; r < R; ++r) {
      const Vec d = vset1(x.d[(row0 + r) * x.groups + g]), dsum = vset1(x.dsum[(row0 + r) * x.groups + g]);
      for (int c = 0; c < C; ++c)
        for (int v = 0; v < kVecs; ++v)  // s (d dot - z d sum)
          acc[r][c][v] = vfma(scale[c][v], vfnma(zero[c][v], dsum, vmul(itof(dots[r][c][v]), d)), acc[r][c][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      for (int v = 0; v < kVecs; ++v) {
        const int64_t at = r * ldy + c * kBlock + v * kLanes;
        store_out(y + at, acc[r][c][v], res ? res + at : nullptr);
      }
}

// R rows x C adjacent blocks with fp32 activations, no rounding of x. Each nibble q becomes the float 1 + q / 16
// exactly by moving it under the mantissa of 1.0 (a shift, then a mask-and-or: one vpternlogd on AVX-512), and
// the group's sums t = sum_k x (1 + q / 16) run in fp32 FMAs; then, per group, s (sum x q - z sum x) =
// 16 s t - s (16 + z) sum x. Per 64-byte unit: 8 x (shift, mask-or) shared by the rows and 8 FMAs per row, against
// the integer path's 3 operations and 2 dot products per row: it is compute-bound where that one streams.
// X: the rows (M, K) in fp32; xsum: their per-group sums (M, groups).
template <int T>
inline Vec one_plus_nibble(IVec raw, IVec mask, IVec one) {  // k0 + T: byte T's low nibble (T < 4), byte T - 4's high one
  constexpr int at = (T & 3) * 8 + (T >> 2) * 4;  // the nibble's lowest bit; it goes to bit 19 (mantissa bits 19..22)
  if constexpr (at <= 19) return ibits_as_float(isll(raw, 19 - at), mask, one);
  else return ibits_as_float(isrl(raw, at - 19), mask, one);
}

template <int R, int C, bool L2, typename TY>
void block_int4_float(QuadAt w, const at::Half* s, const uint8_t* z, const float* X, const float* xsum, int64_t K,
                      int64_t groups, int64_t group, int64_t row0, TY* y, int64_t ldy, const TY* res) {
  const int64_t units_per_group = group / 8, block_groups = groups * kBlock;
  const IVec mask = iset1(0x00780000), one = iset1(0x3F800000);
  Vec acc[R][C][kVecs];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      for (int v = 0; v < kVecs; ++v) acc[r][c][v] = vzero();
  for (int64_t g = 0; g < groups; ++g) {
    Vec sums[R][C][kVecs];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c)
        for (int v = 0; v < kVecs; ++v) sums[r][c][v] = vzero();
    for (int64_t u = g * units_per_group; u < (g + 1) * units_per_group; ++u) {
      prefetch_units<R, C, L2>(w.first, w.unit_stride, u);
      for (int c = 0; c < C; ++c)
        for (int v = 0; v < kVecs; ++v) {
          const IVec raw = iload(w.first + c * kUnit + u * w.unit_stride + v * (kUnit / kVecs));
          auto take = [&](auto t) {
            const Vec wt = one_plus_nibble<decltype(t)::value>(raw, mask, one);
            for (int r = 0; r < R; ++r)
              sums[r][c][v] = vfma(wt, vset1(X[(row0 + r) * K + u * 8 + decltype(t)::value]), sums[r][c][v]);
          };
          take(std::integral_constant<int, 0>{}); take(std::integral_constant<int, 1>{});
          take(std::integral_constant<int, 2>{}); take(std::integral_constant<int, 3>{});
          take(std::integral_constant<int, 4>{}); take(std::integral_constant<int, 5>{});
          take(std::integral_constant<int, 6>{}); take(std::integral_constant<int, 7>{});
        }
    }
    for (int c = 0; c < C; ++c)
      for (int v = 0; v < kVecs; ++v) {
        const int64_t at = c * block_groups + g * kBlock + v * kLanes;
        const Vec scale = vload(s + at), sixteen = vset1(16.f);
        const Vec times = vmul(scale, sixteen), offset = vmul(scale, vadd(sixteen, vload_u8(z + at)));  // 16 s, s (16 + z)
        for (int r = 0; r < R; ++r)
          acc[r][c][v] = vfnma(offset, vset1(xsum[(row0 + r) * groups + g]), vfma(times, sums[r][c][v], acc[r][c][v]));
      }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      for (int v = 0; v < kVecs; ++v) {
        const int64_t at = r * ldy + c * kBlock + v * kLanes;
        store_out(y + at, acc[r][c][v], res ? res + at : nullptr);
      }
}

// One block of int4 weights -> (K, 16) fp32 in the blocked16 layout: w = s (q - z).
void dequantize_block(QuadAt w, const at::Half* s, const uint8_t* z, int64_t K, int64_t group, float* out) {
  const IVec low = iset1(0x0F);
  for (int64_t u = 0; u < K / 8; ++u) {
    const int64_t g = u * 8 / group;
    for (int v = 0; v < kVecs; ++v) {
      const IVec raw = iload(w.first + u * w.unit_stride + v * (kUnit / kVecs));
      const Vec scale = vload(s + g * kBlock + v * kLanes), zero = vload_u8(z + g * kBlock + v * kLanes);
      for (int t = 0; t < 4; ++t) {
        const Vec q_lo = itof(iand(isrl(raw, 8 * t), low)), q_hi = itof(iand(isrl(raw, 8 * t + 4), low));
        vstore(out + (u * 8 + t) * kBlock + v * kLanes, vmul(scale, vfnma(zero, vset1(1.f), q_lo)));
        vstore(out + (u * 8 + 4 + t) * kBlock + v * kLanes, vmul(scale, vfnma(zero, vset1(1.f), q_hi)));
      }
    }
  }
}

#if defined(__AVX512F__)
inline float vmax_of(Vec v) { return _mm512_reduce_max_ps(v); }
inline void store_i8(int8_t* p, Vec whole) {  // whole numbers in -127..127 -> kLanes bytes
  _mm_storeu_si128((__m128i*)p, _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(whole)));
}
#else
inline float vmax_of(Vec v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}
inline void store_i8(int8_t* p, Vec whole) {
  const __m256i i = _mm256_cvtps_epi32(whole);
  const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
  _mm_storel_epi64((__m128i*)p, _mm_packs_epi16(w, w));
}
#endif

// One row's group of activations -> int8 (round half to even, as std::nearbyint) with the scalar loop's exact
// results; the step d and d x sum(xi). group % kLanes == 0. At batch 1 the scalar loop took about a tenth of an
// int4 model's decode step (every projection quantises its input).
template <typename T>
inline void quantize_group(const T* xg, int64_t group, int8_t* out, float& d, float& dsum) {
  const Vec sign = vset1(-0.f);
  Vec amax = vzero();
  for (int64_t k = 0; k < group; k += kLanes) amax = vmax(amax, vandnot(sign, vload(xg + k)));
  const float top = vmax_of(amax), inv = top > 0.f ? 127.f / top : 0.f;
  const Vec scale = vset1(inv);
  Vec total = vzero();
  for (int64_t k = 0; k < group; k += kLanes) {
    const Vec q = vround(vmul(vload(xg + k), scale));
    store_i8(out + k, q);
    total = vadd(total, q);  // whole numbers below 2^24: exact in fp32
  }
  d = top / 127.f;
  dsum = d * vsum(total);
}

// Into xi (M, K), d and dsum (M, K / group), which the caller holds.
template <typename T>
Int4Rows quantize_rows_into(const T* X, int64_t M, int64_t K, int64_t group, int8_t* xi, float* d, float* dsum) {
  const int64_t groups = K / group;
  const int64_t grain = grain_for(K * static_cast<int64_t>(sizeof(T)));  // rows per thread
  if (group % kLanes == 0) {
    split_for(0, M, grain, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m)
        for (int64_t g = 0; g < groups; ++g)
          quantize_group(X + m * K + g * group, group, xi + m * K + g * group, d[m * groups + g],
                         dsum[m * groups + g]);
    });
    return Int4Rows{xi, d, dsum, K, groups};
  }
  split_for(0, M, grain, [&](int64_t m0, int64_t m1) {
    std::vector<float> xf(group);
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t g = 0; g < groups; ++g) {
        const T* xg = X + m * K + g * group;
        float amax = 0.f;
        for (int64_t k = 0; k < group; ++k) {
          xf[k] = static_cast<float>(xg[k]);
          amax = std::max(amax, std::fabs(xf[k]));
        }
        const float step = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        int32_t total = 0;
        for (int64_t k = 0; k < group; ++k) {
          const int32_t q = static_cast<int32_t>(std::nearbyint(xf[k] * inv));
          xi[m * K + g * group + k] = static_cast<int8_t>(q);
          total += q;
        }
        d[m * groups + g] = step;
        dsum[m * groups + g] = step * static_cast<float>(total);
      }
  });
  return Int4Rows{xi, d, dsum, K, groups};
}

template <typename T>
Int4Rows quantize_rows(const T* X, int64_t M, int64_t K, int64_t group, std::vector<int8_t>& xi,
                       std::vector<float>& d, std::vector<float>& dsum) {
  xi.resize(M * K);
  d.resize(M * (K / group));
  dsum.resize(M * (K / group));
  return quantize_rows_into(X, M, K, group, xi.data(), d.data(), dsum.data());
}

// Every span of int4_span_for(M) blocks (or the part of one in a thread's share: over_blocks) once from memory,
// `rows_per_pass` rows of x at a time against it while it is in cache: fn(rows, blocks, L2, first block, first row),
// rows, blocks and L2 (the pass prefetches into L2: prefetch_units) as compile-time constants.
// block_bytes: one block's weight bytes (the grain).
template <typename Fn>
void over_spans(int64_t M, int64_t num_blocks, int64_t rows_per_pass, int64_t block_bytes, Fn&& fn) {
  over_blocks(num_blocks, int4_span_for(M), block_bytes * ((M + rows_per_pass - 1) / rows_per_pass),
              [&](int64_t b, int blocks) {
                for (int64_t m = 0; m < M; m += rows_per_pass)
                  dispatch(static_cast<int>(std::min<int64_t>(rows_per_pass, M - m)), blocks, [&](auto r, auto c) {
                    if constexpr (kMayPrefetchL2 && decltype(r)::value < kPrefetchRows) {
                      if (kVendorPrefetch.to_l2) return fn(r, c, std::true_type{}, b, m);
                    }
                    fn(r, c, std::false_type{}, b, m);
                  });
              });
}

// The rows, quantised, against the int4 weight: Y (M, N) (+ res, which may be Y itself: each output is read, then
// written, by the thread that computes it).
template <typename TX>
void int4_quantized_path(const Int4Rows& rows, const uint8_t* W, const at::Half* S, const uint8_t* Z, TX* Y,
                         const TX* res, int64_t M, int64_t K, int64_t num_blocks, int64_t group) {
  const int64_t N = num_blocks * kBlock, block_bytes = K / 8 * kUnit, block_groups = K / group * kBlock;
  over_spans(M, num_blocks, kMaxRows, block_bytes, [&](auto r, auto c, auto l2, int64_t b, int64_t m) {
    const int64_t at = m * N + b * kBlock;
    block_int4<decltype(r)::value, decltype(c)::value, decltype(l2)::value>(
        quad_at(W, b, num_blocks, block_bytes), S + b * block_groups, Z + b * block_groups, rows, group, m, Y + at, N,
        res ? res + at : nullptr);
  });
}

template <typename TX>
void int4_integer_path(const TX* X, const uint8_t* W, const at::Half* S, const uint8_t* Z, TX* Y, const TX* res,
                       int64_t M, int64_t K, int64_t num_blocks, int64_t group) {
  std::vector<int8_t> xi;
  std::vector<float> d, dsum;
  int4_quantized_path(quantize_rows(X, M, K, group, xi, d, dsum), W, S, Z, Y, res, M, K, num_blocks, group);
}

template <typename TX>
void int4_float_path(const TX* X, const uint8_t* W, const at::Half* S, const uint8_t* Z, TX* Y, const TX* res,
                     int64_t M, int64_t K, int64_t num_blocks, int64_t group) {
  const int64_t N = num_blocks * kBlock, block_bytes = K / 8 * kUnit, groups = K / group, block_groups = groups * kBlock;
  std::vector<float> converted, xsum(M * groups, 0.f);
  const float* XF;
  if constexpr (std::is_same_v<TX, float>) {
    XF = X;
  } else {
    converted.resize(M * K);
    XF = converted.data();
  }
  at::parallel_for(0, M, grain_for(K * static_cast<int64_t>(sizeof(TX))), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      if constexpr (!std::is_same_v<TX, float>)
        for (int64_t k = 0; k < K; ++k) converted[m * K + k] = static_cast<float>(X[m * K + k]);
      for (int64_t k = 0; k < K; ++k) xsum[m * groups + k / group] += XF[m * K + k];
    }
  });
  over_spans(M, num_blocks, kFloatRows, block_bytes, [&](auto r, auto c, auto l2, int64_t b, int64_t m) {
    const int64_t at = m * N + b * kBlock;
    block_int4_float<decltype(r)::value, decltype(c)::value, decltype(l2)::value>(
        quad_at(W, b, num_blocks, block_bytes), S + b * block_groups, Z + b * block_groups, XF, xsum.data(), K, groups,
        group, m, Y + at, N, res ? res + at : nullptr);
  });
}

// The whole weight dequantised to fp32 in the blocked16 layout (N/16, K, 16): for many rows, where the matmul's
// arithmetic, not the weight bytes, is the cost, so torch's GEMM (MKL / oneDNN) runs it on the tile.
torch::Tensor dequantize_all(const uint8_t* W, const at::Half* S, const uint8_t* Z, int64_t K, int64_t num_blocks,
                             int64_t group) {
  const int64_t block_bytes = K / 8 * kUnit, block_groups = K / group * kBlock;
  auto tile = torch::empty({num_blocks, K, kBlock}, torch::kFloat32);
  float* T = tile.data_ptr<float>();
  at::parallel_for(0, num_blocks, grain_for(K * kBlock * static_cast<int64_t>(sizeof(float))), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      dequantize_block(quad_at(W, b, num_blocks, block_bytes), S + b * block_groups, Z + b * block_groups, K, group,
                       T + b * K * kBlock);
  });
  return tile;
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// Many bf16 rows on AMX: each thread dequantises the pair of blocks it runs next into its own buffer, to bf16 in the
// blocked16 pairs layout (each weight s (q - z) computed in fp32, as dequantize_all does, then rounded to bf16 once),
// and runs the tiles against it while it sits in L1 / L2 (amx_tiles): no dequantised copy of the whole weight is
// written to memory and read back. As an AWQ prefill on oneDNN / IPEX runs int4 with bf16 activations: the one extra
// rounding is the weight's, 2^-9 of it at most.
void int4_amx(const uint8_t* W, const at::Half* S, const uint8_t* Z, const at::BFloat16* X, at::BFloat16* Y,
              const at::BFloat16* res, int64_t M, int64_t K, int64_t num_blocks, int64_t group) {
  const int64_t block_bytes = K / 8 * kUnit, block_groups = K / group * kBlock;
  const int64_t pairs_bytes = 2 * K * kBlock * static_cast<int64_t>(sizeof(uint16_t));  // two blocks' bf16 lines
  auto dequantise_pair = [&](int64_t b, int cb, uint8_t* buffer) -> const uint16_t* {
    auto* lines = reinterpret_cast<uint16_t*>(buffer);
    auto* t = reinterpret_cast<float*>(buffer + pairs_bytes);  // one block in fp32, (K, 16)
    for (int j = 0; j < cb; ++j) {
      dequantize_block(quad_at(W, b + j, num_blocks, block_bytes), S + (b + j) * block_groups,
                       Z + (b + j) * block_groups, K, group, t);
      uint16_t* out = lines + j * K * kBlock;
      for (int64_t p = 0; p < K / 2; ++p) {  // line p: lane i holds k = 2p (low half) and 2p + 1 (high half) of output i
        // NOTE: round_to_bf16 leaves a lane's bf16 in its high half and zeros in its low one
        const __m512i even = _mm512_castps_si512(round_to_bf16(vload(t + 2 * p * kBlock)));
        const __m512i odd = _mm512_castps_si512(round_to_bf16(vload(t + (2 * p + 1) * kBlock)));
        _mm512_storeu_si512(out + p * 2 * kBlock, _mm512_or_si512(odd, _mm512_srli_epi32(even, 16)));
      }
    }
    return lines;
  };
  // NOTE: the rows in one part: with the rows in parts, each part would dequantise every pair, or read a copy of the
  // whole weight dequantised first (x0.96 at 2 threads in a 512-token prefill on the Xeon, where bf16 weights, with
  // nothing to dequantise, gain x1.06 from the parts)
  amx_tiles(dequantise_pair, pairs_bytes + K * kBlock * static_cast<int64_t>(sizeof(float)), 1,
            reinterpret_cast<const uint16_t*>(X), Y, res, M, K, num_blocks);
}
#endif

// ---- int8 output layer --------------------------------------------------------------------------------------
// Layout "int8x16": W (N, K) quantised per output row (symmetric: s = max|w| / 127, q = round(w / s)) becomes
// (N/16, K/4, 64 bytes), quads interleaved as for int4: byte 4 j + t of a line holds q + 128 of output j, input
// k0 + t; s per output in fp32.
// The activations are quantised per group as for int4, so y = s sum over groups of (d dot - offset d sum(x)).
template <int R, int C, bool L2, typename TY>
void block_int8(QuadAt w, const float* s, const Int4Rows& x, int64_t group, int64_t row0, TY* y, int64_t ldy,
                const TY* res) {
  const int64_t K = x.K, units_per_group = group / 4;
  Vec acc[R][C][kVecs];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      for (int v = 0; v < kVecs; ++v) acc[r][c][v] = vzero();
  for (int64_t g = 0; g < x.groups; ++g) {
    IVec dots[R][C][kVecs];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c)
        for (int v = 0; v < kVecs; ++v) dots[r][c][v] = izero();
    for (int64_t u = g * units_per_group; u < (g + 1) * units_per_group; ++u) {
      prefetch_units<R, C, L2>(w.first, w.unit_stride, u);
      IVec raw[C][kVecs];
      for (int c = 0; c < C; ++c)
        for (int v = 0; v < kVecs; ++v) raw[c][v] = iload(w.first + c * kUnit + u * w.unit_stride + v * (kUnit / kVecs));
      for (int r = 0; r < R; ++r) {
        int32_t four;  // xi[k0..k0+3], broadcast
        std::memcpy(&four, x.xi + (row0 + r) * K + u * 4, 4);
        const IVec xa = iset1(four);
        for (int c = 0; c < C; ++c)
          for (int v = 0; v < kVecs; ++v) dots[r][c][v] = idot8(dots[r][c][v], raw[c][v], xa);
      }
    }
    for (int r = 0; r < R; ++r) {
      const Vec d = vset1(x.d[(row0 + r) * x.groups + g]), offset = vset1(kInt8Offset * x.dsum[(row0 + r) * x.groups + g]);
      for (int c = 0; c < C; ++c)
        for (int v = 0; v < kVecs; ++v) acc[r][c][v] = vadd(acc[r][c][v], vfnma(offset, vset1(1.f), vmul(itof(dots[r][c][v]), d)));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      for (int v = 0; v < kVecs; ++v) {
        const int64_t at = r * ldy + c * kBlock + v * kLanes;
        store_out(y + at, vmul(acc[r][c][v], vload(s + c * kBlock + v * kLanes)), res ? res + at : nullptr);
      }
}

template <typename TX>
void int8_path(const TX* X, const uint8_t* W, const float* S, TX* Y, const TX* res, int64_t M, int64_t K,
               int64_t num_blocks, int64_t group) {
  std::vector<int8_t> xi;
  std::vector<float> d, dsum;
  const Int4Rows rows = quantize_rows(X, M, K, group, xi, d, dsum);
  const int64_t N = num_blocks * kBlock, block_bytes = K / 4 * kUnit;
  over_spans(M, num_blocks, kMaxRows, block_bytes, [&](auto r, auto c, auto l2, int64_t b, int64_t m) {
    const int64_t at = m * N + b * kBlock;
    block_int8<decltype(r)::value, decltype(c)::value, decltype(l2)::value>(
        quad_at(W, b, num_blocks, block_bytes), S + b * kBlock, rows, group, m, Y + at, N, res ? res + at : nullptr);
  });
}

}  // namespace

// (blocks, units, 64) block by block -> the same bytes with each 4 consecutive blocks interleaved unit by unit.
static torch::Tensor interleave_quads(const torch::Tensor& blocks) {
  const int64_t nb = blocks.size(0), full = nb / 4 * 4, units = blocks.size(1);
  std::vector<torch::Tensor> parts;
  if (full) parts.push_back(blocks.slice(0, 0, full).view({full / 4, 4, units, kUnit}).transpose(1, 2).reshape(-1));
  if (full < nb) parts.push_back(blocks.slice(0, full, nb).transpose(0, 1).reshape(-1));
  return torch::cat(parts).view(blocks.sizes());
}

// AWQ's unpacked int4 values q (N, K) uint8 in 0..15, scales (K / group, N) holding fp16 values and zeros (same
// shape, 0..15) -> [weights (N/16, K/8, 64) uint8 with quads interleaved, scales (N/16, K/group, 16) fp16, zeros
// (same) uint8].
// N % 16 == 0, K % group == 0, group % 8 == 0.
std::vector<torch::Tensor> int4_pack(const torch::Tensor& q, const torch::Tensor& scales, const torch::Tensor& zeros,
                                     int64_t group) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kUInt8, "int4_pack: q must be (N, K) uint8");
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(N % kBlock == 0, "int4_pack: N must be a multiple of 16");
  TORCH_CHECK(group > 0 && group % 8 == 0 && K % group == 0, "int4_pack: the group size must divide K and be a multiple of 8");
  TORCH_CHECK(scales.sizes() == zeros.sizes() && scales.size(0) == K / group && scales.size(1) == N,
              "int4_pack: scales and zeros must be (K / group, N)");
  TORCH_CHECK(q.max().item<int>() <= 15, "int4_pack: q holds values above 15");
  const auto half_scales = scales.to(torch::kHalf);
  TORCH_CHECK(half_scales.to(scales.scalar_type()).equal(scales),
              "int4_pack: the scales must be fp16 values (AWQ checkpoints store them in fp16)");
  const auto z = zeros.round();
  TORCH_CHECK(z.equal(zeros) && zeros.min().item<double>() >= 0 && zeros.max().item<double>() <= 15,
              "int4_pack: the zero points must be whole numbers in 0..15");
  // (N/16, 16, K/8, 2, 4) -> (N/16, K/8, 16, 4) with the second 4 k in the high nibble
  const auto blocks = q.contiguous().view({N / kBlock, kBlock, K / 8, 2, 4}).permute({0, 2, 1, 3, 4});
  const auto lo = blocks.select(3, 0), hi = blocks.select(3, 1);
  const auto packed = interleave_quads(lo.bitwise_or(hi.bitwise_left_shift(4)).contiguous().view({N / kBlock, K / 8, kUnit}));
  auto lay = [&](const torch::Tensor& t) { return t.view({K / group, N / kBlock, kBlock}).transpose(0, 1).contiguous(); };
  return {packed, lay(half_scales), lay(z.to(torch::kUInt8))};
}

// x (M, K) fp32 or bf16, weights from int4_pack -> y (M, N) in x's dtype, plus the residual (M, N) when given.
// Up to `int_rows` rows: streamed weights, with integer dot products on int8 activations or (float_activations)
// fp32 FMAs on weights dequantised in registers; more: torch's GEMM on the dequantised tile.
torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                          const torch::Tensor& zeros, int64_t group, int64_t int_rows,
                          const c10::optional<torch::Tensor>& residual, bool float_activations) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "int4_linear: x must be a contiguous (M, K) tensor");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16, "int4_linear: fp32 or bf16 x");
  TORCH_CHECK(scales.scalar_type() == torch::kHalf && zeros.scalar_type() == torch::kUInt8,
              "int4_linear: fp16 scales and uint8 zeros, as int4_pack lays them out");
  const int64_t M = x.size(0), K = x.size(1), num_blocks = packed.size(0), N = num_blocks * kBlock;
  TORCH_CHECK(packed.size(1) * 8 == K && scales.size(1) * group == K, "int4_linear: x has K=", K, " but the weight does not");
  auto y = torch::empty({M, N}, x.options());
  const void* res = residual_of(residual, y, "int4_linear");
  const auto* W = packed.data_ptr<uint8_t>();
  const auto* S = scales.data_ptr<at::Half>();
  const auto* Z = zeros.data_ptr<uint8_t>();
  if (M <= int_rows) {
    auto stream = [&](auto* X, auto* Y) {  // X, Y: x's and y's data in x's dtype
      using T = std::remove_pointer_t<decltype(Y)>;
      if (float_activations) int4_float_path(X, W, S, Z, Y, static_cast<const T*>(res), M, K, num_blocks, group);
      else int4_integer_path(X, W, S, Z, Y, static_cast<const T*>(res), M, K, num_blocks, group);
    };
    if (x.scalar_type() == torch::kBFloat16) stream(x.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>());
    else stream(x.data_ptr<float>(), y.data_ptr<float>());
    return y;
  }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (x.scalar_type() == torch::kBFloat16 && amx_serves(M, K)) {
    int4_amx(W, S, Z, x.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), static_cast<const at::BFloat16*>(res), M, K,
             num_blocks, group);
    return y;
  }
#endif
  // many rows: x @ the dequantised tile, as N/16 products (M, K) x (K, 16) side by side, in fp32; the residual
  // added after the product is rounded to x's dtype, as the unfused add does
  const auto tile = dequantize_all(W, S, Z, K, num_blocks, group);
  auto out = at::matmul(x.to(torch::kFloat32), tile).transpose(0, 1).reshape({M, N}).to(x.scalar_type());
  if (residual) out.add_(*residual);
  return out;
}

// W (N, K) fp32 or bf16, N % 16 == 0, K % 4 == 0 -> [int8 weights (N/16, K/4, 64) uint8 with quads interleaved,
// scales (N/16, 16) fp32].
std::vector<torch::Tensor> int8_pack(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) % kBlock == 0 && weight.size(1) % 4 == 0,
              "int8_pack: weight must be (N, K) with N % 16 == 0 and K % 4 == 0");
  const int64_t N = weight.size(0), K = weight.size(1);
  const auto w = weight.to(torch::kFloat32);
  const auto scales = w.abs().amax(1) / 127.0;  // (N,)
  const auto q = torch::where(scales.unsqueeze(1) > 0, (w / scales.unsqueeze(1)).round(), torch::zeros_like(w))
                     .clamp(-127, 127).to(torch::kInt16).add(128).to(torch::kUInt8);
  const auto packed = interleave_quads(q.view({N / kBlock, kBlock, K / 4, 4}).permute({0, 2, 1, 3}).contiguous().view({N / kBlock, K / 4, kUnit}));
  return {packed, scales.view({N / kBlock, kBlock}).contiguous()};
}

// x (M, K) fp32 or bf16, weights from int8_pack, activations quantised per `group` -> y (M, N) in x's dtype
// (+ residual).
torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                          int64_t group, const c10::optional<torch::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "int8_linear: x must be a contiguous (M, K) tensor");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16, "int8_linear: fp32 or bf16 x");
  const int64_t M = x.size(0), K = x.size(1), num_blocks = packed.size(0), N = num_blocks * kBlock;
  TORCH_CHECK(packed.size(1) * 4 == K && group > 0 && group % 4 == 0 && K % group == 0,
              "int8_linear: x has K=", K, " but the weight does not, or the group does not divide it");
  auto y = torch::empty({M, N}, x.options());
  const void* res = residual_of(residual, y, "int8_linear");
  if (x.scalar_type() == torch::kBFloat16) {
    int8_path(x.data_ptr<at::BFloat16>(), packed.data_ptr<uint8_t>(), scales.data_ptr<float>(), y.data_ptr<at::BFloat16>(),
              static_cast<const at::BFloat16*>(res), M, K, num_blocks, group);
  } else {
    int8_path(x.data_ptr<float>(), packed.data_ptr<uint8_t>(), scales.data_ptr<float>(), y.data_ptr<float>(),
              static_cast<const float*>(res), M, K, num_blocks, group);
  }
  return y;
}

// Rows `ids` of the dequantised int8x16 weight: an embedding lookup from a tied output layer's table. ids (T,) int64
// -> (T, K) fp32, (q - 128) s as the fp32 product, what dequantising the whole table would give at those rows. Each
// row's K / 4 units are 4 bytes at a stride of (blocks in its quad) x 64 (quad_at), gathered in one pass.
torch::Tensor int8_rows(const torch::Tensor& ids, const torch::Tensor& packed, const torch::Tensor& scales) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kInt64, "int8_rows: ids must be a 1-d int64 tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kUnit && packed.is_contiguous() && scales.is_contiguous(),
              "int8_rows: packed must come from int8_pack");
  const int64_t T = ids.size(0), num_blocks = packed.size(0), num_units = packed.size(1), N = num_blocks * kBlock;
  const auto id = ids.contiguous();
  const int64_t* I = id.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(I[t] >= 0 && I[t] < N, "int8_rows: id ", I[t], " is outside the table's ", N, " rows");
  auto out = torch::empty({T, num_units * 4}, torch::kFloat32);
  const uint8_t* W = packed.data_ptr<uint8_t>();
  const float* S = scales.data_ptr<float>();
  float* Y = out.data_ptr<float>();
  at::parallel_for(0, T, grain_for(num_units * kUnit), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = I[t] / kBlock, lane = I[t] % kBlock;
      const QuadAt at = quad_at(W, b, num_blocks, num_units * kUnit);
      const uint8_t* row = at.first + lane * 4;
      const float s = S[I[t]];
      float* y = Y + t * num_units * 4;
      for (int64_t u = 0; u < num_units; ++u)
        for (int j = 0; j < 4; ++j) y[u * 4 + j] = static_cast<float>(static_cast<int>(row[u * at.unit_stride + j]) - 128) * s;
    }
  });
  return out;
}

std::string int8_dot() { return kInt8Dot; }

namespace {

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
      Vec acc = vzero();
      for (int64_t d = 0; d < D; d += kLanes) acc = vfma(vload(qg + d), vload(k + s * s_stride + d), acc);
      sc[s] = vsum(acc) * scale;
      max_score = std::max(max_score, sc[s]);
    }
    float total = 0.f;
    for (int64_t s = 0; s < S; ++s) {
      sc[s] = sc[s] == -INFINITY ? 0.f : std::exp(sc[s] - max_score);
      total += sc[s];
    }
    for (int64_t s = 0; s < S; ++s) sc[s] /= total;
  }
  for (int64_t d = 0; d < D; d += kLanes) {
    Vec acc[16];  // G <= 16 query heads per kv head
    for (int64_t g = 0; g < G; ++g) acc[g] = vzero();
    for (int64_t s = 0; s < S; ++s) {
      const Vec vv = vload(v + s * s_stride + d);
      for (int64_t g = 0; g < G; ++g) acc[g] = vfma(vset1(scores[g * S + s]), vv, acc[g]);
    }
    for (int64_t g = 0; g < G; ++g) vstore(out + g * out_head_stride + d, acc[g]);
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

// Causal attention over a prompt chunk (flash attention's tiling, on the CPU): a work item is kPrefillTokens query
// tokens times the G query heads of one kv head, against the chunk's keys in pieces of kPrefillCols columns with an
// online softmax (a running max and sum per query, the output rescaled when the max grows). Token t of the chunk
// sees the first start + t + 1 columns, so a tile reads only the columns its last token sees and a whole prompt
// costs about half of the full T x S product that SDPA with a mask computes. Scores, softmax and sums in fp32.
constexpr int64_t kPrefillTokens = 16;
constexpr int64_t kPrefillCols = 64;  // a multiple of both builds' lanes
static_assert(kPrefillCols % kLanes == 0, "a chunk of columns is whole vectors");

// The attention tiles' one register tile: c (R rows of C vectors, rows ldc apart) = (Accumulate ? c : 0) +
// a (R rows, lda apart) . b (K rows of C vectors, ldb apart), a's element broadcast against b's row. Scores: a the
// scaled queries (rows of D), b the transposed keys (row d: the columns); values: a the probabilities, b the values.
template <int R, int C, bool Accumulate, typename TB>
inline void tile_fma(const float* a, int64_t lda, const TB* b, int64_t ldb, int64_t K, float* c, int64_t ldc) {
  Vec acc[R][C];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) acc[i][j] = Accumulate ? vload(c + i * ldc + j * kLanes) : vzero();
  for (int64_t k = 0; k < K; ++k) {
    Vec row[C];
    for (int j = 0; j < C; ++j) row[j] = vload(b + k * ldb + j * kLanes);
    for (int i = 0; i < R; ++i) {
      const Vec x = vset1(a[i * lda + k]);
      for (int j = 0; j < C; ++j) acc[i][j] = vfma(x, row[j], acc[i][j]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) vstore(c + i * ldc + j * kLanes, acc[i][j]);
}

// Scores of R query rows (Qf: rows of D, already scaled) against C vectors of columns of the transposed keys
// (kt: row d holds column s at s, rows ldkt apart) -> sc, rows kPrefillCols apart.
template <int R, int C>
inline void score_block(const float* Qf, int64_t D, const float* kt, int64_t ldkt, float* sc) {
  tile_fma<R, C, false>(Qf, D, kt, ldkt, D, sc, kPrefillCols);
}

// acc (R rows of D) += p (R rows, kPrefillCols apart) . v (n rows, ldv apart) over the C vectors of D from the
// pointers given (acc and v already offset to them).
template <int R, int C, typename KV>
inline void value_block(const float* p, int64_t n, const KV* v, int64_t ldv, float* acc, int64_t D) {
  tile_fma<R, C, true>(p, kPrefillCols, v, ldv, n, acc, D);
}

template <int R, typename KV>
inline void value_rows(const float* p, int64_t n, const KV* v, int64_t ldv, float* acc, int64_t D) {
  int64_t d = 0;
  for (; d + 4 * kLanes <= D; d += 4 * kLanes) value_block<R, 4>(p, n, v + d, ldv, acc + d, D);
  for (; d < D; d += kLanes) value_block<R, 1>(p, n, v + d, ldv, acc + d, D);
}

// floats of one thread's buffer for a tile of n query rows of D
inline int64_t prefill_buffer(int64_t n, int64_t D) { return n * (2 * D + kPrefillCols + 2); }

// One tile: tokens t0.. t0 + nt - 1 of the chunk (row i * G + j: token t0 + i, query head j of the group) against the
// kv head's transposed keys KT (D rows of ldkt, zero past the last column) and values v (rows ldv apart).
template <typename Q, typename KV>
void prefill_tile(const Q* q, int64_t q_token_stride, int64_t q_head_stride, const float* KT, int64_t ldkt,
                  const KV* v, int64_t ldv, int64_t D, int64_t G, int64_t t0, int64_t nt, int64_t start, float scale,
                  Q* out, int64_t out_token_stride, float* buf) {
  const int64_t n = nt * G;
  float* Qf = buf;
  float* acc = Qf + n * D;
  float* sc = acc + n * D;
  float* maxes = sc + n * kPrefillCols;
  float* sums = maxes + n;
  for (int64_t i = 0; i < nt; ++i)
    for (int64_t j = 0; j < G; ++j)
      for (int64_t d = 0; d < D; ++d)
        Qf[(i * G + j) * D + d] = static_cast<float>(q[(t0 + i) * q_token_stride + j * q_head_stride + d]) * scale;
  std::fill(acc, acc + n * D, 0.f);
  std::fill(maxes, maxes + n, -INFINITY);
  std::fill(sums, sums + n, 0.f);
  const int64_t seen_first = start + t0 + 1;  // columns the tile's first token sees; its last sees nt - 1 more
  const int64_t columns = seen_first + nt - 1;
  for (int64_t c0 = 0; c0 < columns; c0 += kPrefillCols) {
    const int64_t kc = std::min(kPrefillCols, columns - c0);
    const int64_t width = (kc + kLanes - 1) / kLanes * kLanes;
    const int64_t r0 = std::max<int64_t>(0, c0 - seen_first + 1) * G;  // the first row that sees a column here
    const float* kt = KT + c0;
    int64_t r = r0;
    for (; r + 4 <= n; r += 4) {
      int64_t j = 0;
      for (; j + 2 * kLanes <= width; j += 2 * kLanes) score_block<4, 2>(Qf + r * D, D, kt + j, ldkt, sc + r * kPrefillCols + j);
      for (; j < width; j += kLanes) score_block<4, 1>(Qf + r * D, D, kt + j, ldkt, sc + r * kPrefillCols + j);
    }
    for (; r < n; ++r) {
      int64_t j = 0;
      for (; j + 2 * kLanes <= width; j += 2 * kLanes) score_block<1, 2>(Qf + r * D, D, kt + j, ldkt, sc + r * kPrefillCols + j);
      for (; j < width; j += kLanes) score_block<1, 1>(Qf + r * D, D, kt + j, ldkt, sc + r * kPrefillCols + j);
    }
    for (r = r0; r < n; ++r) {
      float* s = sc + r * kPrefillCols;
      const int64_t valid = std::min(kc, seen_first + r / G - c0);
      Vec top_lanes = vset1(maxes[r]);
      int64_t j = 0;
      for (; j + kLanes <= valid; j += kLanes) top_lanes = vmax(top_lanes, vload(s + j));
      float top = vmaxall(top_lanes);
      for (; j < valid; ++j) top = std::max(top, s[j]);
      Vec total = vzero();
      const Vec shift = vset1(-top);
      for (j = 0; j < width; j += kLanes) vstore(s + j, vexp(vadd(vload(s + j), shift)));
      for (j = valid; j < width; ++j) s[j] = 0.f;
      for (j = 0; j < width; j += kLanes) total = vadd(total, vload(s + j));
      const float alpha = std::exp(maxes[r] - top);  // 0 on the first piece (the max was -inf)
      sums[r] = sums[r] * alpha + vsum(total);
      maxes[r] = top;
      if (alpha != 1.f)
        for (int64_t d = 0; d < D; d += kLanes) vstore(acc + r * D + d, vmul(vload(acc + r * D + d), vset1(alpha)));
    }
    const KV* vc = v + c0 * ldv;
    for (r = r0; r + 2 <= n; r += 2)  // the later row of the two sees at least as many columns
      value_rows<2>(sc + r * kPrefillCols, std::min(kc, seen_first + (r + 1) / G - c0), vc, ldv, acc + r * D, D);
    for (; r < n; ++r) value_rows<1>(sc + r * kPrefillCols, std::min(kc, seen_first + r / G - c0), vc, ldv, acc + r * D, D);
  }
  for (int64_t i = 0; i < nt; ++i)
    for (int64_t j = 0; j < G; ++j) {
      const int64_t r = i * G + j;
      const Vec inv = vset1(1.f / sums[r]);
      Q* o = out + (t0 + i) * out_token_stride + j * D;
      for (int64_t d = 0; d < D; d += kLanes) vstore(o + d, vmul(vload(acc + r * D + d), inv));
    }
}

// The tiles of a chunk's attention: Qp (T, H, D) queries at the strides given, KT (H_kv, D, padded) the keys
// transposed to fp32 (zero past S = start + T), Vp the values at (kv head, column) strides -> Op (T, H x D).
template <typename Q, typename KV>
void prefill_tiles(const Q* Qp, int64_t q_token_stride, int64_t q_head_stride, int64_t T, int64_t H, int64_t H_kv,
                   int64_t D, int64_t start, const float* KT, int64_t padded, const KV* Vp, int64_t v_head_stride,
                   int64_t v_column_stride, float scale, Q* Op) {
  const int64_t G = H / H_kv, S = start + T;
  const int64_t tiles = (T + kPrefillTokens - 1) / kPrefillTokens;
  // NOTE: tiles taken in the order first, last, second, second last, ...: at::parallel_for gives each thread a
  // contiguous range of items, and a causal tile's work grows with its position, so each range gets a fair share
  const int64_t item_bytes = 2 * S * D * static_cast<int64_t>(sizeof(float)) * std::min(T, kPrefillTokens);
  at::parallel_for(0, H_kv * tiles, grain_for(item_bytes), [&](int64_t i0, int64_t i1) {
    std::vector<float> buf(prefill_buffer(kPrefillTokens * G, D));
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t u = i / H_kv, g = i % H_kv;
      const int64_t tile = u % 2 == 0 ? u / 2 : tiles - 1 - u / 2;
      const int64_t t0 = tile * kPrefillTokens, nt = std::min(kPrefillTokens, T - t0);
      prefill_tile(Qp + g * G * q_head_stride, q_token_stride, q_head_stride, KT + g * D * padded, padded,
                   Vp + g * v_head_stride, v_column_stride, D, G, t0, nt, start, scale, Op + g * G * D, H * D,
                   buf.data());
    }
  });
}

inline int64_t prefill_padded(int64_t S) { return (S + kPrefillCols - 1) / kPrefillCols * kPrefillCols; }

// The keys transposed once per call for the score tiles' column vectors: KT (H_kv, D, padded) fp32, zero past S.
// column(h, col, kt) writes column col of kv head h (col < S) as kt[d * padded] for each d (and may gather what
// else it reads there); a thread takes whole pieces of kPrefillCols columns of one head, `column_bytes` each.
template <typename Column>
std::unique_ptr<float[]> transposed_keys(int64_t H_kv, int64_t D, int64_t S, int64_t column_bytes, const Column& column) {
  const int64_t padded = prefill_padded(S), pieces = padded / kPrefillCols;
  auto KT = scratch<float>(H_kv * D * padded);  // every column written: a key or zero
  at::parallel_for(0, H_kv * pieces, grain_for(kPrefillCols * column_bytes), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t h = i / pieces, c0 = (i % pieces) * kPrefillCols;
      float* kt = KT.get() + h * D * padded;
      for (int64_t col = c0; col < c0 + kPrefillCols; ++col) {
        if (col >= S) {
          for (int64_t d = 0; d < D; ++d) kt[d * padded + col] = 0.f;
        } else {
          column(h, col, kt + col);
        }
      }
    }
  });
  return KT;
}

template <typename Q, typename KV>
void prefill_attention_impl(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                            int64_t start, float scale, torch::Tensor& out) {
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), H_kv = keys.size(0), S = keys.size(1);
  const int64_t padded = prefill_padded(S);
  const KV* Kp = keys.data_ptr<KV>();
  const int64_t ks0 = keys.stride(0), ks1 = keys.stride(1);
  const auto KT = transposed_keys(H_kv, D, S, D * sizeof(KV), [&](int64_t g, int64_t s, float* kt) {
    const KV* k = Kp + g * ks0 + s * ks1;
    for (int64_t d = 0; d < D; ++d) kt[d * padded] = static_cast<float>(k[d]);
  });
  prefill_tiles(q.data_ptr<Q>(), q.stride(0), q.stride(1), T, H, H_kv, D, start, KT.get(), padded,
                values.data_ptr<KV>(), values.stride(0), values.stride(1), scale, out.data_ptr<Q>());
}

}  // namespace

// Causal attention of a prompt chunk's T tokens at columns start.. start + T - 1: q (T, H, D) rotated queries
// (strided views are fine, D contiguous), keys and values (H_kv, S, D) with S = start + T, every column the row
// holds in order (its cached prefix, then the chunk) -> (T, H x D) in q's dtype; token t sees columns 0.. start + t.
torch::Tensor prefill_attention(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                                int64_t start, double scale) {
  TORCH_CHECK(q.is_cpu() && keys.is_cpu() && values.is_cpu(), "prefill_attention: CPU tensors");
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 3 && values.sizes() == keys.sizes(), "prefill_attention: shapes");
  TORCH_CHECK(q.size(2) % 16 == 0 && q.size(2) == keys.size(2), "prefill_attention: head_dim must be a multiple of 16");
  TORCH_CHECK(keys.size(0) > 0 && q.size(1) % keys.size(0) == 0, "prefill_attention: heads per kv head");
  TORCH_CHECK(q.stride(2) == 1 && keys.stride(2) == 1 && values.stride(2) == 1, "prefill_attention: head_dim must be contiguous");
  TORCH_CHECK(start >= 0 && keys.size(1) == start + q.size(0),
              "prefill_attention: the keys must be the start columns before the chunk and the chunk's own");
  auto out = torch::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
  if (q.size(0) == 0) return out;
  const auto qt = q.scalar_type(), kt = keys.scalar_type();
  TORCH_CHECK(values.scalar_type() == kt, "prefill_attention: keys and values of one dtype");
  const float s = static_cast<float>(scale);
  if (qt == torch::kFloat32 && kt == torch::kFloat32) prefill_attention_impl<float, float>(q, keys, values, start, s, out);
  else if (qt == torch::kFloat32 && kt == torch::kBFloat16) prefill_attention_impl<float, at::BFloat16>(q, keys, values, start, s, out);
  else if (qt == torch::kBFloat16 && kt == torch::kBFloat16) prefill_attention_impl<at::BFloat16, at::BFloat16>(q, keys, values, start, s, out);
  else if (qt == torch::kBFloat16 && kt == torch::kFloat32) prefill_attention_impl<at::BFloat16, float>(q, keys, values, start, s, out);
  else TORCH_CHECK(false, "prefill_attention: fp32 or bf16 queries and keys");
  return out;
}

namespace {

template <typename T>
inline float rounded(float v) {  // v as an operation in T's dtype leaves it
  if constexpr (std::is_same_v<T, at::BFloat16>) return static_cast<float>(at::BFloat16(v));
  return v;
}

// One head's rotary positions, as transformers' apply_rotary_pos_emb computes them in T's dtype:
// x cos + rotate_half(x) sin, each product and the sum rounded to T. Vectors of kLanes over each half of the head
// (rotate_half: the first half meets -x[d + D/2], the second x[d - D/2]), scalars where a half is not whole vectors.
template <typename T>
inline Vec rounded_vec(Vec v) {  // v as an operation in T's dtype leaves it
  if constexpr (std::is_same_v<T, at::BFloat16>) return round_to_bf16(v);
  return v;
}

template <typename T, typename TO>
void rotate_head(const T* x, const T* cos, const T* sin, int64_t D, TO* out) {
  const int64_t half = D / 2;
  if (half % kLanes == 0) {
    for (int64_t d = 0; d < half; d += kLanes) {
      const Vec lo = vload(x + d), hi = vload(x + d + half);
      for (int part = 0; part < 2; ++part) {
        const int64_t at = d + part * half;
        const Vec own = part == 0 ? lo : hi, other = part == 0 ? vmul(hi, vset1(-1.f)) : lo;
        Vec a = rounded_vec<T>(vmul(own, vload(cos + at))), b = rounded_vec<T>(vmul(other, vload(sin + at)));
        // NOTE: each product rounded before the sum, as torch's separate operations round them: the empty asm
        // keeps the compiler from contracting a + b into one FMA (GCC contracts vector arithmetic too)
        asm("" : "+x"(a), "+x"(b));
        vstore(out + at, rounded_vec<T>(vadd(a, b)));
      }
    }
    return;
  }
  for (int64_t d = 0; d < D; ++d) {
    const float xd = static_cast<float>(x[d]);
    const float other = d < half ? -static_cast<float>(x[d + half]) : static_cast<float>(x[d - half]);
    float a = rounded<T>(xd * static_cast<float>(cos[d])), b = rounded<T>(other * static_cast<float>(sin[d]));
    asm("" : "+x"(a), "+x"(b));  // as above: no contraction
    out[d] = static_cast<TO>(rounded<T>(a + b));
  }
}

// NG heads' value sums over NV vectors of d from d on: out[g][d..] = sum over the S columns, in order, of
// scores[g][s] x v[s][d..] (scores: NG rows of S; out: the first head's, out_head_stride apart)
template <int NG, int NV, typename KV, typename TO>
inline void value_sums(const float* scores, int64_t S, const KV* v0, int64_t block_stride, const int32_t* table,
                       int64_t bs, int64_t D, int64_t d, TO* out, int64_t out_head_stride) {
  Vec acc[NG][NV];
  for (int g = 0; g < NG; ++g)
    for (int v = 0; v < NV; ++v) acc[g][v] = vzero();
  const int64_t num_blocks = (S + bs - 1) / bs;
  for (int64_t j = 0; j < num_blocks; ++j) {
    const KV* vb = v0 + static_cast<int64_t>(table[j]) * block_stride + d;
    const int64_t n = std::min(bs, S - j * bs);
    for (int64_t o = 0; o < n; ++o) {
      Vec vv[NV];
      for (int v = 0; v < NV; ++v) vv[v] = vload(vb + o * D + v * kLanes);
      for (int g = 0; g < NG; ++g) {
        const Vec p = vset1(scores[g * S + j * bs + o]);
        for (int v = 0; v < NV; ++v) acc[g][v] = vfma(p, vv[v], acc[g][v]);
      }
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int v = 0; v < NV; ++v) vstore(out + g * out_head_stride + v * kLanes, acc[g][v]);
}

// One row, one kv head, over a paged cache: as attend_group, column s read from block table[s / bs] at offset
// s % bs (k0, v0: the kv head's columns in block 0; block_stride: elements from one block to the next). Scores and
// value sums run over the columns in attend_group's order; the softmax is vectorised (so the two differ in the last
// bits). An int8 cache (KV int8_t)
// holds a scale per column and kv head (ks0, vs0: the kv head's scales in block 0, scale_stride from one block to
// the next): a score is q . k_int8 times the key's scale, a value row weighs its probability times its scale, so
// the cache is read as it is stored (a quarter of fp32's bytes), never dequantised into a copy.
template <typename Q, typename KV>
void attend_group_paged(const Q* q, int64_t q_head_stride, const KV* k0, const KV* v0, int64_t block_stride,
                        const int32_t* table, int64_t bs, int64_t S, int64_t D, float scale, int64_t G, Q* out,
                        int64_t out_head_stride, float* scores, const float* ks0 = nullptr,
                        const float* vs0 = nullptr, int64_t scale_stride = 0) {
  constexpr bool kInt8 = std::is_same_v<KV, int8_t>;
  const int64_t num_blocks = (S + bs - 1) / bs;
  float maxes[16];  // G <= 16
  // NOTE: keys outer, heads inner: each key is read and widened to fp32 once (into L1), then serves the G query
  // heads, whose queries are widened once too; the products and sums are attend_group's, in its order, so the
  // scores' bits do not change. (Heads outer re-read and re-widened every key and query for each head: 8.8 us for
  // 64 columns of bf16 at 9 heads of 64 over 3 kv heads, one thread, AVX-512 EPYC.)
  alignas(64) float key[kMaxHeadDim];
  alignas(64) float queries[16 * kMaxHeadDim];
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t d = 0; d < D; d += kLanes) vstore(queries + g * D + d, vload(q + g * q_head_stride + d));
    maxes[g] = -INFINITY;
  }
  for (int64_t j = 0; j < num_blocks; ++j) {
    const KV* kb = k0 + static_cast<int64_t>(table[j]) * block_stride;
    const float* ks = kInt8 ? ks0 + static_cast<int64_t>(table[j]) * scale_stride : nullptr;
    const int64_t n = std::min(bs, S - j * bs);
    for (int64_t o = 0; o < n; ++o) {
      const float* k = key;  // an fp32 cache's key as it is, others widened once
      if constexpr (std::is_same_v<KV, float>) k = kb + o * D;
      else
        for (int64_t d = 0; d < D; d += kLanes) vstore(key + d, vload(kb + o * D + d));
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = queries + g * D;
        Vec acc = vzero();
        for (int64_t d = 0; d < D; d += kLanes) acc = vfma(vload(qg + d), vload(k + d), acc);
        float score = vsum(acc) * scale;
        if constexpr (kInt8) score *= ks[o];
        scores[g * S + j * bs + o] = score;
        maxes[g] = std::max(maxes[g], score);
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* sc = scores + g * S;
    const float max_score = maxes[g];
    // NOTE: the exponentials vectorised (vexp, about 1 ulp from std::exp): scalar ones took about as long as the
    // rest of a long row's attention. Lanes summed apart, then together: not attend_group's order, so the two
    // differ in the last bits
    const Vec shift = vset1(-max_score);
    Vec lanes = vzero();
    int64_t s = 0;
    for (; s + kLanes <= S; s += kLanes) {
      const Vec e = vexp(vadd(vload(sc + s), shift));
      vstore(sc + s, e);
      lanes = vadd(lanes, e);
    }
    float total = vsum(lanes);
    for (; s < S; ++s) {
      sc[s] = std::exp(sc[s] - max_score);
      total += sc[s];
    }
    const Vec total_v = vset1(total);
    for (s = 0; s + kLanes <= S; s += kLanes) vstore(sc + s, vdiv(vload(sc + s), total_v));
    for (; s < S; ++s) sc[s] /= total;
  }
  if constexpr (kInt8) {  // each probability times its value row's scale, once for every d below
    for (int64_t j = 0; j < num_blocks; ++j) {
      const float* vs = vs0 + static_cast<int64_t>(table[j]) * scale_stride;
      const int64_t n = std::min(bs, S - j * bs);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t o = 0; o < n; ++o) scores[g * S + j * bs + o] *= vs[o];
    }
  }
  // the value sums in register tiles of up to 4 heads x 4 vectors of d (a tile's accumulators stay in registers, where
  // a runtime count of heads kept them in memory): each value row read once per tile; each sum over the columns in
  // order, as before
  constexpr int kValueAccs = kLanes == 16 ? 16 : 8;
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const int heads = static_cast<int>(std::min<int64_t>(4, G - g0));
    const int vecs = D % (4 * kLanes) == 0 && heads * 4 <= kValueAccs ? 4
                     : D % (2 * kLanes) == 0 && heads * 2 <= kValueAccs ? 2 : 1;
    for (int64_t d = 0; d < D; d += vecs * kLanes)
      dispatch<4>(heads, vecs, [&](auto ng, auto nv) {  // the matmuls' (rows, blocks) dispatch: 1-4 each
        value_sums<decltype(ng)::value, decltype(nv)::value>(scores + g0 * S, S, v0, block_stride, table, bs, D, d,
                                                             out + g0 * out_head_stride + d, out_head_stride);
      });
  }
}

// One head's key or value (D fp32) -> int8 and its scale, symmetric: scale = max |x| / 127, q = x (127 / max |x|)
// rounded half to even (as torch.round; kvcache.py's quantize_heads gives the same bits), all zeros -> scale 0.
inline void quantize_head(const float* x, int64_t D, int8_t* out, float* scale) {
  float top = 0.f;
  for (int64_t d = 0; d < D; ++d) top = std::max(top, std::fabs(x[d]));
  const float inv = top > 0.f ? 127.f / top : 0.f;
  for (int64_t d = 0; d < D; ++d) out[d] = static_cast<int8_t>(std::max(-127.f, std::min(127.f, std::nearbyint(x[d] * inv))));
  *scale = top / 127.f;
}

template <typename Q, typename KV>
void decode_step_attention_impl(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                                const torch::Tensor& positions, torch::Tensor& keys, torch::Tensor& values,
                                const torch::Tensor& lengths, const torch::Tensor& block_table, int64_t H, double scale,
                                torch::Tensor& out, float* key_scales = nullptr, float* value_scales = nullptr) {
  constexpr bool kInt8 = std::is_same_v<KV, int8_t>;
  const int64_t B = qkv.size(0), D = qkv.size(2), H_kv = keys.size(1), G = H / H_kv, bs = keys.size(2);
  const Q* X = qkv.data_ptr<Q>();
  const Q* COS = cos.data_ptr<Q>();
  const Q* SIN = sin.data_ptr<Q>();
  const int64_t* P = positions.data_ptr<int64_t>();
  const int64_t* L = lengths.data_ptr<int64_t>();
  const int32_t* T = block_table.data_ptr<int32_t>();
  const int64_t table_stride = block_table.stride(0);
  KV* Kc = keys.data_ptr<KV>();
  KV* Vc = values.data_ptr<KV>();
  Q* O = out.data_ptr<Q>();
  const int64_t scale_stride = H_kv * bs;  // scales (blocks, H_kv, block_size)
  split_for(0, B * H_kv, 1, [&](int64_t i0, int64_t i1) {
    std::vector<Q> queries(G * D);
    std::vector<float> scores, fresh(kInt8 ? D : 0);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / H_kv, h = i % H_kv, n = L[b];
      const Q* row = X + b * qkv.stride(0);
      const Q* c = COS + P[b] * D;
      const Q* s = SIN + P[b] * D;
      const int32_t* table = T + b * table_stride;
      KV* k0 = Kc + h * keys.stride(1);
      KV* v0 = Vc + h * values.stride(1);
      const int64_t at = static_cast<int64_t>(table[n / bs]) * keys.stride(0) + (n % bs) * D;  // column n
      if constexpr (kInt8) {
        const int64_t at_scale = static_cast<int64_t>(table[n / bs]) * scale_stride + h * bs + n % bs;
        rotate_head(row + (H + h) * D, c, s, D, fresh.data());  // the new key, rotated in Q's rounding
        quantize_head(fresh.data(), D, k0 + at, key_scales + at_scale);
        for (int64_t d = 0; d < D; ++d) fresh[d] = static_cast<float>(row[(H + H_kv + h) * D + d]);
        quantize_head(fresh.data(), D, v0 + at, value_scales + at_scale);
      } else {
        rotate_head(row + (H + h) * D, c, s, D, k0 + at);  // the new key
        for (int64_t d = 0; d < D; ++d) v0[at + d] = static_cast<KV>(static_cast<float>(row[(H + H_kv + h) * D + d]));
      }
      for (int64_t g = 0; g < G; ++g) rotate_head(row + (h * G + g) * D, c, s, D, queries.data() + g * D);
      scores.resize(G * (n + 1));
      if constexpr (kInt8) {
        attend_group_paged(queries.data(), D, static_cast<const KV*>(k0), static_cast<const KV*>(v0), keys.stride(0),
                           table, bs, n + 1, D, static_cast<float>(scale), G, O + b * H * D + h * G * D, D, scores.data(),
                           key_scales + h * bs, value_scales + h * bs, scale_stride);
      } else {
        attend_group_paged(queries.data(), D, static_cast<const KV*>(k0), static_cast<const KV*>(v0), keys.stride(0),
                           table, bs, n + 1, D, static_cast<float>(scale), G, O + b * H * D + h * G * D, D, scores.data());
      }
    }
  });
}

template <typename T>
void silu_mul_impl(const T* X, T* Y, int64_t M, int64_t I) {
  // NOTE: a row's exp costs about 4 times its bytes' worth of streaming, hence the grain of a quarter
  split_for(0, M, grain_for(2 * I * static_cast<int64_t>(sizeof(T)) * 4), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const T* gate = X + m * 2 * I;
      const T* up = gate + I;
      T* y = Y + m * I;
      int64_t i = 0;
      for (; i + kLanes <= I; i += kLanes) {
        const Vec g = vload(gate + i);
        Vec act = vdiv(g, vadd(vset1(1.f), vexp(vmul(g, vset1(-1.f)))));
        if constexpr (std::is_same_v<T, at::BFloat16>) act = round_to_bf16(act);  // silu's output, then the product
        vstore(y + i, vmul(act, vload(up + i)));
      }
      for (; i < I; ++i) {
        const float g = static_cast<float>(gate[i]);
        y[i] = static_cast<T>(rounded<T>(g / (1.f + std::exp(-g))) * static_cast<float>(up[i]));
      }
    }
  });
}

}  // namespace

// One decode step's attention for one layer, fused, over the paged cache: qkv (B, H + 2 H_kv, D), the row's new
// token's queries, key and value side by side as the joined projection gives them; cos, sin (P, D) in qkv's dtype;
// positions, lengths (B,) int64; keys / values: the layer's pool (blocks, H_kv, block_size, D); block_table
// (B, >= blocks a row holds) int32. Each row's key (rotated) and value are written at column lengths[b] (block
// block_table[b][n / block_size], offset n % block_size), then its rotated queries attend over columns
// 0..lengths[b] -> (B, H x D) in qkv's dtype. Rotation as transformers rounds it in qkv's dtype; softmax and sums
// in fp32. An int8 pool comes with key_scales / value_scales (blocks, H_kv, block_size) fp32: the new key and value
// are quantised per kv head as they are written (quantize_head), and read as attend_group_paged says.
static void check_decode_step_attention(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                                        const torch::Tensor& positions, const torch::Tensor& keys,
                                        const torch::Tensor& values, const torch::Tensor& lengths,
                                        const torch::Tensor& block_table, int64_t num_heads,
                                        const c10::optional<torch::Tensor>& key_scales,
                                        const c10::optional<torch::Tensor>& value_scales) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.stride(2) == 1 && qkv.stride(1) == qkv.size(2), "decode_step_attention: qkv (B, heads, D)");
  const int64_t B = qkv.size(0), D = qkv.size(2), H_kv = keys.size(1), bs = keys.size(2);
  TORCH_CHECK(keys.dim() == 4 && values.sizes() == keys.sizes() && keys.strides() == values.strides() && keys.is_contiguous() &&
              keys.size(3) == D && keys.size(2) > 0, "decode_step_attention: pool (blocks, H_kv, block_size, D), contiguous");
  TORCH_CHECK(D % 16 == 0 && num_heads % H_kv == 0 && num_heads / H_kv <= 16 && qkv.size(1) == num_heads + 2 * H_kv,
              "decode_step_attention: heads");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type() && cos.is_contiguous() &&
              sin.is_contiguous() && cos.size(1) == D, "decode_step_attention: cos / sin (P, D) in qkv's dtype");
  TORCH_CHECK(positions.scalar_type() == torch::kLong && lengths.scalar_type() == torch::kLong && positions.numel() == B &&
              lengths.numel() == B && positions.is_contiguous() && lengths.is_contiguous(), "decode_step_attention: positions, lengths (B,) int64");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt && block_table.dim() == 2 && block_table.size(0) >= B &&
              block_table.stride(1) == 1, "decode_step_attention: block_table (B, blocks) int32");
  const bool int8 = keys.scalar_type() == torch::kChar;
  TORCH_CHECK(int8 == key_scales.has_value() && int8 == value_scales.has_value(),
              "decode_step_attention: an int8 pool, and only an int8 pool, comes with key_scales and value_scales");
  TORCH_CHECK(D <= kMaxHeadDim, "decode_step_attention: head_dim is at most ", kMaxHeadDim);
  if (int8) {
    for (const auto* t : {&*key_scales, &*value_scales})
      TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous() && t->dim() == 3 && t->size(0) == keys.size(0) &&
                  t->size(1) == H_kv && t->size(2) == bs, "decode_step_attention: scales (blocks, H_kv, block_size) fp32, contiguous");
  }
  const int32_t* T = block_table.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {  // NOTE: a loop, not tensor reductions: this runs once per layer and step
    const int64_t position = positions.data_ptr<int64_t>()[b], length = lengths.data_ptr<int64_t>()[b];
    TORCH_CHECK(position >= 0 && position < cos.size(0) && length >= 0 && length / bs < block_table.size(1),
                "decode_step_attention: row ", b, " position ", position, " or length ", length, " out of range");
    for (int64_t j = 0; j <= length / bs; ++j) {
      const int32_t block = T[b * block_table.stride(0) + j];
      TORCH_CHECK(block >= 0 && block < keys.size(0), "decode_step_attention: row ", b, " block ", block, " outside the pool");
    }
  }
  const auto qt = qkv.scalar_type(), kt = keys.scalar_type();
  TORCH_CHECK((qt == torch::kFloat32 || qt == torch::kBFloat16) &&
              (kt == torch::kFloat32 || kt == torch::kBFloat16 || kt == torch::kChar),
              "decode_step_attention: fp32 or bf16 queries, an fp32, bf16 or int8 cache");
}

// The attention into out (B, H x D) in qkv's dtype, after check_decode_step_attention: inside a Team too (no check,
// no allocation here).
static void run_decode_step_attention(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                                      const torch::Tensor& positions, torch::Tensor& keys, torch::Tensor& values,
                                      const torch::Tensor& lengths, const torch::Tensor& block_table, int64_t num_heads,
                                      double scale, const c10::optional<torch::Tensor>& key_scales,
                                      const c10::optional<torch::Tensor>& value_scales, torch::Tensor& out) {
  const bool int8 = keys.scalar_type() == torch::kChar;
  const auto qt = qkv.scalar_type(), kt = keys.scalar_type();
  if (qt == torch::kFloat32 && kt == torch::kFloat32) decode_step_attention_impl<float, float>(qkv, cos, sin, positions, keys, values, lengths, block_table, num_heads, scale, out);
  else if (qt == torch::kFloat32 && kt == torch::kBFloat16) decode_step_attention_impl<float, at::BFloat16>(qkv, cos, sin, positions, keys, values, lengths, block_table, num_heads, scale, out);
  else if (qt == torch::kBFloat16 && kt == torch::kBFloat16) decode_step_attention_impl<at::BFloat16, at::BFloat16>(qkv, cos, sin, positions, keys, values, lengths, block_table, num_heads, scale, out);
  else if (qt == torch::kBFloat16 && kt == torch::kFloat32) decode_step_attention_impl<at::BFloat16, float>(qkv, cos, sin, positions, keys, values, lengths, block_table, num_heads, scale, out);
  else if (qt == torch::kFloat32 && int8) decode_step_attention_impl<float, int8_t>(qkv, cos, sin, positions, keys, values, lengths, block_table, num_heads, scale, out, key_scales->data_ptr<float>(), value_scales->data_ptr<float>());
  else if (qt == torch::kBFloat16 && int8) decode_step_attention_impl<at::BFloat16, int8_t>(qkv, cos, sin, positions, keys, values, lengths, block_table, num_heads, scale, out, key_scales->data_ptr<float>(), value_scales->data_ptr<float>());
}

torch::Tensor decode_step_attention(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                                    const torch::Tensor& positions, torch::Tensor& keys, torch::Tensor& values,
                                    const torch::Tensor& lengths, const torch::Tensor& block_table, int64_t num_heads,
                                    double scale, const c10::optional<torch::Tensor>& key_scales = c10::nullopt,
                                    const c10::optional<torch::Tensor>& value_scales = c10::nullopt) {
  check_decode_step_attention(qkv, cos, sin, positions, keys, values, lengths, block_table, num_heads, key_scales,
                              value_scales);
  auto out = torch::empty({qkv.size(0), num_heads * qkv.size(2)}, qkv.options());
  run_decode_step_attention(qkv, cos, sin, positions, keys, values, lengths, block_table, num_heads, scale, key_scales,
                            value_scales, out);
  return out;
}

namespace {

template <typename Q, typename KV>
void prefill_step_attention_impl(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                                 const torch::Tensor& positions, torch::Tensor& keys, torch::Tensor& values,
                                 const torch::Tensor& table, int64_t start, int64_t H, float scale, torch::Tensor& out,
                                 float* key_scales = nullptr, float* value_scales = nullptr) {
  constexpr bool kInt8 = std::is_same_v<KV, int8_t>;
  const int64_t T = qkv.size(0), D = qkv.size(2), H_kv = keys.size(1), bs = keys.size(2), S = start + T;
  const Q* X = qkv.data_ptr<Q>();
  const Q* COS = cos.data_ptr<Q>();
  const Q* SIN = sin.data_ptr<Q>();
  const int64_t* P = positions.data_ptr<int64_t>();
  const int32_t* blocks = table.data_ptr<int32_t>();
  KV* Kc = keys.data_ptr<KV>();
  KV* Vc = values.data_ptr<KV>();
  const int64_t scale_stride = H_kv * bs;  // scales (blocks, H_kv, block_size)
  // 1. each token's rotary positions and its key and value written at its column (as decode_step_attention writes
  // a decode row's: the same rounding, the same int8 quantisation), its queries rotated into a buffer
  auto queries = torch::empty({T, H, D}, qkv.options());
  Q* QB = queries.data_ptr<Q>();
  at::parallel_for(0, T, grain_for((H + 2 * H_kv) * D * static_cast<int64_t>(sizeof(Q)) * 4), [&](int64_t t0, int64_t t1) {
    std::vector<float> fresh(kInt8 ? D : 0);
    for (int64_t t = t0; t < t1; ++t) {
      const Q* row = X + t * qkv.stride(0);
      const Q* c = COS + P[t] * D;
      const Q* s = SIN + P[t] * D;
      const int64_t n = start + t, block = blocks[n / bs];
      for (int64_t h = 0; h < H_kv; ++h) {
        const int64_t at = block * keys.stride(0) + h * keys.stride(1) + (n % bs) * D;
        if constexpr (kInt8) {
          const int64_t at_scale = block * scale_stride + h * bs + n % bs;
          rotate_head(row + (H + h) * D, c, s, D, fresh.data());
          quantize_head(fresh.data(), D, Kc + at, key_scales + at_scale);
          for (int64_t d = 0; d < D; ++d) fresh[d] = static_cast<float>(row[(H + H_kv + h) * D + d]);
          quantize_head(fresh.data(), D, Vc + at, value_scales + at_scale);
        } else {
          rotate_head(row + (H + h) * D, c, s, D, Kc + at);
          for (int64_t d = 0; d < D; ++d) Vc[at + d] = static_cast<KV>(static_cast<float>(row[(H + H_kv + h) * D + d]));
        }
      }
      for (int64_t h = 0; h < H; ++h) rotate_head(row + h * D, c, s, D, QB + (t * H + h) * D);
    }
  });
  // 2. every column the row holds, read through its block table: keys transposed to fp32 (zero past S), values to
  // fp32 (an int8 column times its scale, as cache.read dequantises it)
  const int64_t padded = prefill_padded(S), ks0 = keys.stride(0), ks1 = keys.stride(1);
  const auto V = scratch<float>(H_kv * S * D);  // every column < S written with its key
  const auto KT = transposed_keys(H_kv, D, S, 2 * D * static_cast<int64_t>(sizeof(KV)),
                                                [&](int64_t h, int64_t col, float* kt) {
    const int64_t block = blocks[col / bs], at = block * ks0 + h * ks1 + (col % bs) * D;
    float* v = V.get() + (h * S + col) * D;
    if constexpr (kInt8) {
      const int64_t at_scale = block * scale_stride + h * bs + col % bs;
      const float ks = key_scales[at_scale], vs = value_scales[at_scale];
      for (int64_t d = 0; d < D; ++d) kt[d * padded] = static_cast<float>(Kc[at + d]) * ks;
      for (int64_t d = 0; d < D; ++d) v[d] = static_cast<float>(Vc[at + d]) * vs;
    } else {
      for (int64_t d = 0; d < D; ++d) kt[d * padded] = static_cast<float>(Kc[at + d]);
      for (int64_t d = 0; d < D; ++d) v[d] = static_cast<float>(Vc[at + d]);
    }
  });
  // 3. the tiles, as prefill_attention computes them
  prefill_tiles(QB, H * D, D, T, H, H_kv, D, start, KT.get(), padded, static_cast<const float*>(V.get()), S * D, D,
                scale, out.data_ptr<Q>());
}

}  // namespace

// A prompt chunk's attention for one layer, fused, over the paged cache: qkv (T, H + 2 H_kv, D) the chunk's joined
// projection; cos, sin (P, D) in qkv's dtype; positions (T,) int64; keys / values the layer's pool (blocks, H_kv,
// block_size, D), fp32, bf16 or int8 (with key_scales / value_scales (blocks, H_kv, block_size) fp32); table (n,)
// int32 the row's block table; start: the columns the row holds before the chunk. Each token's key and value are
// written at column start + t (rotated and rounded as decode_step_attention writes them), then the chunk attends
// as prefill_attention does over columns 0.. start + t -> (T, H x D) in qkv's dtype. The columns must be the row's
// positions in order (no evicted blocks).
static void check_prefill_step_attention(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                                         const torch::Tensor& positions, const torch::Tensor& keys,
                                         const torch::Tensor& values, const torch::Tensor& table, int64_t start,
                                         int64_t num_heads, const c10::optional<torch::Tensor>& key_scales,
                                         const c10::optional<torch::Tensor>& value_scales) {
  for (const auto* t : {&qkv, &cos, &sin, &positions, &table, &keys, &values})
    TORCH_CHECK(t->is_cpu(), "prefill_step_attention: CPU tensors");
  TORCH_CHECK(qkv.dim() == 3 && qkv.stride(2) == 1 && qkv.stride(1) == qkv.size(2), "prefill_step_attention: qkv (T, heads, D)");
  const int64_t T = qkv.size(0), D = qkv.size(2);
  TORCH_CHECK(keys.dim() == 4 && values.sizes() == keys.sizes() && keys.strides() == values.strides() &&
              keys.is_contiguous() && keys.size(3) == D && keys.size(2) > 0 && keys.scalar_type() == values.scalar_type(),
              "prefill_step_attention: pool (blocks, H_kv, block_size, D), keys and values alike, contiguous");
  const int64_t H_kv = keys.size(1), bs = keys.size(2);
  TORCH_CHECK(D % 16 == 0 && H_kv > 0 && num_heads % H_kv == 0 && qkv.size(1) == num_heads + 2 * H_kv,
              "prefill_step_attention: heads");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type() && cos.is_contiguous() &&
              sin.is_contiguous() && cos.dim() == 2 && cos.size(1) == D && sin.sizes() == cos.sizes(),
              "prefill_step_attention: cos / sin (P, D) in qkv's dtype");
  TORCH_CHECK(positions.scalar_type() == torch::kLong && positions.dim() == 1 && positions.numel() == T &&
              positions.is_contiguous(), "prefill_step_attention: positions (T,) int64");
  TORCH_CHECK(table.scalar_type() == torch::kInt && table.dim() == 1 && table.is_contiguous(),
              "prefill_step_attention: table (blocks,) int32");
  TORCH_CHECK(start >= 0 && (T == 0 || (start + T - 1) / bs < table.size(0)),
              "prefill_step_attention: the row's table holds fewer blocks than its ", start + T, " columns need");
  const bool int8 = keys.scalar_type() == torch::kChar;
  TORCH_CHECK(int8 == key_scales.has_value() && int8 == value_scales.has_value(),
              "prefill_step_attention: an int8 pool, and only an int8 pool, comes with key_scales and value_scales");
  if (int8)
    for (const auto* t : {&*key_scales, &*value_scales})
      TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous() && t->dim() == 3 && t->size(0) == keys.size(0) &&
                  t->size(1) == H_kv && t->size(2) == bs, "prefill_step_attention: scales (blocks, H_kv, block_size) fp32, contiguous");
  const int32_t* blocks = table.data_ptr<int32_t>();
  for (int64_t j = 0; T > 0 && j <= (start + T - 1) / bs; ++j)
    TORCH_CHECK(blocks[j] >= 0 && blocks[j] < keys.size(0), "prefill_step_attention: block ", blocks[j], " outside the pool");
  const int64_t* P = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(P[t] >= 0 && P[t] < cos.size(0), "prefill_step_attention: position ", P[t], " out of range");
}
// The attention into out (T, H x D) in qkv's dtype (rows of a larger contiguous tensor are fine), after
// check_prefill_step_attention.
static void run_prefill_step_attention(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                                       const torch::Tensor& positions, torch::Tensor& keys, torch::Tensor& values,
                                       const torch::Tensor& table, int64_t start, int64_t num_heads, double scale,
                                       const c10::optional<torch::Tensor>& key_scales,
                                       const c10::optional<torch::Tensor>& value_scales, torch::Tensor& out) {
  if (qkv.size(0) == 0) return;
  const bool int8 = keys.scalar_type() == torch::kChar;
  const auto qt = qkv.scalar_type(), kt = keys.scalar_type();
  const float s = static_cast<float>(scale);
  if (qt == torch::kFloat32 && kt == torch::kFloat32) prefill_step_attention_impl<float, float>(qkv, cos, sin, positions, keys, values, table, start, num_heads, s, out);
  else if (qt == torch::kFloat32 && kt == torch::kBFloat16) prefill_step_attention_impl<float, at::BFloat16>(qkv, cos, sin, positions, keys, values, table, start, num_heads, s, out);
  else if (qt == torch::kBFloat16 && kt == torch::kBFloat16) prefill_step_attention_impl<at::BFloat16, at::BFloat16>(qkv, cos, sin, positions, keys, values, table, start, num_heads, s, out);
  else if (qt == torch::kBFloat16 && kt == torch::kFloat32) prefill_step_attention_impl<at::BFloat16, float>(qkv, cos, sin, positions, keys, values, table, start, num_heads, s, out);
  else if (qt == torch::kFloat32 && int8) prefill_step_attention_impl<float, int8_t>(qkv, cos, sin, positions, keys, values, table, start, num_heads, s, out, key_scales->data_ptr<float>(), value_scales->data_ptr<float>());
  else if (qt == torch::kBFloat16 && int8) prefill_step_attention_impl<at::BFloat16, int8_t>(qkv, cos, sin, positions, keys, values, table, start, num_heads, s, out, key_scales->data_ptr<float>(), value_scales->data_ptr<float>());
  else TORCH_CHECK(false, "prefill_step_attention: fp32 or bf16 queries, an fp32, bf16 or int8 cache");
}
torch::Tensor prefill_step_attention(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                                     const torch::Tensor& positions, torch::Tensor& keys, torch::Tensor& values,
                                     const torch::Tensor& table, int64_t start, int64_t num_heads, double scale,
                                     const c10::optional<torch::Tensor>& key_scales = c10::nullopt,
                                     const c10::optional<torch::Tensor>& value_scales = c10::nullopt) {
  check_prefill_step_attention(qkv, cos, sin, positions, keys, values, table, start, num_heads, key_scales, value_scales);
  auto out = torch::empty({qkv.size(0), num_heads * qkv.size(2)}, qkv.options());
  run_prefill_step_attention(qkv, cos, sin, positions, keys, values, table, start, num_heads, scale, key_scales,
                             value_scales, out);
  return out;
}

// SwiGLU's activation: x (..., 2 I) holding gate and up side by side -> silu(gate) x up (..., I), in x's dtype,
// rounded as transformers' act_fn(gate) * up rounds it.
torch::Tensor silu_mul(const torch::Tensor& x) {
  TORCH_CHECK(x.is_contiguous() && x.size(-1) % 2 == 0, "silu_mul: x (..., 2 I) contiguous");
  const int64_t I = x.size(-1) / 2, M = x.numel() / x.size(-1);
  auto sizes = x.sizes().vec();
  sizes.back() = I;
  auto y = torch::empty(sizes, x.options());
  if (x.scalar_type() == torch::kFloat32) silu_mul_impl(x.data_ptr<float>(), y.data_ptr<float>(), M, I);
  else if (x.scalar_type() == torch::kBFloat16) silu_mul_impl(x.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), M, I);
  else TORCH_CHECK(false, "silu_mul: fp32 or bf16");
  return y;
}

namespace {

template <typename T>
void rms_norm_impl(const torch::Tensor& x, const torch::Tensor& weight, double eps, torch::Tensor& out) {
  const int64_t C = x.size(-1), rows = x.numel() / C;
  const T* X = x.data_ptr<T>();
  const T* W = weight.data_ptr<T>();
  T* Y = out.data_ptr<T>();
  split_for(0, rows, grain_for(2 * C * static_cast<int64_t>(sizeof(T))), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = X + r * C;
      Vec squares = vzero();
      for (int64_t c = 0; c < C; c += kLanes) {
        const Vec v = vload(xr + c);
        squares = vfma(v, v, squares);
      }
      const Vec scale = vset1(1.0f / std::sqrt(vsum(squares) / C + static_cast<float>(eps)));
      for (int64_t c = 0; c < C; c += kLanes) {
        Vec normed = vmul(vload(xr + c), scale);
        if constexpr (std::is_same_v<T, at::BFloat16>) normed = round_to_bf16(normed);  // cast back, then scale
        vstore(Y + r * C + c, vmul(vload(W + c), normed));
      }
    }
  });
}

}  // namespace

// Each row's index of its largest value, the first where several tie: torch.argmax's answer for finite rows.
// x (M, N) fp32 contiguous -> ((M,) int64, how many rows gave -1): a row holding a NaN or an infinity gives -1 (the
// caller asks torch, which orders NaN above all). Two vector passes over the row (the max, then its first lane),
// where torch's CPU argmax compares one value at a time (51 against 10 us for one 49,152-token row of logits on an
// AVX2 EPYC, one thread).
std::tuple<torch::Tensor, int64_t> argmax_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "argmax_rows: x must be a contiguous (M, N) fp32 tensor");
  const int64_t M = x.size(0), N = x.size(1);
  TORCH_CHECK(N > 0, "argmax_rows: rows of no values have no argmax");
  auto out = torch::empty({M}, torch::kInt64);
  const float* X = x.data_ptr<float>();
  int64_t* O = out.data_ptr<int64_t>();
  at::parallel_for(0, M, grain_for(N * static_cast<int64_t>(sizeof(float))), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* r = X + m * N;
      const int64_t body = N / kLanes * kLanes;
      Vec top = vset1(-INFINITY), finite = vzero();  // finite: 0 x each value summed, NaN once one is not finite
      for (int64_t i = 0; i < body; i += kLanes) {
        const Vec v = vload(r + i);
        top = vmax(top, v);
        finite = vadd(finite, vmul(v, vzero()));
      }
      float best = body ? vmaxall(top) : -INFINITY;
      bool ok = !body || vsum(finite) == 0.f;
      for (int64_t i = body; i < N; ++i) {
        ok = ok && std::isfinite(r[i]);
        best = std::max(best, r[i]);
      }
      int64_t at = -1;
      if (ok) {
        for (int64_t i = 0; i < body && at < 0; i += kLanes)
          if (const uint32_t hit = veq_mask(vload(r + i), best)) at = i + __builtin_ctz(hit);
        for (int64_t i = body; i < N && at < 0; ++i)
          if (r[i] == best) at = i;
      }
      O[m] = at;
    }
  });
  int64_t not_finite = 0;
  for (int64_t m = 0; m < M; ++m) not_finite += O[m] < 0;
  return {out, not_finite};
}

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

// A decode step through every layer in one call: per layer the norm, the q/k/v matmul, the fused attention step, o
// with the residual, the norm, gate/up, SwiGLU, down with the residual, as LlamaDecoder's Python loop calls the same
// kernels, without a Python round trip per operation (at batch 1 those cost about as much as the layers' weight
// reads); and a step with prompt chunks beside any decode rows the same way (mixed). The projections are int4
// (int4_pack's layout) or dense in the model's dtype (pack's blocked16 layout). Holds its weights by reference: the
// decoder's own tensors.
class DecodeStack {
 public:
  // int4: packed, scales, zeros, group, int_rows, float_activations; dense: packed, two empty tensors, group 0, the
  // rows up to which the caller serves it through this kernel, false
  using Projection = std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, int64_t, int64_t, bool>;

  DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps)
      : H_(num_heads), H_kv_(num_kv_heads), D_(head_dim), eps_(eps) {}

  void add_layer(const torch::Tensor& attn_norm, const torch::Tensor& mlp_norm, const Projection& qkv,
                 const Projection& o, const Projection& gate_up, const Projection& down) {
    layers_.push_back({attn_norm, mlp_norm, qkv, o, gate_up, down});
  }

  // h (B, C) -> h after every layer; keys / values: each layer's pool (blocks, H_kv, block_size, D), read through
  // block_table (B, blocks) int32; an int8 pool's key_scales / value_scales per layer (none for a float pool).
  torch::Tensor step(torch::Tensor h, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& positions,
                     std::vector<torch::Tensor> keys, std::vector<torch::Tensor> values, const torch::Tensor& lengths,
                     const torch::Tensor& block_table, std::vector<torch::Tensor> key_scales,
                     std::vector<torch::Tensor> value_scales) const {
    TORCH_CHECK(keys.size() == layers_.size() && values.size() == layers_.size(), "DecodeStack: one cache per layer");
    TORCH_CHECK(key_scales.size() == value_scales.size() && (key_scales.empty() || key_scales.size() == layers_.size()),
                "DecodeStack: an int8 cache's scales for every layer, or none");
    const int64_t B = h.size(0);
    const double scale = 1.0 / std::sqrt(static_cast<double>(D_));
    if (fits_team(h)) {
      if (h.scalar_type() == torch::kFloat32)
        return step_team<float>(h, cos, sin, positions, keys, values, lengths, block_table, key_scales, value_scales);
      return step_team<at::BFloat16>(h, cos, sin, positions, keys, values, lengths, block_table, key_scales, value_scales);
    }
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      const auto qkv = apply(layer.qkv, rms_norm(h, layer.attn_norm, eps_), c10::nullopt).view({B, H_ + 2 * H_kv_, D_});
      const auto attended = decode_step_attention(qkv, cos, sin, positions, keys[i], values[i], lengths, block_table,
                                                  H_, scale, scales_of(key_scales, i), scales_of(value_scales, i));
      h = apply(layer.o, attended, h);
      h = apply(layer.down, silu_mul(apply(layer.gate_up, rms_norm(h, layer.mlp_norm, eps_), c10::nullopt)), h);
    }
    return h;
  }

  // A step with prompt chunks, as the decoder's _mixed_hidden runs it where the fused attention serves every row:
  // h (N, C), its first num_decode rows decode rows (lengths and decode_table as step takes them), then each chunk's
  // tokens; chunks: (offset, start, tokens) of each, in row order after the decode rows; chunk_tables: each chunk's
  // row's block table (blocks,) int32. Per layer the same kernels in the same order as that Python loop, each on its
  // own parallel region, without a Python round trip per operation (about 12 ms of a 512-token prefill on a Xeon,
  // at one thread as at two): the same bits.
  torch::Tensor mixed(torch::Tensor h, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& positions,
                      std::vector<torch::Tensor> keys, std::vector<torch::Tensor> values, int64_t num_decode,
                      const torch::Tensor& lengths, const torch::Tensor& decode_table,
                      const std::vector<std::tuple<int64_t, int64_t, int64_t>>& chunks,
                      const std::vector<torch::Tensor>& chunk_tables, std::vector<torch::Tensor> key_scales,
                      std::vector<torch::Tensor> value_scales) const {
    TORCH_CHECK(keys.size() == layers_.size() && values.size() == layers_.size(), "DecodeStack: one cache per layer");
    TORCH_CHECK(key_scales.size() == value_scales.size() && (key_scales.empty() || key_scales.size() == layers_.size()),
                "DecodeStack: an int8 cache's scales for every layer, or none");
    TORCH_CHECK(h.dim() == 2 && positions.dim() == 1 && positions.size(0) == h.size(0) && chunks.size() == chunk_tables.size(),
                "DecodeStack.mixed: h (N, C), positions (N,), a block table per chunk");
    const int64_t N = h.size(0), heads = H_ + 2 * H_kv_;
    int64_t next = num_decode;
    for (const auto& [offset, start, tokens] : chunks) {
      TORCH_CHECK(offset == next && tokens > 0 && start >= 0, "DecodeStack.mixed: chunks (offset, start, tokens) "
                  "follow the decode rows and each other, row by row");
      next += tokens;
    }
    TORCH_CHECK(num_decode >= 0 && next == N, "DecodeStack.mixed: the decode rows and chunks hold ", next, " rows, h ", N);
    const double scale = 1.0 / std::sqrt(static_cast<double>(D_));
    auto attended = torch::empty({N, H_ * D_}, h.options());
    // NOTE: every row's checks before the first layer writes to the cache
    const auto qkv_shape = torch::empty({N, heads, D_}, h.options());
    for (size_t i = 0; i < layers_.size(); ++i) {
      if (num_decode > 0)
        check_decode_step_attention(qkv_shape.narrow(0, 0, num_decode), cos, sin, positions.narrow(0, 0, num_decode),
                                    keys[i], values[i], lengths, decode_table, H_, scales_of(key_scales, i),
                                    scales_of(value_scales, i));
      for (size_t j = 0; j < chunks.size(); ++j) {
        const auto& [offset, start, tokens] = chunks[j];
        check_prefill_step_attention(qkv_shape.narrow(0, offset, tokens), cos, sin, positions.narrow(0, offset, tokens),
                                     keys[i], values[i], chunk_tables[j], start, H_, scales_of(key_scales, i),
                                     scales_of(value_scales, i));
      }
    }
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      const auto qkv = apply(layer.qkv, rms_norm(h, layer.attn_norm, eps_), c10::nullopt).view({N, heads, D_});
      if (num_decode > 0) {
        auto out = attended.narrow(0, 0, num_decode);
        run_decode_step_attention(qkv.narrow(0, 0, num_decode), cos, sin, positions.narrow(0, 0, num_decode), keys[i],
                                  values[i], lengths, decode_table, H_, scale, scales_of(key_scales, i),
                                  scales_of(value_scales, i), out);
      }
      for (size_t j = 0; j < chunks.size(); ++j) {
        const auto& [offset, start, tokens] = chunks[j];
        auto out = attended.narrow(0, offset, tokens);
        run_prefill_step_attention(qkv.narrow(0, offset, tokens), cos, sin, positions.narrow(0, offset, tokens), keys[i],
                                   values[i], chunk_tables[j], start, H_, scale, scales_of(key_scales, i),
                                   scales_of(value_scales, i), out);
      }
      h = apply(layer.o, attended, h);
      h = apply(layer.down, silu_mul(apply(layer.gate_up, rms_norm(h, layer.mlp_norm, eps_), c10::nullopt)), h);
    }
    return h;
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // Whether a step may run as one Team (the default; off: every kernel opens its own parallel region, as the
  // decoder's Python loop does). For tests and benchmarks: both give the same bits.
  void set_team(bool on) { team_ = on; }
  bool team() const { return team_; }
  int64_t team_steps() const { return team_steps_.load(); }  // the steps that ran as one Team

 private:
  struct Layer {
    torch::Tensor attn_norm, mlp_norm;
    Projection qkv, o, gate_up, down;
  };

  // Rows up to which every thread of a team normalises and quantises the rows for itself (no barrier) rather than
  // splitting them (a barrier each time): a row's norm and quantisation take about a microsecond, a barrier as much.
  static constexpr int64_t kRepeatedRows = 2;

  // One Team for the whole step where every projection streams at these rows (int4: with int8 activations, no
  // dequantised tile, whose torch GEMM would run on one thread inside the region; dense: weights in the activations'
  // dtype), the norms are the activations' dtype, and the build has OpenMP.
  bool fits_team(const torch::Tensor& h) const {
#ifndef _OPENMP
    return false;
#else
    if (!team_ || h.dim() != 2 || !h.is_contiguous() ||
        (h.scalar_type() != torch::kFloat32 && h.scalar_type() != torch::kBFloat16))
      return false;
    const int64_t B = h.size(0), C = h.size(1);
    for (const Layer& layer : layers_) {
      for (const auto* norm : {&layer.attn_norm, &layer.mlp_norm})
        if (!norm->is_contiguous() || norm->numel() != C || norm->scalar_type() != h.scalar_type()) return false;
      for (const Projection* p : {&layer.qkv, &layer.o, &layer.gate_up, &layer.down})
        if (std::get<5>(*p) || B > std::get<4>(*p) || (dense(*p) && std::get<0>(*p).scalar_type() != h.scalar_type()))
          return false;
    }
    return C % 16 == 0;
#endif
  }

  // Layer i's int8 cache scales, or none (a float cache).
  static c10::optional<torch::Tensor> scales_of(const std::vector<torch::Tensor>& scales, size_t i) {
    return scales.empty() ? c10::optional<torch::Tensor>() : c10::optional<torch::Tensor>(scales[i]);
  }

  static bool dense(const Projection& p) { return std::get<3>(p) == 0; }

  // A projection's output blocks and inputs (K) as the packed weight holds them.
  static int64_t outputs_of(const Projection& p) { return std::get<0>(p).size(0) * kBlock; }
  static int64_t inputs_of(const Projection& p) {
    return dense(p) ? std::get<0>(p).numel() / outputs_of(p) : std::get<0>(p).size(1) * 8;
  }

  // A projection's input rows as its kernel reads them: int4, quantised per its group; dense bf16, as
  // ready_bf16_rows makes them (unless they run on AMX tiles); else as they are.
  template <typename T>
  struct Rows {
    const T* x;
    const Bf16Ready* ready;
    Int4Rows quantized;
  };

  template <typename T>
  static Rows<T> prepare(const Projection& p, const T* X, int64_t M, int64_t K, int8_t* xi, float* d, float* dsum,
                         Bf16Ready* ready) {
    if (!dense(p)) return {X, nullptr, quantize_rows_into(X, M, K, std::get<3>(p), xi, d, dsum)};
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      if (!bf16_on_tiles(M, K)) {
        split_for(0, M, grain_for(K * static_cast<int64_t>(sizeof(T))),
                  [&](int64_t m0, int64_t m1) { ready_bf16_rows(X, m0, m1, K, ready); });
        return {X, ready, {}};
      }
    }
    return {X, nullptr, {}};
  }

  // y = rows W^T (+ res; res may be y).
  template <typename T>
  static void project(const Projection& p, const Rows<T>& rows, int64_t M, T* y, const T* res) {
    if (dense(p)) {
      dense_path<T>(std::get<0>(p).data_ptr(), rows.x, rows.ready, y, res, M, inputs_of(p), std::get<0>(p).size(0));
      return;
    }
    int4_quantized_path(rows.quantized, std::get<0>(p).data_ptr<uint8_t>(), std::get<1>(p).data_ptr<at::Half>(),
                        std::get<2>(p).data_ptr<uint8_t>(), y, res, M, inputs_of(p), std::get<0>(p).size(0),
                        std::get<3>(p));
  }

  // The step as one parallel region: each kernel splits its items over the team (split_for) and waits at a barrier,
  // into buffers held for the step; the hidden state is updated in place (each residual output read, then written,
  // by the thread that computes it). The same kernels in the same order as the per-kernel path: the same bits.
  template <typename T>
  torch::Tensor step_team(const torch::Tensor& h, const torch::Tensor& cos, const torch::Tensor& sin,
                          const torch::Tensor& positions, std::vector<torch::Tensor>& keys,
                          std::vector<torch::Tensor>& values, const torch::Tensor& lengths,
                          const torch::Tensor& block_table, const std::vector<torch::Tensor>& key_scales,
                          const std::vector<torch::Tensor>& value_scales) const {
    const int64_t B = h.size(0), C = h.size(1), heads = H_ + 2 * H_kv_;
    const double scale = 1.0 / std::sqrt(static_cast<double>(D_));
    team_steps_.fetch_add(1);
    auto hidden = h.clone();
    auto qkv = torch::empty({B, heads, D_}, h.options());
    auto attended = torch::empty({B, H_ * D_}, h.options());
    int64_t widest = std::max(C, H_ * D_), gate_up = 0;
    // NOTE: every check before the region, where a failed TORCH_CHECK would end the process
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      gate_up = std::max(gate_up, outputs_of(layer.gate_up));
      TORCH_CHECK(inputs_of(layer.qkv) == C && outputs_of(layer.qkv) == heads * D_ && inputs_of(layer.o) == H_ * D_ &&
                  outputs_of(layer.o) == C && inputs_of(layer.gate_up) == C && outputs_of(layer.gate_up) % 2 == 0 &&
                  inputs_of(layer.down) * 2 == outputs_of(layer.gate_up) && outputs_of(layer.down) == C,
                  "DecodeStack: layer ", i, "'s projections do not chain");
      for (const Projection* p : {&layer.qkv, &layer.o, &layer.gate_up, &layer.down})
        TORCH_CHECK(dense(*p) ? std::get<0>(*p).scalar_type() == h.scalar_type() && std::get<0>(*p).is_contiguous()
                              : std::get<0>(*p).scalar_type() == torch::kUInt8 && std::get<1>(*p).scalar_type() == torch::kHalf &&
                                std::get<2>(*p).scalar_type() == torch::kUInt8 && std::get<3>(*p) > 0 &&
                                std::get<1>(*p).size(1) * std::get<3>(*p) == inputs_of(*p),
                    "DecodeStack: layer ", i, ": dense weights in the activations' dtype laid out by pack, or int4 ",
                    "as int4_pack lays it out (packed uint8, fp16 scales, uint8 zeros)");
      check_decode_step_attention(qkv, cos, sin, positions, keys[i], values[i], lengths, block_table, H_,
                                  scales_of(key_scales, i), scales_of(value_scales, i));
    }
    widest = std::max(widest, gate_up / 2);
    auto gate_up_out = torch::empty({B, gate_up}, h.options());
    // NOTE: at one or two rows each thread normalises and quantises the rows itself, into its own copies (below)
    const bool repeat_rows = B <= kRepeatedRows;
    const int64_t threads = at::get_num_threads(), copies = repeat_rows ? threads : 1;
    auto act = torch::empty({copies, B, gate_up / 2}, h.options());
    auto normed_copies = torch::empty({copies, B, C}, h.options());
    std::vector<int8_t> xi(copies * B * widest);
    std::vector<float> d(copies * B * widest), dsum(copies * B * widest);  // NOTE: enough for any group size
    const int64_t ready_per_copy = std::is_same_v<T, at::BFloat16> ? (B * widest + 1) / kValuesPerReady : 0;
    const auto ready = scratch<Bf16Ready>(copies * ready_per_copy);
    std::vector<torch::Tensor> normed_views;  // NOTE: made here: no tensor is made inside the region
    for (int64_t c = 0; c < copies; ++c) normed_views.push_back(normed_copies[c]);
    T* H = hidden.data_ptr<T>();
    T* A = attended.data_ptr<T>();
    T* G = gate_up_out.data_ptr<T>();
    T* Q = qkv.data_ptr<T>();
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
#endif
    {
#ifdef _OPENMP
      const Team team{omp_get_thread_num(), omp_get_num_threads()};
#else
      const Team team{0, 1};
#endif
      const Team alone{0, 1, true};
      const int64_t copy = repeat_rows ? team.rank : 0;
      torch::Tensor& normed = normed_views[copy];
      T* N = normed.data_ptr<T>();
      T* S = act.data_ptr<T>() + copy * B * (gate_up / 2);
      int8_t* XI = xi.data() + copy * B * widest;
      float* XD = d.data() + copy * B * widest;
      float* XS = dsum.data() + copy * B * widest;
      Bf16Ready* XR = ready.get() + copy * ready_per_copy;
      // rows -> quantised, split over the team with a barrier after each kernel, or by every thread for itself
      const Team* rows_by = repeat_rows ? &alone : &team;
      current_team = &team;
      for (size_t i = 0; i < layers_.size(); ++i) {
        const Layer& layer = layers_[i];
        const int64_t inner = outputs_of(layer.gate_up) / 2;
        current_team = rows_by;
        rms_norm_impl<T>(hidden, layer.attn_norm, eps_, normed);
        Rows<T> rows = prepare(layer.qkv, N, B, C, XI, XD, XS, XR);
        current_team = &team;
        project(layer.qkv, rows, B, Q, static_cast<const T*>(nullptr));
        run_decode_step_attention(qkv, cos, sin, positions, keys[i], values[i], lengths, block_table, H_, scale,
                                  scales_of(key_scales, i), scales_of(value_scales, i), attended);
        current_team = rows_by;
        rows = prepare(layer.o, A, B, H_ * D_, XI, XD, XS, XR);
        current_team = &team;
        project(layer.o, rows, B, H, H);
        current_team = rows_by;
        rms_norm_impl<T>(hidden, layer.mlp_norm, eps_, normed);
        rows = prepare(layer.gate_up, N, B, C, XI, XD, XS, XR);
        current_team = &team;
        project(layer.gate_up, rows, B, G, static_cast<const T*>(nullptr));
        current_team = rows_by;
        silu_mul_impl(G, S, B, inner);
        rows = prepare(layer.down, S, B, inner, XI, XD, XS, XR);
        current_team = &team;
        project(layer.down, rows, B, H, H);
      }
      current_team = nullptr;
    }
    return hidden;
  }

  static torch::Tensor apply(const Projection& p, const torch::Tensor& x, const c10::optional<torch::Tensor>& residual) {
    if (dense(p)) return ::linear(x, std::get<0>(p), residual);
    return int4_linear(x, std::get<0>(p), std::get<1>(p), std::get<2>(p), std::get<3>(p), std::get<4>(p), residual,
                       std::get<5>(p));
  }

  int64_t H_, H_kv_, D_;
  double eps_;
  std::vector<Layer> layers_;
  bool team_ = true;
  mutable std::atomic<int64_t> team_steps_{0};
};

bool native_bf16() {
#ifdef __AVX512BF16__
  return true;
#else
  return false;
#endif
}

std::string isa() { return kIsa; }

// From how many rows bf16 matmuls run on AMX tiles; 0 where this build or this process has none. rows > 0 sets it
// (a measurement's knob) -> the value before.
int64_t amx_rows(int64_t rows) {
  if (!kAmx || !amx_ready()) return 0;
  return rows > 0 ? min_amx_rows.exchange(rows) : min_amx_rows.load();
}

// Whether at::parallel_for runs on torch's pool in this build (compiled with OpenMP), not on the calling thread alone.
bool parallel() {
#ifdef _OPENMP
  return true;
#else
  return false;
#endif
}

// How many threads at::parallel_for hands work to for `items` items of `item_bytes` each, at torch's thread count
// now: what the kernels' grain gives (a check that a build runs in parallel, and of the grain).
int64_t threads_used(int64_t items, int64_t item_bytes) {
  std::vector<char> seen(std::max(1, at::get_num_threads()), 0);
  at::parallel_for(0, items, grain_for(item_bytes), [&](int64_t, int64_t) { seen[at::get_thread_num()] = 1; });
  int64_t used = 0;
  for (char s : seen) used += s;
  return used;
}

// The dense kernels' weight prefetch: where ("l1" or "l2"; "" keeps it) and how many 64-byte lines ahead (0 keeps
// it) -> the old setting.
std::tuple<std::string, int64_t> weight_prefetch(const std::string& where, int64_t lines) {
  TORCH_CHECK(where.empty() || where == "l1" || where == "l2", "weight_prefetch: where is 'l1' or 'l2', not '", where, "'");
  TORCH_CHECK(lines >= 0 && lines <= 1024, "weight_prefetch: lines ahead from 1 to 1024 (0 keeps them), not ", lines);
  const std::tuple<std::string, int64_t> old{prefetch_to_l2.load() ? "l2" : "l1", prefetch_lines.load()};
  if (!where.empty()) prefetch_to_l2.store(where == "l2");
  if (lines > 0) prefetch_lines.store(lines);
  return old;
}

// The least work in bytes a second thread is woken for; `bytes` >= 0 sets it (a measurement's knob), -1 only reads
// it. -> the value before.
int64_t thread_grain(int64_t bytes) {
  return bytes >= 0 ? min_thread_bytes.exchange(bytes) : min_thread_bytes.load();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "W (N, K) -> the blocked16 layout");
  m.def("linear", &linear, "x (M, K) @ W^T (+ residual) with W in the blocked16 layout", py::arg("x"), py::arg("packed"),
        py::arg("residual") = py::none());
  m.def("bf16_rows", &bf16_rows, "rows ids of a bf16 weight from pack() (an embedding lookup)", py::arg("ids"),
        py::arg("packed"));
  m.def("bf16_unit", [] { return kBf16Unit; }, "how many bf16 blocks pack() interleaves line by line (1: blocked16)");
  m.def("native_bf16", &native_bf16, "whether bf16 runs on AVX-512 BF16 (else: converted to fp32 in registers)");
  m.def("amx_rows", &amx_rows, "from how many rows bf16 matmuls run on AMX tiles (0: none here); rows > 0 sets it -> the old value",
        py::arg("rows") = 0);
  m.def("isa", &isa, "the instruction set this build was compiled for: avx512 or avx2");
  m.def("parallel", &parallel, "whether the kernels run on torch's thread pool (built with OpenMP)");
  m.def("threads_used", &threads_used, "threads the kernels' grain gives `items` items of `item_bytes` each, now",
        py::arg("items"), py::arg("item_bytes"));
  m.def("weight_prefetch", &weight_prefetch, "the dense matmuls' weight prefetch: where ('l1', 'l2'; '' keeps it) and "
        "lines ahead (0 keeps them) -> the old (where, lines)", py::arg("where") = "", py::arg("lines") = 0);
  m.def("thread_grain", &thread_grain, "the least bytes of work a thread is woken for; bytes >= 0 sets it -> the old value",
        py::arg("bytes") = -1);
  m.def("int4_pack", &int4_pack, "AWQ int4 values, scales and zeros -> the int4x16 layout");
  m.def("int4_linear", &int4_linear, "x (M, K) @ W^T (+ residual) with int4 W in the int4x16 layout", py::arg("x"),
        py::arg("packed"), py::arg("scales"), py::arg("zeros"), py::arg("group"), py::arg("int_rows"),
        py::arg("residual") = py::none(), py::arg("float_activations") = false);
  m.def("int8_dot", &int8_dot, "the integer dot product this build's int4 and int8 kernels use");
  m.def("int8_pack", &int8_pack, "W (N, K) -> int8 per output row, the int8x16 layout");
  m.def("int8_rows", &int8_rows, "rows ids of the dequantised int8x16 weight (an embedding lookup)", py::arg("ids"),
        py::arg("packed"), py::arg("scales"));
  m.def("int8_linear", &int8_linear, "x (M, K) @ W^T (+ residual) with int8 W in the int8x16 layout", py::arg("x"),
        py::arg("packed"), py::arg("scales"), py::arg("group"), py::arg("residual") = py::none());
  m.def("argmax_rows", &argmax_rows, "each row's first index of its largest value (-1: a row with NaN or inf), and how many gave -1");
  m.def("rms_norm", &rms_norm, "transformers' LlamaRMSNorm, in one pass");
  m.def("decode_attention", &decode_attention, "one query per row against the KV cache (grouped heads)");
  m.def("prefill_attention", &prefill_attention, "a prompt chunk's causal attention over its row's columns",
        py::arg("q"), py::arg("keys"), py::arg("values"), py::arg("start"), py::arg("scale"));
  m.def("decode_step_attention", &decode_step_attention,
        "a decode step's rotary positions, cache write and attention for one layer over the paged cache, fused",
        py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("positions"), py::arg("keys"), py::arg("values"),
        py::arg("lengths"), py::arg("block_table"), py::arg("num_heads"), py::arg("scale"),
        py::arg("key_scales") = py::none(), py::arg("value_scales") = py::none());
  m.def("prefill_step_attention", &prefill_step_attention,
        "a prompt chunk's rotary positions, cache writes and causal attention for one layer over the paged cache, fused",
        py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("positions"), py::arg("keys"), py::arg("values"),
        py::arg("table"), py::arg("start"), py::arg("num_heads"), py::arg("scale"),
        py::arg("key_scales") = py::none(), py::arg("value_scales") = py::none());
  m.def("silu_mul", &silu_mul, "silu(gate) * up of SwiGLU, gate and up side by side");
  py::class_<DecodeStack>(m, "DecodeStack", py::module_local())
      .def(py::init<int64_t, int64_t, int64_t, double>())
      .def("add_layer", &DecodeStack::add_layer)
      .def_property("team", &DecodeStack::team, &DecodeStack::set_team)
      .def_property_readonly("team_steps", &DecodeStack::team_steps)
      .def("step", &DecodeStack::step, py::arg("h"), py::arg("cos"), py::arg("sin"), py::arg("positions"),
           py::arg("keys"), py::arg("values"), py::arg("lengths"), py::arg("block_table"),
           py::arg("key_scales") = std::vector<torch::Tensor>(), py::arg("value_scales") = std::vector<torch::Tensor>())
      .def("mixed", &DecodeStack::mixed, py::arg("h"), py::arg("cos"), py::arg("sin"), py::arg("positions"),
           py::arg("keys"), py::arg("values"), py::arg("num_decode"), py::arg("lengths"), py::arg("decode_table"),
           py::arg("chunks"), py::arg("chunk_tables"), py::arg("key_scales") = std::vector<torch::Tensor>(),
           py::arg("value_scales") = std::vector<torch::Tensor>())
      .def("num_layers", &DecodeStack::num_layers);
}

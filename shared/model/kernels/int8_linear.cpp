// The W8A8 linear of shared/model/quant.py as one CPU operator: per-row quantisation (after an
// exact integer Hadamard rotation), an AVX-512 VNNI int8 matrix product and the float rescale.
//
// Why: at a decode batch of 16 rows the torch path spends more time in its ~18 small ops per
// linear (abs, amax, div, round, the rotation, casts, rescale) and in oneDNN's unpacked
// `_int_mm` than the int8 arithmetic needs. Here each row is quantised in one pass over it, the
// weights are packed once for `vpdpbusd`, and the product is rescaled as it leaves the registers.
//
// Exactness: the result is bit-identical to quant.py's torch path. Every float operation is the
// same IEEE operation in the same order (x / scale, round half to even, float(acc) * row_scale *
// weight_scale + bias; no fused multiply-add: built with -ffp-contract=off), the rotation runs on
// integers, and the product accumulates exactly in int32. So a row's output still does not depend
// on the other rows of its batch, and the split engine equals the unsplit forward.
//
// vpdpbusd multiplies unsigned by signed bytes and can broadcast only its signed operand from
// memory: weights are packed as unsigned bytes w + 128, a row's four int8 codes are the broadcast
// operand, and the product is corrected by 128 * (the row's sum of codes), exactly.

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "aflex_kernels.h"

namespace {

constexpr int64_t kPanel = 64;  // output columns per packed panel: 4 zmm registers of 16 int32
constexpr int64_t kGroup = 4;   // k values per vpdpbusd lane
constexpr int kTileRows = 6;    // rows per micro-tile: 6 x 4 accumulators + 4 weight registers
constexpr float kInt8Max = 127.0f;
constexpr float kInt16Max = 32767.0f;
constexpr float kMinScale = 1e-12f;

int64_t round_up(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

#define AFLEX_AVX512 __attribute__((target("avx512f,avx512bw,avx512vnni")))

using Int32Alias = int32_t __attribute__((may_alias, aligned(1)));  // four codes read as one dword

// max |x[k]|, at least kMinScale (torch: x.abs().amax().clamp_(min=1e-12))
AFLEX_AVX512 float row_absmax(const float* x, int64_t K) {
  __m512 best = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) best = _mm512_max_ps(best, _mm512_abs_ps(_mm512_loadu_ps(x + k)));
  float result = _mm512_reduce_max_ps(best);
  for (; k < K; ++k) result = std::max(result, std::fabs(x[k]));
  return std::max(result, kMinScale);
}

// In-place Walsh-Hadamard transform of each block of 64 int32 (x @ blockdiag(S64), S Sylvester's
// +-1 matrix): lanes i and i^h combine within a register for h < 16, across registers above.
AFLEX_AVX512 void hadamard64(int32_t* x, int64_t K) {
  alignas(64) static const int32_t kLane[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const __m512i lane = _mm512_load_si512(kLane);
  __m512i swap[4];
  __mmask16 upper[4];
  for (int s = 0; s < 4; ++s) {
    const __m512i h = _mm512_set1_epi32(1 << s);
    swap[s] = _mm512_xor_si512(lane, h);                  // lane i reads lane i ^ h
    upper[s] = _mm512_test_epi32_mask(lane, h);           // lanes with bit h set take the difference
  }
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t base = 0; base < K; base += 64) {
    __m512i v[4];
    for (int r = 0; r < 4; ++r) v[r] = _mm512_loadu_si512(x + base + 16 * r);
    for (int s = 0; s < 4; ++s) {
      for (int r = 0; r < 4; ++r) {
        // bit clear: x[i] + x[i+h]; bit set: x[i-h] - x[i]
        const __m512i self = _mm512_mask_sub_epi32(v[r], upper[s], zero, v[r]);
        v[r] = _mm512_add_epi32(_mm512_permutexvar_epi32(swap[s], v[r]), self);
      }
    }
    for (int pair = 0; pair < 2; ++pair) {  // h = 16: registers (0, 1) and (2, 3)
      const __m512i a = v[2 * pair], b = v[2 * pair + 1];
      v[2 * pair] = _mm512_add_epi32(a, b);
      v[2 * pair + 1] = _mm512_sub_epi32(a, b);
    }
    for (int pair = 0; pair < 2; ++pair) {  // h = 32: registers (0, 2) and (1, 3)
      const __m512i a = v[pair], b = v[pair + 2];
      v[pair] = _mm512_add_epi32(a, b);
      v[pair + 2] = _mm512_sub_epi32(a, b);
    }
    for (int r = 0; r < 4; ++r) _mm512_storeu_si512(x + base + 16 * r, v[r]);
  }
}

// The same transform for blocks of 2..32 (hidden sizes that 64 does not divide): plain butterflies.
void hadamard_small(int32_t* x, int64_t K, int64_t block) {
  for (int64_t base = 0; base < K; base += block) {
    for (int64_t h = 1; h < block; h *= 2) {
      for (int64_t i = base; i < base + block; i += 2 * h) {
        for (int64_t j = i; j < i + h; ++j) {
          const int32_t a = x[j], b = x[j + h];
          x[j] = a + b;
          x[j + h] = a - b;
        }
      }
    }
  }
}

// One row: x [K] float -> q [Kp] int8 codes (zero padded), its scale and 128 * (sum of its codes).
// Follows Int8Linear.forward: rotation on the row rounded to 16-bit integers, then int8 per row.
AFLEX_AVX512 float quantize_row(const float* x, int64_t K, int64_t Kp, int64_t block, int32_t* integers,
                                float* rotated, int8_t* q, int32_t* correction) {
  const float* source = x;
  float pre_scale = 1.0f;
  if (block > 1) {
    pre_scale = row_absmax(x, K) / kInt16Max;
    const __m512 s16 = _mm512_set1_ps(pre_scale);
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
      const __m512 q = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + k), s16),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm512_storeu_si512(integers + k, _mm512_cvtps_epi32(q));
    }
    for (; k < K; ++k) integers[k] = static_cast<int32_t>(std::nearbyint(x[k] / pre_scale));
    if (block == 64) {
      hadamard64(integers, K);
    } else {
      hadamard_small(integers, K, block);
    }
    k = 0;
    for (; k + 16 <= K; k += 16) _mm512_storeu_ps(rotated + k, _mm512_cvtepi32_ps(_mm512_loadu_si512(integers + k)));
    for (; k < K; ++k) rotated[k] = static_cast<float>(integers[k]);
    source = rotated;
  }
  const float scale = row_absmax(source, K) / kInt8Max;
  const __m512 s8 = _mm512_set1_ps(scale);
  __m512i sum = _mm512_setzero_si512();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m512i codes = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(source + k), s8),
                                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    sum = _mm512_add_epi32(sum, codes);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtepi32_epi8(codes));
  }
  int32_t total = _mm512_reduce_add_epi32(sum);
  for (; k < K; ++k) {
    const auto code = static_cast<int32_t>(std::nearbyint(source[k] / scale));
    total += code;
    q[k] = static_cast<int8_t>(code);
  }
  std::memset(q + K, 0, static_cast<size_t>(Kp - K));
  *correction = 128 * total;
  return scale * pre_scale;  // torch: scale * pre_scale
}

// rows [MR] of q (stride lda) x one packed panel [Kp/4][64][4] -> y rows [MR] x up to 64 columns.
template <int MR>
AFLEX_AVX512 void tile(const int8_t* q, int64_t lda, const uint8_t* panel, int64_t groups, const int32_t* correction,
                       const float* row_scale, const float* weight_scale, const float* bias, float* y, int64_t ldy,
                       int64_t columns) {
  __m512i acc[MR][4];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_si512();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* w = panel + g * kPanel * kGroup;
    const __m512i w0 = _mm512_loadu_si512(w);
    const __m512i w1 = _mm512_loadu_si512(w + 64);
    const __m512i w2 = _mm512_loadu_si512(w + 128);
    const __m512i w3 = _mm512_loadu_si512(w + 192);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      // the row's 4 codes, broadcast as vpdpbusd's memory operand {1to16}
      const __m512i a = _mm512_set1_epi32(*reinterpret_cast<const Int32Alias*>(q + r * lda + g * kGroup));
      acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], w0, a);
      acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], w1, a);
      acc[r][2] = _mm512_dpbusd_epi32(acc[r][2], w2, a);
      acc[r][3] = _mm512_dpbusd_epi32(acc[r][3], w3, a);
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    const int64_t first = 16 * j;
    if (first >= columns) break;
    const __mmask16 valid = columns - first >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (columns - first)) - 1);
    const __m512 ws = _mm512_maskz_loadu_ps(valid, weight_scale + first);  // [N] is not padded
    const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(valid, bias + first) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512 exact = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][j], _mm512_set1_epi32(correction[r])));
      __m512 out = _mm512_mul_ps(_mm512_mul_ps(exact, _mm512_set1_ps(row_scale[r])), ws);
      if (bias != nullptr) out = _mm512_add_ps(out, b);
      _mm512_mask_storeu_ps(y + r * ldy + first, valid, out);
    }
  }
}

using TileFn = void (*)(const int8_t*, int64_t, const uint8_t*, int64_t, const int32_t*, const float*, const float*,
                        const float*, float*, int64_t, int64_t);
constexpr TileFn kTiles[kTileRows + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>};

}  // namespace

namespace aflex {

// weight [N, K] int8 -> panels [ceil(N/64), ceil(K/4), 64 * 4] of unsigned bytes w + 128 (padding 128 = 0)
torch::Tensor pack_weight(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kInt8, "pack_weight takes an int8 [N, K] matrix");
  const auto w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t Np = round_up(N, kPanel), groups = round_up(K, kGroup) / kGroup;
  auto packed = torch::full({Np / kPanel, groups, kPanel * kGroup}, 128, torch::kUInt8);
  const int8_t* src = w.data_ptr<int8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  for (int64_t n = 0; n < N; ++n) {
    const int64_t p = n / kPanel, c = n % kPanel;
    for (int64_t k = 0; k < K; ++k)
      dst[(p * groups + k / kGroup) * kPanel * kGroup + c * kGroup + k % kGroup] =
          static_cast<uint8_t>(static_cast<int32_t>(src[n * K + k]) + 128);
  }
  return packed;
}

// x [M, K] float32 -> y [M, N] float32; weight_scale [N] and bias [N] float32 (scale already / sqrt(block)).
torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& weight_scale,
                          const c10::optional<torch::Tensor>& bias, int64_t block, int64_t N) {
  TORCH_CHECK(cpu_has_avx512_vnni(), "int8_linear needs AVX-512 VNNI");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "int8_linear takes float32 [M, K] rows");
  TORCH_CHECK(block == 1 || (block > 1 && (block & (block - 1)) == 0 && block <= 64 && x.size(1) % block == 0),
              "the rotation block must be 1 or a power of two <= 64 dividing K");
  const auto rows = x.contiguous();
  const int64_t M = rows.size(0), K = rows.size(1);
  const int64_t panels = packed.size(0), groups = packed.size(1), Kp = groups * kGroup;
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && Kp == round_up(K, kGroup) && panels * kPanel >= N,
              "the packed weight does not match the input width or the output width");
  auto y = torch::empty({M, N}, rows.options());
  auto codes = torch::empty({M, Kp}, torch::kInt8);
  std::vector<float> row_scale(static_cast<size_t>(M));
  std::vector<int32_t> correction(static_cast<size_t>(M));
  const float* xs = rows.data_ptr<float>();
  int8_t* qs = codes.data_ptr<int8_t>();
  at::parallel_for(0, M, 32, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> integers(static_cast<size_t>(K));
    std::vector<float> rotated(static_cast<size_t>(K));
    for (int64_t m = begin; m < end; ++m)
      row_scale[m] = quantize_row(xs + m * K, K, Kp, block, integers.data(), rotated.data(), qs + m * Kp,
                                  correction.data() + m);
  });
  const uint8_t* ws = packed.data_ptr<uint8_t>();
  const float* scale = weight_scale.data_ptr<float>();
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* out = y.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t first = p * kPanel, columns = std::min(kPanel, N - first);
      for (int64_t m = 0; m < M; m += kTileRows) {
        const int64_t count = std::min<int64_t>(kTileRows, M - m);
        kTiles[count](qs + m * Kp, Kp, ws + p * groups * kPanel * kGroup, groups, correction.data() + m,
                      row_scale.data() + m, scale + first, b != nullptr ? b + first : nullptr, out + m * N + first, N,
                      columns);
      }
    }
  });
  return y;
}

}  // namespace aflex

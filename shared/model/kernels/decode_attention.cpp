// Decode attention straight from the paged KV cache: one query token per sequence against its
// context slots, for float32 caches and head sizes of 16..128 (multiples of 16).
//
// Why: the torch path gathers every sequence's context out of the cache into a padded
// [B, C, Hkv, hd] copy (per layer, for K and V) and runs SDPA with a padding mask; at a decode
// batch of 16 on the CPU the copy and the masked SDPA were 40% of the attention worker's time. Here
// each (sequence, kv head) reads its own slots where they lie, and only its own length: no copy,
// no padding, and so no dependence on the other sequences of the batch (batch invariance).
//
// Numerics: float32 throughout, scores scaled by 1/sqrt(hd), max-subtracted softmax with a
// Cephes-style exp (about 1 ulp), output divided by the sum: the same function as SDPA, rounded
// differently (tests compare within float32 tolerances, and greedy tokens against transformers).

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "aflex_kernels.h"

namespace {

#define AFLEX_AVX512 __attribute__((target("avx512f,avx512bw,avx512vnni")))

// e^x for x <= 0 (scores minus their max), 16 at a time: 2^n * p(r), r = x - n ln 2 (Cephes expf).
AFLEX_AVX512 inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
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
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// One (sequence, kv head): the G query heads [G][hd] that share it, over `length` slots.
template <int HD16>  // head size / 16
AFLEX_AVX512 void attend_one(const float* q, int64_t G, const float* k_cache, const float* v_cache, int64_t row_stride,
                             const int64_t* slots, int64_t length, float scale, float* scores, float* out) {
  constexpr int64_t hd = 16 * HD16;
  for (int64_t h = 0; h < G; ++h) {
    __m512 qh[HD16];
    for (int j = 0; j < HD16; ++j) qh[j] = _mm512_loadu_ps(q + h * hd + 16 * j);
    float* s = scores + h * length;
    float best = -INFINITY;
    for (int64_t c = 0; c < length; ++c) {
      const float* k = k_cache + slots[c] * row_stride;
      __m512 acc = _mm512_mul_ps(qh[0], _mm512_loadu_ps(k));
      for (int j = 1; j < HD16; ++j) acc = _mm512_fmadd_ps(qh[j], _mm512_loadu_ps(k + 16 * j), acc);
      s[c] = _mm512_reduce_add_ps(acc) * scale;
      best = std::max(best, s[c]);
    }
    const __m512 top = _mm512_set1_ps(best);
    __m512 total = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c + 16 <= length; c += 16) {
      const __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s + c), top));
      _mm512_storeu_ps(s + c, e);
      total = _mm512_add_ps(total, e);
    }
    if (c < length) {
      const __mmask16 tail = static_cast<__mmask16>((1u << (length - c)) - 1);
      const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + c), top));
      _mm512_mask_storeu_ps(s + c, tail, e);
      total = _mm512_add_ps(total, _mm512_maskz_mov_ps(tail, e));
    }
    const float inv_sum = 1.0f / _mm512_reduce_add_ps(total);
    __m512 acc[HD16];
    for (int j = 0; j < HD16; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t c2 = 0; c2 < length; ++c2) {
      const float* v = v_cache + slots[c2] * row_stride;
      const __m512 p = _mm512_set1_ps(s[c2]);
      for (int j = 0; j < HD16; ++j) acc[j] = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + 16 * j), acc[j]);
    }
    const __m512 norm = _mm512_set1_ps(inv_sum);
    for (int j = 0; j < HD16; ++j) _mm512_storeu_ps(out + h * hd + 16 * j, _mm512_mul_ps(acc[j], norm));
  }
}

using AttendFn = void (*)(const float*, int64_t, const float*, const float*, int64_t, const int64_t*, int64_t, float,
                          float*, float*);

}  // namespace

namespace aflex {

// q [B, H, hd], caches [S, Hkv, hd] float32, slots [B, C] int64 (row b's first lengths[b] are its context)
// -> [B, H, hd]; query head h reads kv head h / (H / Hkv), as SDPA's enable_gqa does.
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                               const torch::Tensor& slots, const torch::Tensor& lengths) {
  TORCH_CHECK(cpu_has_avx512_vnni(), "decode_attention needs AVX-512");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(), "q [B, H, hd], caches [S, Hkv, hd]");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kFloat32 &&
                  v_cache.scalar_type() == torch::kFloat32, "decode_attention is for float32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  const auto queries = q.contiguous();
  const auto slot_rows = slots.to(torch::kInt64).contiguous();
  const auto lens = lengths.to(torch::kInt64).contiguous();
  const int64_t B = queries.size(0), H = queries.size(1), hd = queries.size(2);
  const int64_t Hkv = k_cache.size(1), C = slot_rows.size(1);
  TORCH_CHECK(k_cache.size(2) == hd && H % Hkv == 0, "head sizes or head counts do not match");
  TORCH_CHECK(slot_rows.size(0) == B && lens.size(0) == B, "one slot row and one length per sequence");
  AttendFn attend = nullptr;
  switch (hd) {
    case 16: attend = attend_one<1>; break;
    case 32: attend = attend_one<2>; break;
    case 48: attend = attend_one<3>; break;
    case 64: attend = attend_one<4>; break;
    case 80: attend = attend_one<5>; break;
    case 96: attend = attend_one<6>; break;
    case 112: attend = attend_one<7>; break;
    case 128: attend = attend_one<8>; break;
    default: TORCH_CHECK(false, "decode_attention supports head sizes 16..128 in steps of 16, not ", hd);
  }
  const int64_t G = H / Hkv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  auto out = torch::empty_like(queries);
  const float* qs = queries.data_ptr<float>();
  const float* ks = k_cache.data_ptr<float>();
  const float* vs = v_cache.data_ptr<float>();
  const int64_t* slot_data = slot_rows.data_ptr<int64_t>();
  const int64_t* len_data = lens.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(len_data[b] >= 1 && len_data[b] <= C, "a context length is out of range");
    for (int64_t c = 0; c < len_data[b]; ++c)
      TORCH_CHECK(slot_data[b * C + c] >= 0 && slot_data[b * C + c] < num_slots, "a context slot is out of range");
  }
  float* os = out.data_ptr<float>();
  const int64_t row_stride = Hkv * hd;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(static_cast<size_t>(G * C));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hkv, g = item % Hkv;
      attend(qs + (b * H + g * G) * hd, G, ks + g * hd, vs + g * hd, row_stride, slot_data + b * C, len_data[b],
             scale, scores.data(), os + (b * H + g * G) * hd);
    }
  });
  return out;
}

}  // namespace aflex

// The elementwise work of a decoder layer in one pass each, on CPU: residual add + RMSNorm,
// SiLU(gate) * up, and rotary embedding in place (alone, or with the step's cache write after it). In
// torch each is a chain of ops (RMSNorm alone is a float copy, pow, mean, add, rsqrt, mul, a copy back
// and the weight's mul), every one a pass over the activations; a bf16 SmolLM2 decode step spent
// 12-15 % of its time in them.
//
// Rounding follows the torch ops they replace (HF's modeling code): the residual sum is rounded to
// the activation dtype before it is normalised, the normalised row is rounded before the weight's
// multiply, SiLU is rounded before the multiply by up, and each rotary product is rounded before
// the sum -- so bf16 results match the torch path's and float32 is the same computation.
// Built into the CPU ops extension by pagedmodel/kernels/cpu_paged_attention.py.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_cache_write.h"
#include "cpu_vector_math.h"

namespace {

using pagedmodel_cpu::to_float;
using pagedmodel_cpu::bf16_bits;
inline void store(float* dst, float x) { *dst = x; }
inline void store(c10::BFloat16* dst, float x) { dst->x = bf16_bits(x); }

// float -> T -> float: the value a torch op in dtype T would have stored
inline float round_to(float x, float*) { return x; }
inline float round_to(float x, c10::BFloat16*) {
  const uint32_t bits = static_cast<uint32_t>(bf16_bits(x)) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
template <typename T>
inline float rounded(float x) { return round_to(x, static_cast<T*>(nullptr)); }

// g * sigmoid(g) with one division: g / (1 + e) where e = exp(-|g|) (never above 1), times e for
// negative g. A division is the loop's slowest instruction (the two-division form, 1/(1+e) or
// e/(1+e) both computed and one kept, took 1.1x as long on an AMX Xeon), and the bf16 results match.
inline float silu(float g) {
  const float e = pagedmodel_cpu::exp_nonpositive(-std::fabs(g));
  const float q = g / (1.f + e);
  return g >= 0.f ? q : q * e;
}

#if defined(__AVX512BF16__)
// 16 bf16 values (the first `mask` lanes) as float32
inline __m512 load_bf16(const c10::BFloat16* p, __mmask16 mask) {
  return pagedmodel_cpu::widen_bf16x16(_mm256_maskz_loadu_epi16(mask, p));
}

// x rounded to bf16 (nearest even, as bf16_bits), packed, and as float32 again
inline __m256i pack_bf16(__m512 x) { return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)); }
inline __m512 round_bf16(__m512 x) { return pagedmodel_cpu::widen_bf16x16(pack_bf16(x)); }

// the lanes of a row's 16-value run at j that lie inside its `width` values
inline __mmask16 tail_mask(int64_t width, int64_t j) {
  return static_cast<__mmask16>(width - j >= 16 ? 0xFFFF : (1u << (width - j)) - 1);
}

// One bf16 row of add_rms_norm in AVX-512, each rounding one VCVTNEPS2BF16 where the compiler's
// vectorization of bf16_bits spends six integer ops: a 2,048-row prefill chunk (SmolLM2's 576 wide, one
// thread, an AMX Xeon, the two builds alternated) took 0.61-0.65 -> 0.42-0.45 ms a call, same outputs
// (the sum of squares, added in another order, moved no bf16 result there).
inline void add_rms_norm_row(c10::BFloat16* x, c10::BFloat16* residual, const c10::BFloat16* weight, int64_t dim,
                             float eps, float* sum) {
  __m512 squares = _mm512_setzero_ps();
  for (int64_t j = 0; j < dim; j += 16) {
    const __mmask16 mask = tail_mask(dim, j);
    const __m256i packed = pack_bf16(_mm512_add_ps(load_bf16(x + j, mask), load_bf16(residual + j, mask)));
    _mm256_mask_storeu_epi16(residual + j, mask, packed);
    const __m512 s = pagedmodel_cpu::widen_bf16x16(packed);
    _mm512_mask_storeu_ps(sum + j, mask, s);
    squares = _mm512_fmadd_ps(s, s, squares);   // masked-off lanes loaded as zero
  }
  const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(dim) + eps));
  for (int64_t j = 0; j < dim; j += 16) {
    const __mmask16 mask = tail_mask(dim, j);
    const __m512 normed = round_bf16(_mm512_mul_ps(_mm512_maskz_loadu_ps(mask, sum + j), inv));
    _mm256_mask_storeu_epi16(x + j, mask, pack_bf16(_mm512_mul_ps(load_bf16(weight + j, mask), normed)));
  }
}

// One bf16 row of silu_and_mul in AVX-512: the scalar loop's arithmetic (the same one division, the
// exp polynomial in its AVX-512 spelling), with each rounding to bf16 done by VCVTNEPS2BF16 (nearest
// even, as bf16_bits), so the outputs are bit-identical. On an AMX Xeon (one thread) a 64-row decode
// step's call took 0.085 -> 0.065 ms and a 2,048-row prefill chunk's 3.8 -> 2.2 ms against the
// compiler's vectorization of the scalar loop; what is left is mostly the division.
inline void silu_and_mul_row(const c10::BFloat16* gate, const c10::BFloat16* up, c10::BFloat16* o, int64_t width) {
  const __m512 one = _mm512_set1_ps(1.f), zero = _mm512_setzero_ps();
  for (int64_t j = 0; j < width; j += 16) {
    const __mmask16 mask = tail_mask(width, j);
    const __m512 g = load_bf16(gate + j, mask);
    const __m512 e = pagedmodel_cpu::exp_nonpositive16(_mm512_sub_ps(zero, _mm512_abs_ps(g)));
    const __m512 q = _mm512_div_ps(g, _mm512_add_ps(one, e));
    const __m512 silu = _mm512_mask_mul_ps(q, _mm512_cmp_ps_mask(g, zero, _CMP_LT_OQ), q, e);
    _mm256_mask_storeu_epi16(o + j, mask, pack_bf16(_mm512_mul_ps(round_bf16(silu), load_bf16(up + j, mask))));
  }
}
#endif

// residual = x + residual (rounded to T); x = weight * T(residual * rsqrt(mean(residual^2) + eps))
template <typename T>
void add_rms_norm(T* x, T* residual, const T* weight, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> sum(dim);
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * dim;
      T* res = residual + r * dim;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        add_rms_norm_row(xr, res, weight, dim, eps, sum.data());
        continue;
      }
#endif
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t d = 0; d < dim; ++d) {
        const float s = rounded<T>(to_float(xr[d]) + to_float(res[d]));
        sum[d] = s;
        squares += s * s;
      }
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(dim) + eps);
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) {
        store(res + d, sum[d]);
        store(xr + d, to_float(weight[d]) * rounded<T>(sum[d] * inv));
      }
    }
  });
}

template <typename T>
void silu_and_mul(const T* gate_up, T* out, int64_t rows, int64_t width) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = gate_up + r * 2 * width;
      const T* up = gate + width;
      T* o = out + r * width;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        silu_and_mul_row(gate, up, o, width);
        continue;
      }
#endif
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) {
        const float g = to_float(gate[j]);
        store(o + j, rounded<T>(silu(g)) * to_float(up[j]));
      }
    }
  });
}

#if defined(__AVX512BF16__)
// One bf16 head of rotary in AVX-512, its arithmetic and roundings the scalar loop's (c, s: the token's
// table rows, already rounded to bf16). With the tables rounded once a token rather than once a head, a
// 2,048-token prefill chunk's 12 heads took 0.81-0.86 -> 0.56-0.69 ms (same outputs; the setup as
// add_rms_norm_row's).
inline void rotary_head(c10::BFloat16* v, int64_t half, const float* c, const float* s) {
  for (int64_t d = 0; d < half; d += 16) {
    const __mmask16 mask = tail_mask(half, d);
    const __m512 a = load_bf16(v + d, mask), b = load_bf16(v + d + half, mask);
    const __m512 first = _mm512_add_ps(round_bf16(_mm512_mul_ps(a, _mm512_maskz_loadu_ps(mask, c + d))),
                                       round_bf16(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), b),
                                                                _mm512_maskz_loadu_ps(mask, s + d))));
    const __m512 second = _mm512_add_ps(round_bf16(_mm512_mul_ps(b, _mm512_maskz_loadu_ps(mask, c + d + half))),
                                        round_bf16(_mm512_mul_ps(a, _mm512_maskz_loadu_ps(mask, s + d + half))));
    _mm256_mask_storeu_epi16(v + d, mask, pack_bf16(first));
    _mm256_mask_storeu_epi16(v + d + half, mask, pack_bf16(second));
  }
}
#endif

// x[t, h, :] = x * cos + rotate_half(x) * sin at position positions[t] (NeoX / HF layout: the two
// halves of the head dimension pair up), in place; cos/sin are float32 [max_pos, dim] tables. Tokens
// may be strided (q and k are column slices of the fused qkv projection's output).
template <typename T>
void rotary(T* x, int64_t tokens, int64_t token_stride, int64_t heads, int64_t dim, const float* cos_table,
            const float* sin_table, const int64_t* positions) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> table(2 * dim);   // the token's cos, then sin row, rounded to T once for all its heads
    const float* c = table.data();
    const float* s = c + dim;
    for (int64_t t = begin; t < end; ++t) {
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) {
        table[d] = rounded<T>(cos_table[positions[t] * dim + d]);
        table[dim + d] = rounded<T>(sin_table[positions[t] * dim + d]);
      }
      for (int64_t h = 0; h < heads; ++h) {
        T* v = x + t * token_stride + h * dim;
#if defined(__AVX512BF16__)
        if constexpr (std::is_same_v<T, c10::BFloat16>) {
          rotary_head(v, half, c, s);
          continue;
        }
#endif
#pragma omp simd
        for (int64_t d = 0; d < half; ++d) {
          const float a = to_float(v[d]), b = to_float(v[d + half]);
          // rotate_half(v) = (-b, a)
          store(v + d, rounded<T>(a * c[d]) + rounded<T>(-b * s[d]));
          store(v + d + half, rounded<T>(b * c[d + half]) + rounded<T>(a * s[d + half]));
        }
      }
    }
  });
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), name, " must be a contiguous CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name, " must be float32 or bfloat16");
}

void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  check_rows(weight, "weight");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type() &&
              weight.scalar_type() == x.scalar_type() && x.dim() == 2 && weight.numel() == x.size(1),
              "x, residual [rows, dim] and weight [dim] of one dtype");
  if (x.scalar_type() == at::kFloat)
    add_rms_norm(x.data_ptr<float>(), residual.data_ptr<float>(), weight.data_ptr<float>(), x.size(0), x.size(1),
                 static_cast<float>(eps));
  else
    add_rms_norm(x.data_ptr<c10::BFloat16>(), residual.data_ptr<c10::BFloat16>(), weight.data_ptr<c10::BFloat16>(),
                 x.size(0), x.size(1), static_cast<float>(eps));
}

at::Tensor fused_silu_and_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be [rows, 2 * width]");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, width}, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat)
    silu_and_mul(gate_up.data_ptr<float>(), out.data_ptr<float>(), rows, width);
  else
    silu_and_mul(gate_up.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), rows, width);
  return out;
}

void rotary_embedding(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be a float32 or bfloat16 CPU tensor");
  TORCH_CHECK(x.dim() == 3 && x.size(2) % 2 == 0 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "x must be [tokens, heads, even head_dim] with each token's heads contiguous");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.is_contiguous() && cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(1) == x.size(2),
              "cos/sin must be contiguous float32 [max_positions, head_dim]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == x.size(0),
              "one int64 position per token");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < x.size(0); ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "position ", pos[t], " outside the rotary table");
  if (x.scalar_type() == at::kFloat)
    rotary(x.data_ptr<float>(), x.size(0), x.stride(0), x.size(1), x.size(2), cos.data_ptr<float>(),
           sin.data_ptr<float>(), pos);
  else
    rotary(x.data_ptr<c10::BFloat16>(), x.size(0), x.stride(0), x.size(1), x.size(2), cos.data_ptr<float>(),
           sin.data_ptr<float>(), pos);
}

// Rotary embedding on a step's query and key heads, then its keys and values into their cache slots,
// on the fused qkv projection's output [tokens, (q_heads + 2 kv_heads) * head_dim] in place: one call a
// layer where a split into three views, two rotary calls and a cache write were six, at 3-7 us each from
// Python (the rows are a few KB). The queries stay in qkv for the attention op to read.
void rotary_and_write_kv(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
                         at::Tensor& kv_cache, const at::Tensor& slot_mapping, int64_t q_heads) {
  TORCH_CHECK(kv_cache.dim() == 5, "kv_cache must be [2, blocks, block_size, kv_heads, head_dim]");
  const int64_t kv_heads = kv_cache.size(3), dim = kv_cache.size(4);
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && q_heads > 0 && qkv.size(1) == (q_heads + 2 * kv_heads) * dim,
              "qkv must be contiguous [tokens, (q_heads + 2 kv_heads) * head_dim] of the cache's heads and head dim");
  const at::Tensor heads = qkv.view({qkv.size(0), q_heads + 2 * kv_heads, dim});
  at::Tensor rotated = heads.narrow(1, 0, q_heads + kv_heads);
  rotary_embedding(rotated, cos, sin, positions);
  pagedmodel_cpu::write_kv(heads.narrow(1, q_heads, kv_heads), heads.narrow(1, q_heads + kv_heads, kv_heads), kv_cache,
                           slot_mapping);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedmodel, m) {
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("rotary_embedding(Tensor(a!) x, Tensor cos, Tensor sin, Tensor positions) -> ()");
  m.def("rotary_and_write_kv(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor positions, Tensor(b!) kv_cache, "
        "Tensor slot_mapping, int q_heads) -> ()");
}

TORCH_LIBRARY_IMPL(pagedmodel, CPU, m) {
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("silu_and_mul", &fused_silu_and_mul);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("rotary_and_write_kv", &rotary_and_write_kv);
}

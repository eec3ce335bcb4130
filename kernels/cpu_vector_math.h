// Scalar helpers written so that the loops calling them vectorize, and their AVX-512 spellings where
// hand-written loops need them (shared by the CPU ops).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pagedmodel_cpu {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  // bf16 is the top half of a float32: a shift, which the compiler vectorizes
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }
// float -> bf16 bits, round to nearest even (NaN stays NaN), in integer ops a simd loop vectorizes
// (c10::BFloat16's own constructor does not: a 10x slower SiLU on prefill-sized steps)
inline uint16_t bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const uint32_t rounded = u + 0x7FFFu + ((u >> 16) & 1u);
  return x != x ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded >> 16);
}

// exp(x) for x <= 0 (softmax terms after subtracting the row's max), written so that a simd loop
// vectorizes it (std::exp is a scalar libm call): n = round(x / ln 2), r = x - n ln 2 in two parts,
// exp(r) by a degree-6 minimax polynomial, times 2^n built in the exponent bits. Relative error
// below 2e-7 (a few float ulps); x below -87 gives ~1e-38 instead of 0, nothing next to the max's 1.
// The constants are shared with the AVX-512 spelling, exp_nonpositive16, below.
namespace exp_poly {
constexpr float kLowest = -87.f, kLog2e = 1.44269504088896341f;
constexpr float kLn2High = 0.693359375f, kLn2Low = 2.12194440e-4f;   // ln 2 = kLn2High - kLn2Low
// Horner's coefficients, highest degree first
constexpr float kCoefficients[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                    4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
}  // namespace exp_poly

inline float exp_nonpositive(float x) {
  using namespace exp_poly;
  x = std::max(x, kLowest);
  const float n = std::nearbyint(x * kLog2e);
  float r = x - n * kLn2High;
  r = r + n * kLn2Low;
  float y = kCoefficients[0];
  for (int c = 1; c < 6; ++c) y = y * r + kCoefficients[c];
  y = y * r * r + r + 1.f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

#if defined(__AVX512F__)
// 16 bf16 values (their bits) as float32: bf16 is the top half of a float32
inline __m512 widen_bf16x16(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// e^x for 16 lanes of x <= 0: exp_nonpositive's polynomial spelled in AVX-512, for loops the compiler
// does not vectorize as well (the prefill op's one-pass softmax: the compiler's vectorization of the
// scalar helper, plus separate passes for the sum and the bf16 rounding, was half of the AMX op's time).
inline __m512 exp_nonpositive16(__m512 x) {
  using namespace exp_poly;
  x = _mm512_max_ps(x, _mm512_set1_ps(kLowest));
  const __m512 n =
      _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(kLn2Low), r);
  __m512 y = _mm512_set1_ps(kCoefficients[0]);
  for (int c = 1; c < 6; ++c) y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kCoefficients[c]));
  y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(y, r), r, r), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}
#endif

// max(x[0..n)), n >= 1: sixteen running maxima side by side, which vectorizes without reassociating
// a reduction (a plain max reduction loop stays scalar without -ffast-math).
inline float row_max(const float* x, int64_t n) {
  float lanes[16];
  std::fill(lanes, lanes + 16, x[0]);
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) {
#pragma omp simd
    for (int j = 0; j < 16; ++j) lanes[j] = lanes[j] < x[t + j] ? x[t + j] : lanes[j];
  }
  float m = x[0];
  for (int j = 0; j < 16; ++j) m = std::max(m, lanes[j]);
  for (; t < n; ++t) m = std::max(m, x[t]);
  return m;
}

// sum(exp(x[t] - m)) for t < n, m >= every x[t].
inline float sum_exp_below(const float* x, int64_t n, float m) {
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t t = 0; t < n; ++t) total += exp_nonpositive(x[t] - m);
  return total;
}

}  // namespace pagedmodel_cpu

// y = x @ W^T (+ bias) for bfloat16 weights, multiplied in float32: for CPUs with AVX-512 but no AMX.
//
// Why: without AMX, oneDNN's bf16 GEMM tops out near 75 GFLOP/s on one core of an Emerald Rapids
// guest, its float32 GEMM near 135, and small steps are bound by reading the weights (a decode step
// of SmolLM2-135M streams 270 MB of bf16 weights). This op reads the bf16 weights once (half the
// bytes of a float32 copy), widens them in registers (a bf16 is the top half of a float32: a shift
// or a mask) and multiplies in float32 with FMAs. A microbenchmark of a step's linears (30 layers +
// head, one thread, weights streamed from DRAM): 8 rows 45 -> 25 ms, 16 rows 67 -> 41 ms against
// oneDNN's bf16 GEMM. With more rows it is compute bound near 100 GFLOP/s, below oneDNN's float32
// GEMM (115-140), so pagedmodel/kernels/cpu_linear.py sends steps of 32 rows or more there.
//
// Weight layout (pagedmodel/kernels/cpu_linear.py packs it): panels of 32 output columns; within a panel, for
// each pair of input columns (k, k + 1), two blocks of 16 output columns, each 16 dwords whose low
// half is W[n][k] and high half W[n][k + 1]. One 64-byte load then gives 16 columns for two k.
// Shape [panels, K / 2, 64] (int16), zero-padded to whole panels and an even K.
//
// Every product is a bf16 x float32 product summed in float32 (what a float32 GEMM over the bf16
// values computes, up to summation order); the output is rounded to bf16 (nearest even) or kept
// float32 (the logits head). Without AVX-512 the same layout is read by plain loops, so the op is
// correct everywhere (tests) though it is only chosen where it is fast.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "cpu_vector_math.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define PM_BF16_LINEAR_AVX512 1
#endif

namespace {

using pagedmodel_cpu::bf16_bits;
using pagedmodel_cpu::to_float;

constexpr int64_t kPanel = 32;     // output columns per panel
constexpr int64_t kPanelPair = 64; // int16 per k pair in a panel
constexpr int kRowTile = 8;        // rows multiplied together: 16 accumulators of 16 floats

struct PanelProblem {
  const float* x;          // [rows, ldx] float32, ldx = 2 * kpairs (zero-padded)
  int64_t ldx;
  const uint16_t* w;       // [panels, kpairs, 64]
  int64_t kpairs;
  int64_t n;               // real output columns
  const float* bias;       // [n] or nullptr
  void* y;                 // [rows, n], float32 or bf16
  bool float_output;
};

#if defined(PM_BF16_LINEAR_AVX512)

inline __m256i to_bf16x16(__m512 v) {
  __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  u = _mm512_srli_epi32(u, 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  u = _mm512_mask_mov_epi32(u, nan, _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(u);
}

inline void store16(const PanelProblem& p, int64_t row, int64_t col, __m512 v, __mmask16 mask) {
  if (mask == 0) return;
  if (p.bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, p.bias + col));
  if (p.float_output) {
    _mm512_mask_storeu_ps(static_cast<float*>(p.y) + row * p.n + col, mask, v);
  } else {
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p.y) + row * p.n + col, mask, to_bf16x16(v));
  }
}

inline __mmask16 cols_mask(int64_t cols) {
  return cols >= 16 ? static_cast<__mmask16>(0xffff) : cols <= 0 ? 0 : static_cast<__mmask16>((1u << cols) - 1);
}

// MR rows x one panel. The two FMAs per accumulator and k pair are what keeps the FMA ports busy
// (16 independent accumulators at MR = 8); the prefetch runs 8 KB ahead of the weight stream, which
// took a decode step's weight reads from ~10 to ~13 GB/s here.
template <int MR>
void panel_tile(const PanelProblem& p, int64_t row0, int64_t panel) {
  const uint16_t* w = p.w + panel * p.kpairs * kPanelPair;
  const float* x = p.x + row0 * p.ldx;
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = _mm512_setzero_ps(), acc[m][1] = _mm512_setzero_ps();
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t kp = 0; kp < p.kpairs; ++kp) {
    const char* at = reinterpret_cast<const char*>(w + kp * kPanelPair);
    _mm_prefetch(at + 8192, _MM_HINT_T0);
    _mm_prefetch(at + 8192 + 64, _MM_HINT_T0);
    const __m512i z0 = _mm512_loadu_si512(at);
    const __m512i z1 = _mm512_loadu_si512(at + 64);
    const __m512 w0k = _mm512_castsi512_ps(_mm512_slli_epi32(z0, 16));
    const __m512 w0k1 = _mm512_castsi512_ps(_mm512_and_si512(z0, high));
    const __m512 w1k = _mm512_castsi512_ps(_mm512_slli_epi32(z1, 16));
    const __m512 w1k1 = _mm512_castsi512_ps(_mm512_and_si512(z1, high));
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m512 xk = _mm512_set1_ps(x[m * p.ldx + 2 * kp]);
      const __m512 xk1 = _mm512_set1_ps(x[m * p.ldx + 2 * kp + 1]);
      acc[m][0] = _mm512_fmadd_ps(xk, w0k, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(xk, w1k, acc[m][1]);
      acc[m][0] = _mm512_fmadd_ps(xk1, w0k1, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(xk1, w1k1, acc[m][1]);
    }
  }
  const int64_t col = panel * kPanel, cols = std::min<int64_t>(kPanel, p.n - col);
  for (int m = 0; m < MR; ++m) {
    store16(p, row0 + m, col, acc[m][0], cols_mask(cols));
    store16(p, row0 + m, col + 16, acc[m][1], cols_mask(cols - 16));
  }
}

void tile(const PanelProblem& p, int64_t row0, int rows, int64_t panel) {
  switch (rows) {
    case 1: return panel_tile<1>(p, row0, panel);
    case 2: return panel_tile<2>(p, row0, panel);
    case 3: return panel_tile<3>(p, row0, panel);
    case 4: return panel_tile<4>(p, row0, panel);
    case 5: return panel_tile<5>(p, row0, panel);
    case 6: return panel_tile<6>(p, row0, panel);
    case 7: return panel_tile<7>(p, row0, panel);
    default: return panel_tile<8>(p, row0, panel);
  }
}

#else  // plain loops over the same layout

void tile(const PanelProblem& p, int64_t row0, int rows, int64_t panel) {
  const uint16_t* w = p.w + panel * p.kpairs * kPanelPair;
  const int64_t col = panel * kPanel, cols = std::min<int64_t>(kPanel, p.n - col);
  for (int m = 0; m < rows; ++m) {
    const float* x = p.x + (row0 + m) * p.ldx;
    float acc[kPanel] = {0.f};
    for (int64_t kp = 0; kp < p.kpairs; ++kp) {
      const uint16_t* wk = w + kp * kPanelPair;
      for (int64_t j = 0; j < kPanel; ++j) {
        const uint16_t* pair = wk + (j / 16) * 32 + (j % 16) * 2;
        acc[j] += x[2 * kp] * to_float(c10::BFloat16(pair[0], c10::BFloat16::from_bits())) +
                  x[2 * kp + 1] * to_float(c10::BFloat16(pair[1], c10::BFloat16::from_bits()));
      }
    }
    for (int64_t j = 0; j < cols; ++j) {
      const float v = acc[j] + (p.bias != nullptr ? p.bias[col + j] : 0.f);
      if (p.float_output) {
        static_cast<float*>(p.y)[(row0 + m) * p.n + col + j] = v;
      } else {
        static_cast<uint16_t*>(p.y)[(row0 + m) * p.n + col + j] = bf16_bits(v);
      }
    }
  }
}

#endif

at::Tensor bf16_weight_linear(const at::Tensor& x_in, const at::Tensor& panels, int64_t out_features,
                              const std::optional<at::Tensor>& bias, bool float_output) {
  TORCH_CHECK(x_in.dim() == 2, "bf16_weight_linear: x must be 2-D, got ", x_in.dim(), "-D");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanelPair && panels.scalar_type() == at::kShort &&
                  panels.is_contiguous(),
              "bf16_weight_linear: panels must be contiguous int16 [panels, K/2, 64]");
  const int64_t rows = x_in.size(0), k = x_in.size(1), kpairs = panels.size(1);
  TORCH_CHECK(kpairs == (k + 1) / 2, "bf16_weight_linear: x has ", k, " columns, the weight ", 2 * kpairs);
  TORCH_CHECK(out_features > (panels.size(0) - 1) * kPanel && out_features <= panels.size(0) * kPanel,
              "bf16_weight_linear: ", out_features, " outputs do not fit ", panels.size(0), " panels");
  at::Tensor x = x_in.to(at::kFloat).contiguous();
  if (k % 2 != 0) {   // the last pair's second column is zero in the weight; x gets a zero too
    at::Tensor padded = at::zeros({rows, k + 1}, x.options());
    padded.narrow(1, 0, k).copy_(x);
    x = padded;
  }
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    bias_f = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bias_f.numel() == out_features, "bf16_weight_linear: bias has ", bias_f.numel(), " values");
  }
  at::Tensor y = at::empty({rows, out_features}, x.options().dtype(float_output ? at::kFloat : at::kBFloat16));
  const PanelProblem p{x.data_ptr<float>(), 2 * kpairs, reinterpret_cast<const uint16_t*>(panels.data_ptr()), kpairs,
                  out_features, bias_f.defined() ? bias_f.data_ptr<float>() : nullptr, y.data_ptr(), float_output};
  // Panels are taken a group at a time so that every row tile passes over the group while its
  // weights sit in L2; groups are small enough that each thread gets several.
  const int64_t num_panels = panels.size(0);
  const int64_t group = std::clamp<int64_t>(num_panels / (4 * at::get_num_threads()), 1, 8);
  const int64_t groups = (num_panels + group - 1) / group;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t last = std::min(num_panels, (g + 1) * group);
      for (int64_t row0 = 0; row0 < rows; row0 += kRowTile) {
        const int tile_rows = static_cast<int>(std::min<int64_t>(kRowTile, rows - row0));
        for (int64_t panel = g * group; panel < last; ++panel) tile(p, row0, tile_rows, panel);
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedmodel, m) {
  m.def("bf16_weight_linear(Tensor x, Tensor panels, int out_features, Tensor? bias, bool float_output) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedmodel, CPU, m) { m.impl("bf16_weight_linear", &bf16_weight_linear); }


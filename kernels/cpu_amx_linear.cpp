// y = x @ W^T (+ bias) for bfloat16 weights on AMX tiles, for decode-sized steps (a few to a few dozen rows).
//
// Why: on an AMX Xeon guest (one thread, SmolLM2-135M's projections streamed from DRAM) oneDNN's
// packed bf16 GEMM took 15 ms for a step's 30 layers of linears at 8 or 16 rows, and its head 7.7 ms
// at one row, where reading the 212 MB of weights at the 20-25 GB/s one core reaches with software
// prefetch takes 9-10 ms. This op reads each weight tile once per step, asks for the tiles a few
// steps ahead (the hardware prefetcher alone left AMX waiting on memory: ~11 GB/s), and keeps up to
// four 16-row tiles of the step's rows on one weight tile. Past a few dozen rows AMX's loads from L2
// become the limit and oneDNN's blocking is better; ``cpu_linear_plan.py`` measures where the two cross.
//
// Weight layout (``pack_amx_tiles`` in pagedmodel/kernels/cpu_linear.py): for each block of 16 output
// columns and each block of 32 input columns, one 1 KB tile of 16 rows (input pairs k, k + 1) of 16
// (W[n][k], W[n][k + 1]) pairs: AMX's VNNI layout for the B operand. Shape [N/16, K/32, 512] (int16),
// zero-padded to whole tiles. The rows of x are copied into the same tile order (zero-padded) once
// per call, so every tile load reads 1 KB in a row.
//
// Products are bf16 x bf16 summed in float32 by the tile unit (input denormals read as zero); the
// output is rounded to bf16 (nearest even) or kept float32 (the logits head). Built only where the
// compiler targets AMX-BF16 (``-march=native`` on such a CPU); elsewhere the op is not registered.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "cpu_amx_tiles.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <algorithm>
#include <cstdint>
#include <optional>

namespace {

constexpr int64_t kTileCols = 16;    // output columns of a weight tile
constexpr int64_t kTileDepth = 32;   // input columns of a tile (16 bf16 pairs)
constexpr int64_t kTileElems = 512;  // int16 values in a 1 KB tile
constexpr int kRowTiles = 4;         // 16-row tiles of x on one weight tile (accumulators 0-3)
constexpr int kPrefetchTiles = 4;    // weight tiles asked for ahead of the one being multiplied

struct Problem {
  const uint16_t* x_tiles;  // [row tiles, depth tiles, 512]
  const uint16_t* w_tiles;  // [column tiles, depth tiles, 512]
  const uint16_t* w_end;
  int64_t depth_tiles;
  int64_t row_tiles;
  int64_t rows;             // real rows of y
  int64_t n;                // real columns of y
  const float* bias;        // [n] or nullptr
  void* y;                  // [rows, n], float32 or bf16
  bool float_output;
};

// Writes a 16 x 16 float32 accumulator (plus bias) into y's rows row0.. and columns col0..
void store_block(const Problem& p, const float* acc, int64_t row0, int64_t col0) {
  const int64_t width = std::min<int64_t>(kTileCols, p.n - col0);
  const __mmask16 mask = static_cast<__mmask16>((1u << width) - 1);
  const __m512 bias = p.bias ? _mm512_maskz_loadu_ps(mask, p.bias + col0) : _mm512_setzero_ps();
  for (int64_t r = 0; r < 16 && row0 + r < p.rows; ++r) {
    const __m512 v = _mm512_add_ps(_mm512_load_ps(acc + r * 16), bias);
    const int64_t at = (row0 + r) * p.n + col0;
    if (p.float_output) {
      _mm512_mask_storeu_ps(static_cast<float*>(p.y) + at, mask, v);
    } else {
      const __m256i bf16 = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));   // nearest even
      _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p.y) + at, mask, bf16);
    }
  }
}

// One weight column tile against up to four x row tiles, over the whole depth.
void column_tile(const Problem& p, int64_t col_tile, int64_t row_tile0, int group) {
  const uint16_t* w = p.w_tiles + col_tile * p.depth_tiles * kTileElems;
  const uint16_t* x = p.x_tiles + row_tile0 * p.depth_tiles * kTileElems;
  const int64_t stride = p.depth_tiles * kTileElems;   // from one x row tile to the next
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t d = 0; d < p.depth_tiles; ++d) {
    const uint16_t* tile = w + d * kTileElems;
    if (row_tile0 == 0) {   // later row groups find this column's tiles in L1/L2
      // into L2, not L1: the x tiles' loads from L2 need L1's line fill buffers too, and a weight
      // tile's 16 lines held there for the whole DRAM latency crowd them out. 30 layers' linears
      // streamed on an AMX Xeon, one thread, the two builds alternated: 21.4-21.8 -> 19.2-20.3 ms at
      // 32 rows, 23.8-24.5 -> 22.1-23.7 at 48, alike at 8; at 64 within the noise (26.8-28.3 against
      // 27.1-28.3). Prefetch distances of 4 to 32 tiles made no difference with either hint.
      const char* ahead = reinterpret_cast<const char*>(tile + kPrefetchTiles * kTileElems);
      if (ahead < reinterpret_cast<const char*>(p.w_end))
        for (int line = 0; line < 16; ++line) _mm_prefetch(ahead + line * 64, _MM_HINT_T2);
    }
    _tile_loadd(6, tile, 64);
    _tile_loadd(4, x + d * kTileElems, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (group > 1) {
      _tile_loadd(5, x + stride + d * kTileElems, 64);
      _tile_dpbf16ps(1, 5, 6);
    }
    if (group > 2) {
      _tile_loadd(4, x + 2 * stride + d * kTileElems, 64);
      _tile_dpbf16ps(2, 4, 6);
    }
    if (group > 3) {
      _tile_loadd(5, x + 3 * stride + d * kTileElems, 64);
      _tile_dpbf16ps(3, 5, 6);
    }
  }
  alignas(64) float acc[kRowTiles][256];
  _tile_stored(0, acc[0], 64);
  if (group > 1) _tile_stored(1, acc[1], 64);
  if (group > 2) _tile_stored(2, acc[2], 64);
  if (group > 3) _tile_stored(3, acc[3], 64);
  for (int i = 0; i < group; ++i) store_block(p, acc[i], (row_tile0 + i) * 16, col_tile * kTileCols);
}

// x's rows in the weight's tile order: [row tiles, depth tiles, 16 rows x 32 values], zero-padded.
// Only the padding is zeroed (a zero-filled buffer, then the copy, cost 22 us a call at 64 rows: 2.6 ms
// of a decode step's 120 calls).
at::Tensor x_in_tiles(const at::Tensor& x, int64_t row_tiles, int64_t depth_tiles) {
  const int64_t rows = x.size(0), k = x.size(1);
  at::Tensor tiles = at::empty({row_tiles, depth_tiles, kTileElems}, x.options().dtype(at::kShort));
  const uint16_t* src = reinterpret_cast<const uint16_t*>(x.data_ptr());
  uint16_t* dst = reinterpret_cast<uint16_t*>(tiles.data_ptr());
  for (int64_t r = 0; r < row_tiles * 16; ++r) {
    for (int64_t d = 0; d < depth_tiles; ++d) {
      uint16_t* row = dst + ((r / 16) * depth_tiles + d) * kTileElems + (r % 16) * 32;
      const int64_t width = r < rows ? std::min<int64_t>(kTileDepth, k - d * kTileDepth) : 0;
      if (width > 0) std::copy_n(src + r * k + d * kTileDepth, width, row);
      std::fill(row + width, row + kTileDepth, uint16_t{0});
    }
  }
  return tiles;
}

at::Tensor amx_bf16_linear(const at::Tensor& x_in, const at::Tensor& w_tiles, int64_t out_features,
                           const std::optional<at::Tensor>& bias, bool float_output) {
  TORCH_CHECK(x_in.dim() == 2, "amx_bf16_linear: x must be 2-D, got ", x_in.dim(), "-D");
  TORCH_CHECK(w_tiles.dim() == 3 && w_tiles.size(2) == kTileElems && w_tiles.scalar_type() == at::kShort &&
                  w_tiles.is_contiguous(),
              "amx_bf16_linear: the weight must be contiguous int16 [N/16, K/32, 512]");
  const int64_t rows = x_in.size(0), k = x_in.size(1), depth_tiles = w_tiles.size(1);
  TORCH_CHECK(depth_tiles == (k + kTileDepth - 1) / kTileDepth, "amx_bf16_linear: x has ", k,
              " columns, the weight ", depth_tiles * kTileDepth);
  TORCH_CHECK(out_features > (w_tiles.size(0) - 1) * kTileCols && out_features <= w_tiles.size(0) * kTileCols,
              "amx_bf16_linear: ", out_features, " outputs do not fit ", w_tiles.size(0), " column tiles");
  TORCH_CHECK(pagedmodel_amx::permitted(), "amx_bf16_linear: the kernel refused AMX tile state (arch_prctl)");
  const at::Tensor x = x_in.to(at::kBFloat16).contiguous();
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    bias_f = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bias_f.numel() == out_features, "amx_bf16_linear: bias has ", bias_f.numel(), " values");
  }
  at::Tensor y = at::empty({rows, out_features}, x.options().dtype(float_output ? at::kFloat : at::kBFloat16));
  if (rows == 0) return y;
  const int64_t row_tiles = (rows + 15) / 16;
  const at::Tensor x_tiles = x_in_tiles(x, row_tiles, depth_tiles);
  const uint16_t* w = reinterpret_cast<const uint16_t*>(w_tiles.data_ptr());
  const Problem p{reinterpret_cast<const uint16_t*>(x_tiles.data_ptr()), w, w + w_tiles.numel(), depth_tiles,
                  row_tiles, rows, out_features, bias_f.defined() ? bias_f.data_ptr<float>() : nullptr, y.data_ptr(),
                  float_output};
  at::parallel_for(0, w_tiles.size(0), 1, [&](int64_t begin, int64_t end) {
    pagedmodel_amx::configure(7);   // 0-3 accumulators, 4-5 x tiles, 6 the weight tile
    for (int64_t col = begin; col < end; ++col)
      for (int64_t t = 0; t < row_tiles; t += kRowTiles)
        column_tile(p, col, t, static_cast<int>(std::min<int64_t>(kRowTiles, row_tiles - t)));
    _tile_release();
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedmodel, m) {
  m.def("amx_bf16_linear(Tensor x, Tensor w_tiles, int out_features, Tensor? bias, bool float_output) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedmodel, CPU, m) { m.impl("amx_bf16_linear", &amx_bf16_linear); }

#endif

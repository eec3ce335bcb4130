// Causal attention of a prompt chunk over its own sequence's paged bf16 K/V, on VDPBF16PS.
//
// Why: torch's CPU bmm has no bf16 x bf16 -> float32 form, so the torch path
// (torch_attention.prefill_attention) multiplies q.k in float32 at half the bf16 rate, and writes the
// scores, the causal mask, the softmax and a bf16 copy of the probabilities as separate passes over
// memory. Here one tile of query rows goes through q.k, softmax and p.v while its scores stay in L1/L2,
// and both products run on VDPBF16PS (32 bf16 products summed in pairs into 16 float32 lanes).
//
// Numerics match the torch path's: q and k are bf16 as the model made them, so each q.k product is
// exact in float32 and only the order of the sums differs; scores and softmax are float32; the
// probabilities are rounded to bf16 for the product with V (as the torch path and flash attention on
// GPUs do), left unnormalised until the float32 output is divided by their sum.
//
// Layouts VDPBF16PS reads, packed per kv head once per call (O(context x dim), against the products'
// O(rows x context x dim)):
//   keys   [key / 16][dim / 2][16] dwords: lane l of dword-vector (b, p) = (K[16b + l][2p], K[16b + l][2p + 1])
//   values [key / 2][dim / 16][16] dwords: lane l of (t, c) = (V[2t][16c + l], V[2t + 1][16c + l])
// so q.k broadcasts a query row's dim pair against 16 keys, and p.v a row's pair of probabilities
// against 16 dims of two keys. Padding keys are zero, and their probabilities are zero.
//
// Built with the other CPU ops (pagedmodel/kernels/cpu_paged_attention.py); registered only where the
// build has AVX512-BF16, as torch.ops.pagedmodel.bf16_prefill_attention.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_amx_tiles.h"
#include "cpu_vector_math.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

namespace {

constexpr int kRows = 6;       // query rows per tile: 12 q.k and 24 p.v accumulators, within 32 registers
constexpr int64_t kKeys = 32;  // keys per q.k step (two vectors of 16)

struct Shape {
  int64_t q_len, q_heads, kv_heads, dim, block_size, seq_len, first_key;
  int64_t keys;    // seq_len rounded up to kKeys: the packed length
  int64_t group() const { return q_heads / kv_heads; }
  int64_t rows() const { return q_len * group(); }   // a kv head's query rows: (position, head in group)
};

// One kv head's context in the two packed layouts (see the top of the file).
void pack_head(const uint16_t* cache, int64_t plane, const int32_t* table, const Shape& s, int64_t head,
               uint32_t* keys, uint32_t* values) {
  const int64_t pairs = s.dim / 2, token_stride = s.kv_heads * s.dim;
  std::memset(keys, 0, s.keys * pairs * sizeof(uint32_t));
  std::memset(values, 0, s.keys * pairs * sizeof(uint32_t));
  for (int64_t j = 0; j < s.seq_len; ++j) {
    const int64_t slot = static_cast<int64_t>(table[j / s.block_size]) * s.block_size + j % s.block_size;
    const uint16_t* k = cache + slot * token_stride + head * s.dim;
    const uint16_t* v = k + plane;
    uint32_t* kb = keys + (j / 16) * pairs * 16 + j % 16;
    for (int64_t p = 0; p < pairs; ++p) kb[p * 16] = static_cast<uint32_t>(k[2 * p]) | static_cast<uint32_t>(k[2 * p + 1]) << 16;
    uint32_t* vt = values + (j / 2) * s.dim;   // (dim / 16) vectors of 16 dwords
    const int shift = (j % 2) * 16;
    for (int64_t d = 0; d < s.dim; ++d) vt[d] |= static_cast<uint32_t>(v[d]) << shift;
  }
}

// scores[r * ld + j] = q_r . k_j for the tile's rows and keys [0, keys)
void tile_scores(const uint32_t* const* q, const uint32_t* packed_keys, int64_t pairs, int64_t keys, float* scores,
                 int64_t ld) {
  for (int64_t j0 = 0; j0 < keys; j0 += kKeys) {
    __m512 acc[kRows][2];
    for (int r = 0; r < kRows; ++r) acc[r][0] = _mm512_setzero_ps(), acc[r][1] = _mm512_setzero_ps();
    const uint32_t* k0 = packed_keys + (j0 / 16) * pairs * 16;
    const uint32_t* k1 = k0 + pairs * 16;
    for (int64_t p = 0; p < pairs; ++p) {
      const __m512bh a = (__m512bh)_mm512_loadu_si512(k0 + p * 16);
      const __m512bh b = (__m512bh)_mm512_loadu_si512(k1 + p * 16);
#pragma GCC unroll 6
      for (int r = 0; r < kRows; ++r) {
        const __m512bh qp = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r][p]));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qp, a);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qp, b);
      }
    }
    for (int r = 0; r < kRows; ++r) {
      _mm512_storeu_ps(scores + r * ld + j0, acc[r][0]);
      _mm512_storeu_ps(scores + r * ld + j0 + 16, acc[r][1]);
    }
  }
}

// One row's softmax over its visible keys [0, visible), written as unnormalised bf16 weights up to
// `keys` (zeros past `visible`); returns the weights' sum (of the float32 values before rounding).
float row_softmax(const float* s, int64_t visible, int64_t keys, float scale, uint16_t* weights) {
  const __m512 m = _mm512_set1_ps(pagedmodel_cpu::row_max(s, visible)), factor = _mm512_set1_ps(scale);
  __m512 total = _mm512_setzero_ps();
  for (int64_t j = 0; j < keys; j += 16) {
    const int64_t live = std::clamp<int64_t>(visible - j, 0, 16);
    const __mmask16 mask = static_cast<__mmask16>((1u << live) - 1);
    const __m512 e = _mm512_maskz_mov_ps(mask, pagedmodel_cpu::exp_nonpositive16(_mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + j), m), factor)));
    total = _mm512_add_ps(total, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(weights + j), (__m256i)_mm512_cvtneps_pbh(e));   // nearest even
  }
  return _mm512_reduce_add_ps(total);
}

// out_r[d] = sum_j w_r[j] v_j[d] / sums[r] for the tile's rows, 64 dims (4 vectors) per pass over the keys
void tile_values(const uint16_t* weights, int64_t ld, const uint32_t* packed_values, int64_t keys, int64_t dim,
                 const float* sums, uint16_t* const* out) {
  for (int64_t c0 = 0; c0 < dim / 16; c0 += 4) {
    __m512 acc[kRows][4];
    for (int r = 0; r < kRows; ++r)
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < keys / 2; ++t) {
      const uint32_t* vt = packed_values + t * dim + c0 * 16;
      __m512bh v[4];
      for (int c = 0; c < 4; ++c) v[c] = (__m512bh)_mm512_loadu_si512(vt + c * 16);
#pragma GCC unroll 6
      for (int r = 0; r < kRows; ++r) {
        uint32_t pair;
        std::memcpy(&pair, weights + r * ld + 2 * t, sizeof pair);
        const __m512bh wp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], wp, v[c]);
      }
    }
#pragma GCC unroll 6
    for (int r = 0; r < kRows; ++r) {
      const __m512 inv = _mm512_set1_ps(1.f / sums[r]);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c)   // rounded to nearest even
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[r] + (c0 + c) * 16),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][c], inv)));
    }
  }
}

// The inputs' shape, checked; `key_multiple` is what the packed context is rounded up to.
Shape checked_shape(const char* op, const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_table,
                    int64_t seq_len, double scale, int64_t key_multiple) {
  TORCH_CHECK(query.dim() == 3 && kv_cache.dim() == 5 && block_table.dim() == 1, op, ": bad ranks");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && kv_cache.scalar_type() == at::kBFloat16, op,
              ": query and cache must be bfloat16");
  TORCH_CHECK(block_table.scalar_type() == at::kInt, op, ": block_table must be int32");
  TORCH_CHECK(query.is_contiguous() && kv_cache.is_contiguous() && block_table.is_contiguous(), op,
              ": inputs must be contiguous");
  Shape s{query.size(0), query.size(1), kv_cache.size(3), query.size(2), kv_cache.size(2), seq_len,
          seq_len - query.size(0), 0};
  s.keys = (seq_len + key_multiple - 1) / key_multiple * key_multiple;
  TORCH_CHECK(kv_cache.size(0) == 2 && kv_cache.size(4) == s.dim && s.q_heads % s.kv_heads == 0 && s.dim % 64 == 0, op,
              ": shape mismatch (head dim must be a multiple of 64)");
  TORCH_CHECK(scale > 0, op, ": scale must be positive, got ", scale);
  TORCH_CHECK(s.q_len >= 1 && s.first_key >= 0, op, ": ", s.q_len, " query rows over a context of ", seq_len);
  const int64_t blocks = (seq_len + s.block_size - 1) / s.block_size;
  TORCH_CHECK(blocks <= block_table.numel(), op, ": context of ", seq_len, " needs ", blocks, " blocks, the table has ",
              block_table.numel());
  const int32_t* table = block_table.data_ptr<int32_t>();
  for (int64_t b = 0; b < blocks; ++b)
    TORCH_CHECK(table[b] >= 0 && table[b] < kv_cache.size(1), op, ": block id ", table[b], " out of range");
  return s;
}

// Every kv head's context in the two packed layouts, head after head.
struct PackedContext {
  int64_t head_words;
  std::vector<uint32_t> keys, values;
  const uint32_t* head_keys(int64_t h) const { return keys.data() + h * head_words; }
  const uint32_t* head_values(int64_t h) const { return values.data() + h * head_words; }
};

PackedContext pack_context(const at::Tensor& kv_cache, const at::Tensor& block_table, const Shape& s) {
  const auto* cache = reinterpret_cast<const uint16_t*>(kv_cache.data_ptr<at::BFloat16>());
  const int64_t plane = kv_cache.size(1) * s.block_size * s.kv_heads * s.dim;
  PackedContext packed{s.keys * s.dim / 2, {}, {}};
  packed.keys.resize(s.kv_heads * packed.head_words);
  packed.values.resize(s.kv_heads * packed.head_words);
  at::parallel_for(0, s.kv_heads, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h)
      pack_head(cache, plane, block_table.data_ptr<int32_t>(), s, h, packed.keys.data() + h * packed.head_words,
                packed.values.data() + h * packed.head_words);
  });
  return packed;
}

at::Tensor bf16_prefill_attention(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_table,
                                  int64_t seq_len, double scale) {
  const Shape s = checked_shape("bf16_prefill_attention", query, kv_cache, block_table, seq_len, scale, kKeys);
  const PackedContext packed = pack_context(kv_cache, block_table, s);
  const auto* q = reinterpret_cast<const uint16_t*>(query.data_ptr<at::BFloat16>());
  at::Tensor out = at::empty_like(query);
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());

  const int64_t tiles = (s.rows() + kRows - 1) / kRows, items = s.kv_heads * tiles;
  std::atomic<int64_t> next{0};   // items handed out last tile first: the longest go first
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> scores(kRows * s.keys);
    std::vector<uint16_t> weights(kRows * s.keys), discard(s.dim);   // discard: padding rows' output
    for (int64_t taken = next++; taken < items; taken = next++) {
      const int64_t h = taken % s.kv_heads, tile = tiles - 1 - taken / s.kv_heads;
      const uint32_t* rows_q[kRows];
      uint16_t* rows_out[kRows];
      int64_t visible[kRows];
      for (int r = 0; r < kRows; ++r) {
        const int64_t row = std::min(tile * kRows + r, s.rows() - 1);   // padding rows repeat the last one
        const int64_t pos = row / s.group(), head = h * s.group() + row % s.group();
        const int64_t at = (pos * s.q_heads + head) * s.dim;
        rows_q[r] = reinterpret_cast<const uint32_t*>(q + at);
        rows_out[r] = tile * kRows + r < s.rows() ? o + at : discard.data();
        visible[r] = s.first_key + pos + 1;
      }
      const int64_t keys_needed = (visible[kRows - 1] + kKeys - 1) / kKeys * kKeys;
      tile_scores(rows_q, packed.head_keys(h), s.dim / 2, keys_needed, scores.data(), s.keys);
      float sums[kRows];
      for (int r = 0; r < kRows; ++r)
        sums[r] = row_softmax(scores.data() + r * s.keys, visible[r], keys_needed, static_cast<float>(scale),
                              weights.data() + r * s.keys);
      tile_values(weights.data(), s.keys, packed.head_values(h), keys_needed, s.dim, sums, rows_out);
    }
  });
  return out;
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// The same attention on AMX tiles, where the CPU has them. One item is 16 positions of one query head:
// q.k as [16 x dim] x [dim x 16 keys] tile products, four key tiles (64 keys) per pass over the dims;
// the 16 rows' softmax on AVX-512 as above; p.v as [16 x 32 keys] x [32 keys x 16 dims] products, four
// dim tiles (64 dims) per pass over the keys. The packed layouts above are already AMX's B operands:
// a 16-key block's 16 dim pairs are one key tile (rows 64 bytes apart), and 16 key pairs' 16 dims one
// value tile (rows dim x 4 bytes apart). Tiles 0-3 accumulate, 4 holds the query or weight rows, 5-6
// the key or value tiles. Products are exact in float32 as on VDPBF16PS; the tile unit reads bf16
// denormals as zero, which no softmax weight that matters is.
constexpr int64_t kAmxRows = 16;   // positions per item: one tile's rows
constexpr int64_t kAmxKeys = 64;   // keys per q.k pass (and the packed context's rounding)

// scores[r * ld + j] = q_r . k_j for the 16 rows of q_rows ([16, dim] bf16) and keys [0, keys)
void amx_scores(const uint16_t* q_rows, int64_t dim, const uint32_t* packed_keys, int64_t keys, float* scores,
                int64_t ld) {
  const int64_t block_words = dim / 2 * 16;   // one 16-key block, all its dim pairs
  for (int64_t j0 = 0; j0 < keys; j0 += kAmxKeys) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const uint32_t* k = packed_keys + (j0 / 16) * block_words;
    for (int64_t d = 0; d < dim / 32; ++d) {
      const uint32_t* kd = k + d * 16 * 16;   // dim pairs 16d .. 16d + 15
      _tile_loadd(4, q_rows + d * 32, dim * 2);
      _tile_loadd(5, kd, 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, kd + block_words, 64);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(5, kd + 2 * block_words, 64);
      _tile_dpbf16ps(2, 4, 5);
      _tile_loadd(6, kd + 3 * block_words, 64);
      _tile_dpbf16ps(3, 4, 6);
    }
    _tile_stored(0, scores + j0, ld * 4);
    _tile_stored(1, scores + j0 + 16, ld * 4);
    _tile_stored(2, scores + j0 + 32, ld * 4);
    _tile_stored(3, scores + j0 + 48, ld * 4);
  }
}

// out row r (rows_out[r], for the real rows) = sum_j w_r[j] v_j / sums[r], keys a multiple of 32
void amx_values(const uint16_t* weights, int64_t ld, const uint32_t* packed_values, int64_t keys, int64_t dim,
                const float* sums, uint16_t* const* rows_out, int64_t rows) {
  alignas(64) float acc[4][256];
  for (int64_t c0 = 0; c0 < dim / 16; c0 += 4) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t t0 = 0; t0 < keys; t0 += 32) {
      const uint32_t* v = packed_values + (t0 / 2) * dim + c0 * 16;   // key pairs t0/2 .., dims 16 c0 ..
      _tile_loadd(4, weights + t0, ld * 2);
      _tile_loadd(5, v, dim * 4);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, v + 16, dim * 4);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(5, v + 32, dim * 4);
      _tile_dpbf16ps(2, 4, 5);
      _tile_loadd(6, v + 48, dim * 4);
      _tile_dpbf16ps(3, 4, 6);
    }
    _tile_stored(0, acc[0], 64);
    _tile_stored(1, acc[1], 64);
    _tile_stored(2, acc[2], 64);
    _tile_stored(3, acc[3], 64);
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 inv = _mm512_set1_ps(1.f / sums[r]);
      for (int c = 0; c < 4; ++c)   // rounded to nearest even
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(rows_out[r] + (c0 + c) * 16),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(acc[c] + r * 16), inv)));
    }
  }
}

at::Tensor amx_prefill_attention(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_table,
                                 int64_t seq_len, double scale) {
  const Shape s = checked_shape("amx_prefill_attention", query, kv_cache, block_table, seq_len, scale, kAmxKeys);
  TORCH_CHECK(pagedmodel_amx::permitted(), "amx_prefill_attention: the kernel refused AMX tile state (arch_prctl)");
  const PackedContext packed = pack_context(kv_cache, block_table, s);
  const auto* q = reinterpret_cast<const uint16_t*>(query.data_ptr<at::BFloat16>());
  at::Tensor out = at::empty_like(query);
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());

  const int64_t blocks = (s.q_len + kAmxRows - 1) / kAmxRows, items = s.q_heads * blocks;
  std::atomic<int64_t> next{0};   // items handed out last block first: the longest go first
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    pagedmodel_amx::configure(7);
    std::vector<float> scores(kAmxRows * s.keys);
    std::vector<uint16_t> weights(kAmxRows * s.keys), q_rows(kAmxRows * s.dim);
    for (int64_t taken = next++; taken < items; taken = next++) {
      const int64_t head = taken % s.q_heads, pos0 = (blocks - 1 - taken / s.q_heads) * kAmxRows;
      const int64_t rows = std::min(kAmxRows, s.q_len - pos0), kv_head = head / s.group();
      uint16_t* rows_out[kAmxRows];
      for (int64_t r = 0; r < kAmxRows; ++r) {   // the block's query rows side by side, zeros past the last
        const int64_t at = ((pos0 + r) * s.q_heads + head) * s.dim;
        if (r < rows) std::memcpy(q_rows.data() + r * s.dim, q + at, s.dim * sizeof(uint16_t));
        else std::fill_n(q_rows.data() + r * s.dim, s.dim, uint16_t{0});
        rows_out[r] = r < rows ? o + at : nullptr;
      }
      const int64_t last_visible = s.first_key + pos0 + rows;
      const int64_t keys_needed = (last_visible + kAmxKeys - 1) / kAmxKeys * kAmxKeys;
      amx_scores(q_rows.data(), s.dim, packed.head_keys(kv_head), keys_needed, scores.data(), s.keys);
      float sums[kAmxRows];
      for (int64_t r = 0; r < kAmxRows; ++r)   // padding rows see what the last real row sees
        sums[r] = row_softmax(scores.data() + r * s.keys, s.first_key + pos0 + std::min(r, rows - 1) + 1, keys_needed,
                              static_cast<float>(scale), weights.data() + r * s.keys);
      amx_values(weights.data(), s.keys, packed.head_values(kv_head), keys_needed, s.dim, sums, rows_out, rows);
    }
    _tile_release();
  });
  return out;
}
#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedmodel, m) {
  m.def("bf16_prefill_attention(Tensor query, Tensor kv_cache, Tensor block_table, int seq_len, float scale) -> Tensor");
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  m.def("amx_prefill_attention(Tensor query, Tensor kv_cache, Tensor block_table, int seq_len, float scale) -> Tensor");
#endif
}

TORCH_LIBRARY_IMPL(pagedmodel, CPU, m) {
  m.impl("bf16_prefill_attention", &bf16_prefill_attention);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  m.impl("amx_prefill_attention", &amx_prefill_attention);
#endif
}

#endif

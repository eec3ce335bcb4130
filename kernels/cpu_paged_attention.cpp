// Paged attention for short query rows on CPU, reading K/V in place from the paged cache.
//
// Row r of `query` ([R, q_heads, dim]; rows may be strided) attends to the first row_len[r] context
// tokens of the sequence whose block table is block_tables[row_seq[r]]. A decode row has row_len = seq_len; row
// j of a chunk of q_len rows over a context of seq_len has row_len = seq_len - q_len + j + 1
// (causal). A work item is a row with all its kv heads (or, when rows are too few to keep the threads
// busy, a row and one kv head): it walks the row's own blocks once for keys and once for values, for
// all the query heads sharing each kv head (GQA), so the cost is the sum of the rows' own lengths --
// never batch x longest -- and nothing is copied or upcast up front. Accumulation is float32 whatever
// the cache dtype (float32, bfloat16, float16). The generic steps convert each block to float32 once
// per item into a small buffer that stays in L1, which the group's query heads all read; their loops
// are shaped for the compiler's vectorizer, so the same source builds for AVX2 or anything else with
// -march=native. Where the build has AVX-512 and the head dim is 64 or 128, intrinsic steps read the
// cache in place and reduce 16 tokens' q.k sums at once (1.6x faster decode attention on SmolLM2's
// shapes, bf16, one thread; PAGEDMODEL_CPU_ATTENTION_GENERIC=1 keeps the generic steps, for A/B runs).
//
// Built at run time by pagedmodel/kernels/cpu_paged_attention.py (torch.utils.cpp_extension), registered as
// torch.ops.pagedmodel.paged_rows_attention.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <numeric>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_vector_math.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using pagedmodel_cpu::to_float;

template <typename T>
inline void store(T* dst, float v) { *dst = static_cast<T>(v); }

// One block's rows of `width` consecutive cache values per token (one kv head, or all of them) as
// float32, token-major: out[i * width + c].
template <typename T>
inline void block_to_float(const T* base, int64_t n, int64_t token_stride, int64_t width, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    const T* src = base + i * token_stride;
    float* dst = out + i * width;
#pragma omp simd
    for (int64_t c = 0; c < width; ++c) dst[c] = to_float(src[c]);
  }
}

// Scores of one block for one kv head: s[g * stride + i] = q_g . k_i for the group's query heads, k_i
// at k + i * k_stride. Four tokens at a time, so each query chunk loaded feeds four dot products.
inline void block_scores(const float* q, const float* k, int64_t n, int64_t k_stride, int64_t group, int64_t dim,
                         float* s, int64_t stride) {
  for (int64_t g = 0; g < group; ++g) {
    const float* qg = q + g * dim;
    float* sg = s + g * stride;
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
      const float *k0 = k + i * k_stride, *k1 = k0 + k_stride, *k2 = k1 + k_stride, *k3 = k2 + k_stride;
      float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
      for (int64_t d = 0; d < dim; ++d) {
        a0 += qg[d] * k0[d];
        a1 += qg[d] * k1[d];
        a2 += qg[d] * k2[d];
        a3 += qg[d] * k3[d];
      }
      sg[i] = a0, sg[i + 1] = a1, sg[i + 2] = a2, sg[i + 3] = a3;
    }
    for (; i < n; ++i) {
      const float* ki = k + i * k_stride;
      float a = 0.f;
#pragma omp simd reduction(+ : a)
      for (int64_t d = 0; d < dim; ++d) a += qg[d] * ki[d];
      sg[i] = a;
    }
  }
}

// acc_g += sum_i p_g[i] v_i for one block and kv head (v_i at v + i * v_stride), four tokens per pass
// over acc_g: one load and store of the accumulator per four multiply-adds (a token at a time, each
// pass would wait on the last one's store). The vector loop is the d loop.
inline void block_values(const float* p, const float* v, int64_t n, int64_t v_stride, int64_t group, int64_t dim,
                         float* acc, int64_t stride) {
  for (int64_t g = 0; g < group; ++g) {
    const float* pg = p + g * stride;
    float* ag = acc + g * dim;
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
      const float *v0 = v + i * v_stride, *v1 = v0 + v_stride, *v2 = v1 + v_stride, *v3 = v2 + v_stride;
      const float p0 = pg[i], p1 = pg[i + 1], p2 = pg[i + 2], p3 = pg[i + 3];
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) ag[d] += p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d];
    }
    for (; i < n; ++i) {
      const float* vi = v + i * v_stride;
      const float pi = pg[i];
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) ag[d] += pi * vi[d];
    }
  }
}

// Cache lines asked for a few at a time from inside the compute loops: `step` issues the next
// `per_step` of the queued lines, `drain` the rest. Issued all at once before a chunk, a chunk's 96
// prefetches wait for the line fill buffers with the compute stuck behind them; spread over the
// chunk's token steps they overlap it (see the read-ahead note above rows_attention). They go to L2
// (the T2 hint), not L1: a request into L1 holds a fill buffer until its line arrives from DRAM, and
// those buffers are what the loads of the compute need too.
struct Trickle {
  std::vector<const char*> lines;
  int64_t next = 0, end = 0, per_step = 0;
  void step() {
    for (int64_t k = 0; k < per_step && next < end; ++k) __builtin_prefetch(lines[next++], 0, 1);
  }
  void drain() {
    while (next < end) __builtin_prefetch(lines[next++], 0, 1);
  }
};

#if defined(__AVX512F__)
// The same two steps with AVX-512 intrinsics, reading the cache in place (no float32 block buffer),
// for head dims that are a multiple of 16 (DC = dim / 16 vectors per row). Only q.k changes shape: the
// generic loop ends every dot product in a horizontal sum (about as many instructions as the dot
// product's own multiply-adds at dim 64); here the 16 tokens' partial-sum vectors of a query head are
// reduced together by one transpose-and-add tree (45 instructions for 16 sums, not ~130).

// 16 values of one float32 or float16 cache row as float32 (bf16 rows: load_row below)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

// One cache row's DC vectors as float32. A bf16 row is read 32 values (64 bytes) at a time, each run
// giving two vectors: its even-indexed values (shifted into the high half) and its odd ones (the low half
// masked off), one integer op each, where widening 16 values in order costs a cross-lane conversion as
// well (the port the reduction tree's shuffles also need). The q vectors and accumulators are kept in
// the same order (split_pairs), so nothing else changes.
template <int DC, typename T>
inline void load_row(const T* p, __m512* v) {
  for (int c = 0; c < DC; ++c) v[c] = load16(p + 16 * c);
}
template <int DC>
inline void load_row(const c10::BFloat16* p, __m512* v) {
  static_assert(DC % 2 == 0, "bf16 rows are read 32 values at a time");
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int c = 0; c < DC; c += 2) {
    const __m512i x = _mm512_loadu_si512(p + 16 * c);
    v[c] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    v[c + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, high));
  }
}

// out[t] = the sum of v[t]'s 16 lanes, for t < 16 (each level halves the vectors, adding lane pairs)
inline __m512 transpose_sum16(const __m512* v) {
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)   // 32-bit interleave: per 128-bit lane, v[2i]'s and v[2i+1]'s pair sums
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int j = 0; j < 4; ++j) {  // 64-bit interleave: per 128-bit lane, the lane sums of v[4j .. 4j+3]
    const __m512d a = _mm512_castps_pd(w[2 * j]), b = _mm512_castps_pd(w[2 * j + 1]);
    x[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int k = 0; k < 2; ++k)    // across 128-bit lanes: (0 + 1), (2 + 3)
    y[k] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * k], x[2 * k + 1], 0x88), _mm512_shuffle_f32x4(x[2 * k], x[2 * k + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xDD));
}

// The query heads of one kv head go G at a time (a tile), their q vectors (scores) or accumulators
// (values) held in registers across a chunk of tokens, so a token's key or value row, loaded once,
// meets G heads without a load or store of theirs in between. Before this a value pass loaded and
// stored every accumulator once per two tokens: a decode batch shaped like the uniform workload (64
// rows of 25-88 tokens, SmolLM2's 9/3 heads, bf16, DRAM-resident caches, one thread) took 0.38 ms a
// layer call, 0.32 ms with the tiles. Results are bit-identical (the same operations in the same order).

// scores for n <= 16 tokens and G query heads: q at q + g * DC * 16, k_i at k + i * k_stride, head g's
// scores to s + g * stride. `partial`: G * 16 vectors of scratch.
template <int DC, int G, typename T>
inline void tile_scores(const float* q, const T* k, int64_t n, int64_t k_stride, float* s, int64_t stride,
                        __m512* partial, Trickle& ahead) {
  __m512 qr[G][DC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < DC; ++c) qr[g][c] = _mm512_loadu_ps(q + (g * DC + c) * 16);
  for (int64_t i = 0; i < n; ++i) {
    __m512 kc[DC];
    load_row<DC>(k + i * k_stride, kc);
    ahead.step();
    for (int g = 0; g < G; ++g) {   // two chains: a dot product is not one long dependency
      __m512 a0 = _mm512_mul_ps(qr[g][0], kc[0]), a1 = _mm512_mul_ps(qr[g][1], kc[1]);
      for (int c = 2; c < DC; ++c) {
        if (c & 1) a1 = _mm512_fmadd_ps(qr[g][c], kc[c], a1);
        else a0 = _mm512_fmadd_ps(qr[g][c], kc[c], a0);
      }
      partial[g * 16 + i] = _mm512_add_ps(a0, a1);
    }
  }
  const __mmask16 live = static_cast<__mmask16>((1u << n) - 1);
  for (int g = 0; g < G; ++g) {
    for (int64_t i = n; i < 16; ++i) partial[g * 16 + i] = _mm512_setzero_ps();
    _mm512_mask_storeu_ps(s + g * stride, live, transpose_sum16(partial + g * 16));
  }
}

// acc_g += sum_i p_g[i] v_i for n tokens and G query heads (p_g at p + g * stride, acc_g at acc + g * DC * 16)
template <int DC, int G, typename T>
inline void tile_values(const float* p, const T* v, int64_t n, int64_t v_stride, float* acc, int64_t stride,
                        Trickle& ahead) {
  __m512 a[G][DC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < DC; ++c) a[g][c] = _mm512_loadu_ps(acc + (g * DC + c) * 16);
  for (int64_t i = 0; i < n; ++i) {
    __m512 vc[DC];
    load_row<DC>(v + i * v_stride, vc);
    ahead.step();
    for (int g = 0; g < G; ++g) {
      const __m512 pg = _mm512_set1_ps(p[g * stride + i]);
      for (int c = 0; c < DC; ++c) a[g][c] = _mm512_fmadd_ps(pg, vc[c], a[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < DC; ++c) _mm512_storeu_ps(acc + (g * DC + c) * 16, a[g][c]);
}

// Calls fn(first head, std::integral_constant<int, G>) over a kv head's `group` query heads in tiles
// of at most kTile heads: 16 vectors of q or accumulators (a zmm register file holds 32).
template <int DC>
constexpr int kTile = DC >= 16 ? 1 : 16 / DC;

template <int DC, int G = kTile<DC>, typename Fn>
inline void for_tiles(int64_t first, int64_t group, Fn&& fn) {
  if constexpr (G >= 1) {
    for (; first + G <= group; first += G) fn(first, std::integral_constant<int, G>{});
    if (first < group) for_tiles<DC, G - 1>(first, group, fn);   // the remainder, under G heads
  }
}

// how many tiles for_tiles makes of `group` query heads
template <int DC>
constexpr int64_t tile_calls(int64_t group) { return (group + kTile<DC> - 1) / kTile<DC>; }

template <int DC, typename T>
inline void block_scores_direct(const float* q, const T* k, int64_t n, int64_t k_stride, int64_t group, float* s,
                                int64_t stride, __m512* partial, Trickle& ahead) {
  for_tiles<DC>(0, group, [&](int64_t g0, auto tile) {
    tile_scores<DC, decltype(tile)::value>(q + g0 * DC * 16, k, n, k_stride, s + g0 * stride, stride, partial, ahead);
  });
}

template <int DC, typename T>
inline void block_values_direct(const float* p, const T* v, int64_t n, int64_t v_stride, int64_t group, float* acc,
                                int64_t stride, Trickle& ahead) {
  for_tiles<DC>(0, group, [&](int64_t g0, auto tile) {
    tile_values<DC, decltype(tile)::value>(p + g0 * stride, v, n, v_stride, acc + g0 * DC * 16, stride, ahead);
  });
}
#endif

// Whether load_row reads this cache dtype's rows as (even, odd) halves of each 32 values.
template <int DC, typename T>
constexpr bool kSplitsPairs = DC > 0 && std::is_same_v<T, c10::BFloat16>;

// x (n a multiple of 32) reordered in place the way load_row<bf16> reads a row: each run of 32 values
// becomes its 16 even-indexed values, then its 16 odd ones; join_pairs undoes it.
inline void split_pairs(float* x, int64_t n) {
  float run[32];
  for (int64_t base = 0; base < n; base += 32) {
    for (int i = 0; i < 16; ++i) run[i] = x[base + 2 * i], run[16 + i] = x[base + 2 * i + 1];
    std::copy(run, run + 32, x + base);
  }
}
inline void join_pairs(float* x, int64_t n) {
  float run[32];
  for (int64_t base = 0; base < n; base += 32) {
    for (int i = 0; i < 16; ++i) run[2 * i] = x[base + i], run[2 * i + 1] = x[base + 16 + i];
    std::copy(run, run + 32, x + base);
  }
}

// Asks for one cache row's `bytes` ahead of use: into L1 (Locality 3), L2 (2), or L2 with the T2 hint (1).
template <int Locality>
inline void prefetch_row(const void* row, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(static_cast<const char*>(row) + off, 0, Locality);
}

// A row's reads -- its key rows, then its value rows -- are asked for ahead of use: blocks sit anywhere
// in the cache, so the hardware prefetcher cannot follow from one to the next. Before a chunk of tokens
// is computed all its lines are asked for into L1 at once (the compute walks a chunk head by head, a
// few lines at a time, so its misses would otherwise come a few at a time), and the next L2_AHEAD
// tokens' lines into L2. On the mixed decode batch of benchmarks/attention_cost.py --block-sizes
// (DRAM-resident caches, 128-token blocks, one thread) this took a call from 1.17 to 0.77 ms; whole
// blocks ahead into L1 (the scheme before it) did no better than no prefetch at all: hundreds of
// prefetches at once fill the miss buffers and stall the compute they were meant to overlap.
// The AVX-512 steps go further (a `Trickle`): the lines of the chunk L1_AHEAD tokens ahead are queued
// and issued a few per token step inside the compute loops, so no burst of prefetches waits on the
// fill buffers with the compute stuck behind it. On an AMX Xeon (SmolLM2's 27-row mixed batch, 11,030
// context tokens, bf16, one thread, the two builds alternated in one process) a layer call took 0.94
// against 1.14 ms with DRAM-resident caches and 0.58 against 0.77 ms from the last-level cache; the
// trickle with an L2 stream beside it was slower than without one. Later, on 2 MB pages, the trickle's
// hint went from T0 (into L1) to T2 (into L2): 0.786 -> 0.734 ms a call from DRAM (the same batch and
// setup, medians of 8 alternated rounds; a plain read of scattered 128 KB blocks here streams 10.0 GB/s
// with no prefetch, 14.5 with T0 192 lines ahead, 15.9 with T2), alike from L2. With the bf16 rows read
// as even/odd halves (load_row) as well: 0.728 ms, and 0.103 -> 0.097 ms on an L2-resident batch.
constexpr int64_t L2_AHEAD = 64;
constexpr int64_t L1_AHEAD = 32;
constexpr int64_t CHUNK = 16;   // tokens per q.k reduction tree, and per prefetch into L1

// DC > 0: the AVX-512 block steps for head dim 16 * DC; 0: the generic ones.
template <int DC, typename T>
void rows_attention(const T* query, int64_t query_stride, const T* cache, const int32_t* tables,
                    const int64_t* row_seq, const int32_t* row_len, T* out, int64_t rows, int64_t q_heads,
                    int64_t kv_heads, int64_t dim, int64_t block_size, int64_t table_width, int64_t plane,
                    int64_t max_len, float scale) {
  const int64_t group = q_heads / kv_heads;
  const int64_t token_stride = kv_heads * dim;  // one slot holds every kv head's row
  const int64_t threads = at::get_num_threads();
  // A work item is a row's kv heads `span` at a time. All of them when rows are plentiful: a slot
  // holds every head's row, so a block is then one contiguous read (per head it is block_size short
  // strided pieces, which is what left the op waiting on DRAM). One at a time when a few rows must
  // still spread over the threads.
  const int64_t span = rows >= 4 * threads ? kv_heads : 1;
  const int64_t parts = kv_heads / span, width = span * dim, heads = span * group;
  // Longest rows first, handed out one at a time: one long row among many short ones must not
  // leave every other thread idle at the end (a static split would give it one thread's range).
  std::vector<int64_t> order(rows);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return row_len[a] > row_len[b]; });
  std::atomic<int64_t> next{0};
  const int64_t items = rows * parts;
  const int64_t stride = std::max<int64_t>(max_len, 1);  // scores[j * stride + t], j a query head of the item
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<float> q(heads * dim), acc(heads * dim), scores(heads * stride), sums(heads);
    std::vector<float> block(DC > 0 ? 0 : block_size * width);  // the block being read, converted to float32
#if defined(__AVX512F__)
    std::vector<__m512> partial(DC > 0 ? group * 16 : 0);     // q.k partial sums awaiting their reduction
#endif
    const int64_t row_bytes = width * static_cast<int64_t>(sizeof(T)), row_lines = (row_bytes + 63) / 64;
    Trickle ahead;
    ahead.lines.resize(DC > 0 ? CHUNK * row_lines : 0);
    for (int64_t taken = next++; taken < items; taken = next++) {
      const int64_t r = order[taken / parts], h0 = (taken % parts) * span;
      const int64_t len = row_len[r], nblocks = (len + block_size - 1) / block_size;
      const int32_t* table = tables + row_seq[r] * table_width;
      // the item's query heads are consecutive: kv head h serves query heads h * group .. h * group + group - 1
      const T* qsrc = query + r * query_stride + h0 * group * dim;
#pragma omp simd
      for (int64_t c = 0; c < heads * dim; ++c) q[c] = to_float(qsrc[c]) * scale;
      if constexpr (kSplitsPairs<DC, T>) split_pairs(q.data(), heads * dim);
      auto block_base = [&](int64_t b, int64_t offset) {
        return cache + offset + (static_cast<int64_t>(table[b]) * block_size) * token_stride + h0 * dim;
      };
      auto tokens_in = [&](int64_t b) { return std::min(block_size, len - b * block_size); };
      // read u < 2 * len: key row u, or value row u - len
      auto read_row = [&](int64_t u) {
        const int64_t t = u < len ? u : u - len;
        return block_base(t / block_size, u < len ? 0 : plane) + (t % block_size) * token_stride;
      };
      // reads [0, in_l1) were asked for by the near read-ahead (into L1 in the generic steps, L2 by the
      // AVX-512 steps' trickle), [0, in_l2) by the generic steps' far one into L2
      int64_t in_l1 = 0, in_l2 = 0;
      auto prefetch_before = [&](int64_t end) {   // reads [.., end) are next
        for (const int64_t stop = std::min(end + L2_AHEAD, 2 * len); in_l2 < stop; ++in_l2)
          prefetch_row<2>(read_row(in_l2), row_bytes);
        for (const int64_t stop = std::min(end, 2 * len); in_l1 < stop; ++in_l1) prefetch_row<3>(read_row(in_l1), row_bytes);
      };
      // the AVX-512 steps' read-ahead: the first L1_AHEAD reads at once, then before the chunk of reads
      // from u0 the lines of [u0 + L1_AHEAD, u0 + CHUNK + L1_AHEAD) queued, a share for each of `steps`
      auto queue_ahead = [&](int64_t u0, int64_t steps) {
        ahead.next = ahead.end = 0;
        for (const int64_t stop = std::min(u0 + CHUNK + L1_AHEAD, 2 * len); in_l1 < stop; ++in_l1) {
          const char* line = reinterpret_cast<const char*>(read_row(in_l1));
          for (int64_t l = 0; l < row_lines; ++l, line += 64) ahead.lines[ahead.end++] = line;
        }
        ahead.per_step = (ahead.end + steps - 1) / steps;
      };
      if constexpr (DC > 0)
        for (; in_l1 < std::min(L1_AHEAD, 2 * len); ++in_l1) prefetch_row<1>(read_row(in_l1), row_bytes);   // into L2
      for (int64_t b = 0; b < nblocks; ++b) {
        const int64_t n = tokens_in(b);
#if defined(__AVX512F__)
        if constexpr (DC > 0) {
          for (int64_t i0 = 0; i0 < n; i0 += CHUNK) {
            const int64_t m = std::min<int64_t>(CHUNK, n - i0);
            queue_ahead(b * block_size + i0, m * span * tile_calls<DC>(group));
            for (int64_t hh = 0; hh < span; ++hh)
              block_scores_direct<DC>(q.data() + hh * group * dim, block_base(b, 0) + hh * dim + i0 * token_stride, m,
                                      token_stride, group, scores.data() + hh * group * stride + b * block_size + i0,
                                      stride, partial.data(), ahead);
            ahead.drain();
          }
          continue;
        }
#endif
        prefetch_before((b + 1) * block_size);
        block_to_float(block_base(b, 0), n, token_stride, width, block.data());
        for (int64_t hh = 0; hh < span; ++hh)
          block_scores(q.data() + hh * group * dim, block.data() + hh * dim, n, width, group, dim,
                       scores.data() + hh * group * stride + b * block_size, stride);
      }
      for (int64_t j = 0; j < heads; ++j) {
        float* sj = scores.data() + j * stride;
        const float m = pagedmodel_cpu::row_max(sj, len);
        float total = 0.f;
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < len; ++t) {
          sj[t] = pagedmodel_cpu::exp_nonpositive(sj[t] - m);
          total += sj[t];
        }
        sums[j] = total;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t b = 0; b < nblocks; ++b) {
        const int64_t n = tokens_in(b);
#if defined(__AVX512F__)
        if constexpr (DC > 0) {
          for (int64_t i0 = 0; i0 < n; i0 += CHUNK) {
            const int64_t m = std::min<int64_t>(CHUNK, n - i0);
            queue_ahead(len + b * block_size + i0, m * span * tile_calls<DC>(group));
            for (int64_t hh = 0; hh < span; ++hh)
              block_values_direct<DC>(scores.data() + hh * group * stride + b * block_size + i0,
                                      block_base(b, plane) + hh * dim + i0 * token_stride, m, token_stride, group,
                                      acc.data() + hh * group * dim, stride, ahead);
            ahead.drain();
          }
          continue;
        }
#endif
        prefetch_before(len + (b + 1) * block_size);
        block_to_float(block_base(b, plane), n, token_stride, width, block.data());
        for (int64_t hh = 0; hh < span; ++hh)
          block_values(scores.data() + hh * group * stride + b * block_size, block.data() + hh * dim, n, width,
                       group, dim, acc.data() + hh * group * dim, stride);
      }
      if constexpr (kSplitsPairs<DC, T>) join_pairs(acc.data(), heads * dim);
      T* dst = out + (r * q_heads + h0 * group) * dim;
      for (int64_t j = 0; j < heads; ++j) {
        const float inv = 1.f / sums[j];
        for (int64_t d = 0; d < dim; ++d) store(dst + j * dim + d, acc[j * dim + d] * inv);
      }
    }
  });
}

// Calls fn with std::integral_constant<int, DC>: the AVX-512 steps' DC for head dims 64 and 128 when
// the build has AVX-512 and PAGEDMODEL_CPU_ATTENTION_GENERIC is unset, else 0 (the generic steps).
template <typename Fn>
void dispatch_dim(int64_t dim, Fn&& fn) {
#if defined(__AVX512F__)
  static const bool generic = std::getenv("PAGEDMODEL_CPU_ATTENTION_GENERIC") != nullptr;
  if (!generic && dim == 64) return fn(std::integral_constant<int, 4>{});
  if (!generic && dim == 128) return fn(std::integral_constant<int, 8>{});
#endif
  fn(std::integral_constant<int, 0>{});
}

at::Tensor paged_rows_attention(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                                const at::Tensor& row_seq, const at::Tensor& row_len, double scale) {
  TORCH_CHECK(query.dim() == 3 && kv_cache.dim() == 5 && block_tables.dim() == 2, "bad ranks");
  TORCH_CHECK(kv_cache.is_contiguous() && block_tables.is_contiguous(), "kv_cache and block_tables must be contiguous");
  // rows may be strided (the queries of the fused qkv projection's output); each row's heads are one run
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2), "each query row's heads must be contiguous");
  TORCH_CHECK(query.device().is_cpu() && kv_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type(), "query and cache dtypes differ");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && row_len.scalar_type() == at::kInt &&
              row_seq.scalar_type() == at::kLong, "block_tables/row_len int32, row_seq int64");
  const int64_t rows = query.size(0), q_heads = query.size(1), dim = query.size(2);
  const int64_t kv_heads = kv_cache.size(3), block_size = kv_cache.size(2);
  TORCH_CHECK(kv_cache.size(0) == 2 && kv_cache.size(4) == dim && q_heads % kv_heads == 0, "shape mismatch");
  TORCH_CHECK(row_seq.numel() == rows && row_len.numel() == rows, "one row_seq/row_len per query row");
  const int64_t plane = kv_cache.size(1) * block_size * kv_heads * dim;
  at::Tensor out = at::empty(query.sizes(), query.options());
  const auto* tables = block_tables.data_ptr<int32_t>();
  const auto* seq = row_seq.data_ptr<int64_t>();
  const auto* len = row_len.data_ptr<int32_t>();
  const int64_t width = block_tables.size(1), num_seqs = block_tables.size(0);
  int64_t max_len = 0;  // sizes the score buffers; read here, so no caller's bound can overflow them
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(len[r] >= 1 && len[r] <= width * block_size, "row ", r, ": length ", len[r], " outside [1, ",
                width * block_size, "]");
    TORCH_CHECK(seq[r] >= 0 && seq[r] < num_seqs, "row ", r, ": sequence ", seq[r], " has no block table");
    max_len = std::max<int64_t>(max_len, len[r]);
    const int32_t* table = tables + seq[r] * width;
    for (int64_t b = 0; b < (len[r] + block_size - 1) / block_size; ++b)
      TORCH_CHECK(table[b] >= 0 && table[b] < kv_cache.size(1), "row ", r, ": block id ", table[b], " out of range");
  }
  const float s = static_cast<float>(scale);
  switch (query.scalar_type()) {
    case at::kFloat:
      dispatch_dim(dim, [&](auto dc) {
        rows_attention<decltype(dc)::value>(query.data_ptr<float>(), query.stride(0), kv_cache.data_ptr<float>(), tables,
                                            seq, len, out.data_ptr<float>(), rows, q_heads, kv_heads, dim, block_size,
                                            width, plane, max_len, s);
      });
      break;
    case at::kBFloat16:
      dispatch_dim(dim, [&](auto dc) {
        rows_attention<decltype(dc)::value>(query.data_ptr<c10::BFloat16>(), query.stride(0),
                                            kv_cache.data_ptr<c10::BFloat16>(), tables, seq, len,
                                            out.data_ptr<c10::BFloat16>(), rows, q_heads, kv_heads, dim, block_size,
                                            width, plane, max_len, s);
      });
      break;
    case at::kHalf:
      dispatch_dim(dim, [&](auto dc) {
        rows_attention<decltype(dc)::value>(query.data_ptr<c10::Half>(), query.stride(0), kv_cache.data_ptr<c10::Half>(),
                                            tables, seq, len, out.data_ptr<c10::Half>(), rows, q_heads, kv_heads, dim,
                                            block_size, width, plane, max_len, s);
      });
      break;
    default:
      TORCH_CHECK(false, "unsupported dtype ", query.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(pagedmodel, m) {
  m.def("paged_rows_attention(Tensor query, Tensor kv_cache, Tensor block_tables, Tensor row_seq, Tensor row_len, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedmodel, CPU, m) { m.impl("paged_rows_attention", &paged_rows_attention); }

// One random token per row of a [rows, vocab] float32 (or bf16) logits matrix under each row's temperature,
// top-k, min-p and top-p, drawn by inverse CDF over the kept tokens in token-id order with the row's
// own uniform number: what random_sampling.py's torch path does, in a few passes over each row
// instead of a softmax, a partial top-k and sometimes a sort of the whole [rows, vocab] block
// (90 of a 357 ms step at 256 top-p rows on one thread, where greedy rows cost 7).
//
// Per row, with the row and one buffer of its exp terms resident in L2:
//   1. the row's max (raw logits; dividing by the temperature keeps the order);
//   2. top-k's k-th largest raw logit, if asked (nth_element on a copy);
//   3. e[t] = exp((l[t] - max) / T) for the tokens top-k keeps (0 for the others, and below e^-87); min-p zeroes
//      e[t] < min_p (the max's term is 1, so that is p[t] < min_p * p_max);
//   4. top-p: the nucleus is the tokens sorted by e descending while the mass before them is below
//      top_p * sum(e). Tokens under (1 - top_p) * sum / (2 * vocab) can never be in it (all of them
//      together hold under half the mass the nucleus leaves out), so only the others are binned, by
//      their float bits (monotone in e: 16 bins per octave); the bin where the running mass crosses
//      the target is the only one sorted. The result is a cut: e > e_cut, or e == e_cut and id <= id_cut;
//   5. the draw: chunk sums of the kept terms in id order, then the first token whose running mass
//      reaches (1 - u) * total (the same additions make the total, so the target is always reached).
//
// Built with the other CPU ops by pagedmodel/kernels/cpu_paged_attention.py; registered as
// torch.ops.pagedmodel.sample_from_logits.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "cpu_vector_math.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int kBins = 1024;       // 16 per octave: e down to 2^-64, the rest in the last bin
constexpr int kBinShift = 19;     // drop all but the top 4 mantissa bits
constexpr int64_t kChunk = 256;   // the draw's chunk of token ids

struct RowParams {
  float temperature, top_p, min_p, uniform;
  int64_t top_k;
};

struct Cut {  // a token is kept when e > value, or e == value and its id <= id
  float value = 0.f;
  int64_t id = -1;
};

inline int32_t float_bits(float x) {
  int32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

// e = exp((l - max) / T) for the tokens top-k keeps (l >= kept_from), 0 for the rest; returns sum(e).
// One multiply by 1 / T, not a division per token (a vector division costs as much as the exp here).
float exp_terms(const float* logits, int64_t vocab, float inverse_temperature, float raw_max, float kept_from,
                float* e) {
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t t = 0; t < vocab; ++t) {
    const float x = logits[t], power = (x - raw_max) * inverse_temperature;
    // below e^-87 a term is not a normal float: 0, as torch's softmax all but gives it (not exp's clamp)
    const float term = x >= kept_from && power >= -87.f ? pagedmodel_cpu::exp_nonpositive(power) : 0.f;
    e[t] = term;
    total += term;
  }
  return total;
}

float drop_below(float* e, int64_t vocab, float min_term) {
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t t = 0; t < vocab; ++t) {
    e[t] = e[t] < min_term ? 0.f : e[t];
    total += e[t];
  }
  return total;
}

// The tokens with floor <= e (floor > 0): their terms and ids, in id order; returns how many.
int64_t compact_at_least(const float* e, int64_t vocab, float floor, float* terms, int32_t* ids) {
  int64_t n = 0, t = 0;
#if defined(__AVX512F__)
  const __m512 low = _mm512_set1_ps(floor);
  __m512i id = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  for (; t + 16 <= vocab; t += 16, id = _mm512_add_epi32(id, step)) {
    const __m512 v = _mm512_loadu_ps(e + t);
    const __mmask16 keep = _mm512_cmp_ps_mask(v, low, _CMP_GE_OQ);
    _mm512_mask_compressstoreu_ps(terms + n, keep, v);
    _mm512_mask_compressstoreu_epi32(ids + n, keep, id);
    n += __builtin_popcount(keep);
  }
#endif
  for (; t < vocab; ++t)
    if (e[t] >= floor) terms[n] = e[t], ids[n] = static_cast<int32_t>(t), ++n;
  return n;
}

// e's bin: its float bits counted down from 1.0's (monotone in e), 16 per octave
inline int32_t bin_of(float term) {
  return std::max<int32_t>(0, std::min<int32_t>(kBins - 1, (float_bits(1.f) - float_bits(term)) >> kBinShift));
}

// The top-p cut over e (dropped tokens are 0): see step 4 above. `terms` and `ids` hold vocab entries.
Cut nucleus_cut(const float* e, int64_t vocab, float total, float top_p, float* terms, int32_t* ids) {
  const float floor = std::max((1.f - top_p) * total / (2.f * static_cast<float>(vocab)),
                               std::numeric_limits<float>::min());
  const int64_t n = compact_at_least(e, vocab, floor, terms, ids);
  double binned[4][kBins] = {};   // four interleaved histograms: consecutive adds rarely wait on each other
  for (int64_t i = 0; i < n; ++i) binned[i & 3][bin_of(terms[i])] += terms[i];
  const double target = static_cast<double>(top_p) * total;
  double before = 0.0;
  int32_t crossing = kBins - 1;
  for (int32_t b = 0; b < kBins; ++b) {
    const double mass = binned[0][b] + binned[1][b] + binned[2][b] + binned[3][b];
    if (before + mass >= target) {
      crossing = b;
      break;
    }
    before += mass;
  }
  std::vector<std::pair<float, int32_t>> members;
  for (int64_t i = 0; i < n; ++i)
    if (bin_of(terms[i]) == crossing) members.emplace_back(terms[i], ids[i]);
  std::sort(members.begin(), members.end(), [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  });
  Cut cut;
  for (const auto& [term, t] : members) {  // the first member always stays: `before` is below the target
    if (before >= target) break;
    cut.value = term;
    cut.id = t;
    before += term;
  }
  return cut;   // no members (only if the sums went wrong, e.g. NaN): the cut keeps every nonzero term
}

// The kept term of token t under the cut (0 if dropped).
inline float kept(float term, int64_t t, Cut cut) {
  return (term > cut.value || (term == cut.value && t <= cut.id)) ? term : 0.f;
}

// Inverse CDF in id order over the kept terms; writes them to `kept_out` when given.
int64_t draw_kept(const float* e, int64_t vocab, Cut cut, float uniform, float* kept_out,
                  std::vector<double>& chunk_mass) {
  const int64_t chunks = (vocab + kChunk - 1) / kChunk;
  chunk_mass.assign(chunks, 0.0);
  double total = 0.0;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t lo = c * kChunk, hi = std::min(vocab, lo + kChunk);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = lo; t < hi; ++t) sum += kept(e[t], t, cut);
    chunk_mass[c] = sum;
    total += sum;
  }
  if (kept_out != nullptr)
    for (int64_t t = 0; t < vocab; ++t) kept_out[t] = kept(e[t], t, cut);
  const double target = (1.0 - static_cast<double>(uniform)) * total;   // 1 - u is in (0, 1]
  double before = 0.0;   // the same additions as the total's, in the same order: the target is reached
  for (int64_t c = 0; c < chunks; ++c) {
    if (chunk_mass[c] > 0.0 && before + chunk_mass[c] >= target) {
      const int64_t lo = c * kChunk, hi = std::min(vocab, lo + kChunk);
      int64_t pick = -1;
      double running = before;
      for (int64_t t = lo; t < hi; ++t) {
        const float term = kept(e[t], t, cut);
        if (term <= 0.f) continue;
        pick = t;
        running += term;
        if (running >= target) return t;
      }
      return pick;  // rounding inside the chunk: its last kept token
    }
    before += chunk_mass[c];
  }
  return 0;  // nothing kept (only NaN terms can do that: the max's term is 1)
}

struct RowBuffers {  // one set per worker, reused row after row
  std::vector<float> e, scratch, terms, widened;
  std::vector<int32_t> ids;
  std::vector<double> chunk_mass;
  RowBuffers(int64_t vocab, bool narrow) : e(vocab), terms(vocab), widened(narrow ? vocab : 0), ids(vocab) {}
};

// A bf16 row as float32 in the worker's buffer (exact: bf16 is a float32's top half). A bf16 head's
// logits then need no float32 copy of the whole [rows, vocab] block first (3.9 of a 98 ms bf16 step at
// 256 rows), only this one row, which stays in L2 for the passes that follow.
const float* widened_row(const c10::BFloat16* row, int64_t vocab, float* out) {
#pragma omp simd
  for (int64_t t = 0; t < vocab; ++t) out[t] = pagedmodel_cpu::to_float(row[t]);
  return out;
}

int64_t sample_row(const float* logits, int64_t vocab, RowParams p, float* kept_out, RowBuffers& buf) {
  float* e = buf.e.data();
  const float raw_max = pagedmodel_cpu::row_max(logits, vocab);
  if (!std::isfinite(raw_max)) {  // all -inf, or an inf/NaN logit: the first maximum, as greedy would pick
    for (int64_t t = 0; t < vocab; ++t)
      if (logits[t] == raw_max) return t;
    return 0;
  }
  float kept_from = -std::numeric_limits<float>::infinity();
  if (p.top_k > 0 && p.top_k < vocab) {  // the k-th largest logit (dividing by T > 0 keeps the order)
    buf.scratch.resize(vocab);
    for (int64_t t = 0; t < vocab; ++t)   // a NaN would break nth_element's ordering: it ranks last
      buf.scratch[t] = logits[t] != logits[t] ? -std::numeric_limits<float>::infinity() : logits[t];
    std::nth_element(buf.scratch.begin(), buf.scratch.begin() + (p.top_k - 1), buf.scratch.end(), std::greater<float>());
    kept_from = buf.scratch[p.top_k - 1];
  }
  float total = exp_terms(logits, vocab, 1.f / p.temperature, raw_max, kept_from, e);
  if (p.min_p > 0.f) total = drop_below(e, vocab, p.min_p);
  Cut cut;
  if (p.top_p < 1.f) cut = nucleus_cut(e, vocab, total, p.top_p, buf.terms.data(), buf.ids.data());
  return draw_kept(e, vocab, cut, p.uniform, kept_out, buf.chunk_mass);
}

at::Tensor sample_from_logits(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                              const at::Tensor& top_p, const at::Tensor& min_p, const at::Tensor& uniform,
                              const std::optional<at::Tensor>& kept_out) {
  TORCH_CHECK(logits.dim() == 2 && logits.device().is_cpu() &&
                  (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16),
              "logits must be a 2-D float32 or bfloat16 CPU tensor");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab >= 1 && vocab < (int64_t{1} << 31), "vocab size out of range");
  for (const at::Tensor* v : {&temperature, &top_p, &min_p, &uniform})
    TORCH_CHECK(v->dim() == 1 && v->size(0) == rows && v->scalar_type() == at::kFloat,
                "temperature, top_p, min_p and uniform must be float32 vectors of one value per row");
  TORCH_CHECK(top_k.dim() == 1 && top_k.size(0) == rows && top_k.scalar_type() == at::kLong,
              "top_k must be an int64 vector of one value per row");
  if (kept_out.has_value())
    TORCH_CHECK(kept_out->sizes() == logits.sizes() && kept_out->scalar_type() == at::kFloat &&
                    kept_out->is_contiguous(), "kept_out must be a contiguous float32 tensor shaped like logits");
  const at::Tensor x = logits.contiguous();
  const at::Tensor temp = temperature.contiguous(), k = top_k.contiguous(), tp = top_p.contiguous(),
                   mp = min_p.contiguous(), u = uniform.contiguous();
  at::Tensor tokens = at::empty({rows}, x.options().dtype(at::kLong));
  const bool narrow = x.scalar_type() == at::kBFloat16;
  int64_t* out = tokens.data_ptr<int64_t>();
  float* kept_data = kept_out.has_value() ? kept_out->data_ptr<float>() : nullptr;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    RowBuffers buf(vocab, narrow);
    for (int64_t r = begin; r < end; ++r) {
      const RowParams p{temp.data_ptr<float>()[r], tp.data_ptr<float>()[r], mp.data_ptr<float>()[r],
                        u.data_ptr<float>()[r], k.data_ptr<int64_t>()[r]};
      TORCH_CHECK(p.temperature > 0.f, "temperature must be positive for a random draw");
      const float* row = narrow ? widened_row(x.data_ptr<c10::BFloat16>() + r * vocab, vocab, buf.widened.data())
                                : x.data_ptr<float>() + r * vocab;
      out[r] = sample_row(row, vocab, p, kept_data ? kept_data + r * vocab : nullptr, buf);
    }
  });
  return tokens;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedmodel, m) {
  m.def("sample_from_logits(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor min_p, "
        "Tensor uniform, Tensor? kept_out=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedmodel, CPU, m) { m.impl("sample_from_logits", &sample_from_logits); }

// A step's K/V rows into their paged-cache slots on CPU, keys and values in one call.
//
// torch's path was a host-synced `(slot_mapping < 0).any()` and two index_copy_ calls per layer:
// about 24 us a layer for a 64-row decode step on SmolLM2 (0.7 ms a step over 30 layers), nearly all
// of it dispatch; the rows themselves are 24 KB. A negative slot skips its row (-1: padding), as on the
// torch path; a slot past the cache is refused before anything is written. Rows may be strided (k and v are column slices of
// the fused qkv projection's output); each token's heads must be contiguous.
// Built into the CPU ops extension by pagedmodel/kernels/cpu_paged_attention.py.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#include "cpu_cache_write.h"

namespace {

void check_rows(const at::Tensor& rows, const at::Tensor& kv_cache, const char* name) {
  TORCH_CHECK(rows.device().is_cpu() && rows.scalar_type() == kv_cache.scalar_type(), name,
              " must be a CPU tensor of the cache's dtype");
  TORCH_CHECK(rows.dim() == 3 && rows.size(1) == kv_cache.size(3) && rows.size(2) == kv_cache.size(4), name,
              " must be [tokens, kv_heads, head_dim] of the cache's heads and head dim");
  TORCH_CHECK(rows.stride(2) == 1 && rows.stride(1) == rows.size(2), name, ": each token's heads must be contiguous");
}

}  // namespace

namespace pagedmodel_cpu {

void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(kv_cache.device().is_cpu() && kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous CPU tensor [2, blocks, block_size, kv_heads, head_dim]");
  check_rows(key, kv_cache, "key");
  check_rows(value, kv_cache, "value");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.dim() == 1 &&
              slot_mapping.size(0) == key.size(0) && value.size(0) == key.size(0),
              "one int64 slot per key and value row");
  const int64_t tokens = key.size(0), slots = kv_cache.size(1) * kv_cache.size(2);
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] < slots, "row ", t, ": slot ", slot[t], " outside the cache's ", slots, " slots");
  const int64_t row_bytes = key.size(1) * key.size(2) * static_cast<int64_t>(key.element_size());
  char* keys = static_cast<char*>(kv_cache.data_ptr());
  char* values = keys + slots * row_bytes;
  const char* k = static_cast<const char*>(key.data_ptr());
  const char* v = static_cast<const char*>(value.data_ptr());
  const int64_t k_stride = key.stride(0) * key.element_size(), v_stride = value.stride(0) * value.element_size();
  for (int64_t t = 0; t < tokens; ++t) {
    if (slot[t] < 0) continue;
    std::memcpy(keys + slot[t] * row_bytes, k + t * k_stride, row_bytes);
    std::memcpy(values + slot[t] * row_bytes, v + t * v_stride, row_bytes);
  }
}

}  // namespace pagedmodel_cpu

TORCH_LIBRARY_FRAGMENT(pagedmodel, m) {
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(pagedmodel, CPU, m) { m.impl("write_kv", &pagedmodel_cpu::write_kv); }

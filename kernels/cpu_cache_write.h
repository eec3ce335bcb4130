// The cache write of cpu_cache_write.cpp, for the ops that end with one (cpu_layer_ops.cpp's
// rotary_and_write_kv).
#pragma once

#include <ATen/core/Tensor.h>

namespace pagedmodel_cpu {

// key/value [tokens, kv_heads, head_dim] (rows may be strided, each token's heads contiguous) into the
// slots of kv_cache [2, blocks, block_size, kv_heads, head_dim]; a negative slot skips its row.
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache, const at::Tensor& slot_mapping);

}  // namespace pagedmodel_cpu

// What the CPU ops that run on AMX tiles share (cpu_amx_linear.cpp, cpu_prefill_attention.cpp): the
// permission Linux asks for before a process may use tile state, and the one tile shape they all use.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace pagedmodel_amx {

// Linux hands out AMX's 8 KB of tile state only to processes that ask (arch_prctl); oneDNN asks too.
inline bool permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0 .. count - 1 as 16 rows of 64 bytes (16 x 16 float32 accumulators, 16 x 32 bf16 operands).
// Tile state is per thread: each worker configures before its first tile op and releases after its last.
inline void configure(int count) {
  TileConfig config;
  for (int t = 0; t < count; ++t) {
    config.rows[t] = 16;
    config.bytes_per_row[t] = 64;
  }
  _tile_loadconfig(&config);
}

}  // namespace pagedmodel_amx

#endif

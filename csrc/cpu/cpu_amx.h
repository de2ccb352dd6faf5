// What the AMX kernels (cpu_bf16_gemm.cpp, cpu_attention_amx.cpp, cpu_int8_gemm_amx.cpp) share:
// whether this CPU and process may use AMX-BF16 or AMX-INT8, and the tile configuration they load.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <new>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace kvsentry_amx {

#if defined(__AVX512F__)
// The permission to use the tile data state: Linux grants it per process on request (arch_prctl
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); oneDNN makes the same request.
inline bool tile_data_permitted() {
  static const bool permitted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

// AMX-BF16: the CPU flags, and the permission.
inline bool supported() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16") &&
                          __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
                          tile_data_permitted();
  return has;
}

// AMX-INT8 (and the AVX512-VNNI its callers quantize and scale with): the CPU flags, and the permission.
inline bool int8_supported() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("amx-tile") &&
                          __builtin_cpu_supports("amx-int8") && tile_data_permitted();
  return has;
}
#else
inline bool supported() { return false; }  // builds capped below AVX-512 leave AMX to oneDNN
inline bool int8_supported() { return false; }
#endif

// Palette 1, every tile 64 bytes wide; rows[t] rows in tile t.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  TileConfig() = default;
  explicit TileConfig(const int64_t (&tile_rows)[8]) {
    for (int t = 0; t < 8; ++t) {
      colsb[t] = 64;
      rows[t] = static_cast<uint8_t>(tile_rows[t]);
    }
  }
  // Tile t: tile_rows[t] rows of tile_bytes[t] bytes.
  TileConfig(const int64_t (&tile_rows)[8], const int64_t (&tile_bytes)[8]) : TileConfig(tile_rows) {
    for (int t = 0; t < 8; ++t) colsb[t] = static_cast<uint16_t>(tile_bytes[t]);
  }
};

// A std::vector whose data starts on a cache line. Every buffer a tile is loaded from or stored
// to must be one: a tile row of 64 bytes that straddles two lines made tileloadd ~3x slower on a
// Xeon core (16 x 64-byte rows 16 bytes off a line: 4 products with 5 loads, 0.76 against 2.6
// TFLOP/s from L1), and malloc aligns to 16 bytes only.
template <typename T>
struct LineAllocator {
  using value_type = T;
  LineAllocator() = default;
  template <typename U>
  LineAllocator(const LineAllocator<U>&) {}
  T* allocate(size_t n) {
    void* p = std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64);
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t) { std::free(p); }
  template <typename U>
  bool operator==(const LineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const LineAllocator<U>&) const { return false; }
};
template <typename T>
using TileBuffer = std::vector<T, LineAllocator<T>>;

}  // namespace kvsentry_amx

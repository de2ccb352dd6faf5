// A software prefetch the compiler keeps: the kernels' prefetch loops (cpu_paged_prefetch.h,
// cpu_bf16_gemm.cpp) do nothing else, and GCC 12 at -O2 deleted such loops of _mm_prefetch /
// __builtin_prefetch outright (the objects held no prefetch instruction).
#pragma once

namespace kvsentry_mem {

// The cache line holding p into L2 (PREFETCHT1), as a volatile asm on x86.
inline void prefetch_l2(const char* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht1 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

}  // namespace kvsentry_mem

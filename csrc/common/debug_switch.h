// A kernel path that tests turn off to check another path on the same CPU (the bf16 dot
// product of decode attention, the AMX attention paths). Only a library built with
// KVSENTRY_DEBUG_OPS (the test build, engine/ops/library.py) can flip one, through the
// `kvsentry_debug` op namespace; the production library has no such op and no atomic: the
// switch is a constant `true` there, so nothing can change its numerics at run time.
#pragma once

#ifdef KVSENTRY_DEBUG_OPS
#include <atomic>

namespace kvsentry_debug {

class Switch {
 public:
  bool on() const { return on_.load(std::memory_order_relaxed); }
  void set(bool on) { on_.store(on); }

 private:
  std::atomic<bool> on_{true};
};

}  // namespace kvsentry_debug
#else
namespace kvsentry_debug {

class Switch {
 public:
  constexpr bool on() const { return true; }
};

}  // namespace kvsentry_debug
#endif

// src/core/host_wait.h — the schedule of the cpu backend's host spin-waits: the transport's
// barriers (src/transport/cpu_transport.cc) and the overlapped ll combine's signal waits
// (src/cpu/ll_combine.cc). Spin, then yield, then sleep; bounded by a timeout.
#pragma once

#include <chrono>
#include <cstdint>
#include <thread>

namespace epx::detail {

// Call pause() between two looks at what is awaited: the first 64 calls return at once, the
// calls up to the 2048th yield the thread, later ones sleep 50 us. False once `timeout` has
// passed since construction, looked at before every yield or sleep: under load a sleep may take
// milliseconds, and a waiter that notices its timeout late keeps its peers waiting (with the ll
// masks a live peer may then mask it).
class HostBackoff {
 public:
  explicit HostBackoff(std::chrono::milliseconds timeout)
      : timeout_(timeout), start_(std::chrono::steady_clock::now()) {}

  bool pause() {
    const uint64_t spins = spins_++;
    if (spins < 64) return true;
    if (std::chrono::steady_clock::now() - start_ > timeout_) return false;
    if (spins < 2048)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    return true;
  }

 private:
  std::chrono::milliseconds timeout_;
  std::chrono::steady_clock::time_point start_;
  uint64_t spins_ = 0;
};

}  // namespace epx::detail

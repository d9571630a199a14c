// src/core/watchdog.h — a bound on host calls that cannot bound themselves.
//
// Some library calls block the host until a peer acts and take no timeout (a blocking NCCL
// communicator's ncclGroupEnd may wait for a partner to connect; ncclCommFinalize waits for
// outstanding operations). Watchdog::run(what, timeout, call) runs `call` on this thread while a
// helper thread waits for `timeout`; if `call` is still running then, the helper runs `expire`
// (given at construction: e.g. ncclCommAbort, which makes the blocked call return) and run()
// reports it, so the caller raises Timeout instead of hanging. One helper thread per Watchdog,
// started once; arming and disarming cost a mutex and a notify, no thread per call.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>

namespace epx::detail {

class Watchdog {
 public:
  explicit Watchdog(std::function<void()> expire);
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // Runs call() here; true when it outlived `timeout` (expire() ran meanwhile, once, on the helper
  // thread, and has returned). Exceptions of call() propagate after disarming. One run at a time.
  bool run(std::chrono::milliseconds timeout, const std::function<void()>& call);

 private:
  void loop();

  std::function<void()> expire_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool armed_ = false;
  bool expired_ = false;
  bool expiring_ = false;  // expire() is running
  bool stop_ = false;
  uint64_t generation_ = 0;  // which run() is armed: a late wake-up never expires the next one
  std::chrono::steady_clock::time_point deadline_;
  std::thread thread_;
};

}  // namespace epx::detail

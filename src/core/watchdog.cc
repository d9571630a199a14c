#include "core/watchdog.h"

namespace epx::detail {

Watchdog::Watchdog(std::function<void()> expire)
    : expire_(std::move(expire)), thread_([this] { loop(); }) {}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

bool Watchdog::run(std::chrono::milliseconds timeout, const std::function<void()>& call) {
  uint64_t generation = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    armed_ = true;
    expired_ = false;
    generation = ++generation_;
    deadline_ = std::chrono::steady_clock::now() + timeout;
  }
  cv_.notify_all();
  auto disarm = [&] {
    std::unique_lock<std::mutex> lock(mu_);
    armed_ = false;
    cv_.notify_all();
    cv_.wait(lock, [&] { return !expiring_; });  // expire() has finished when run() returns
    return expired_ && generation_ == generation;
  };
  try {
    call();
  } catch (...) {
    disarm();
    throw;
  }
  return disarm();
}

void Watchdog::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    if (!armed_) {
      cv_.wait(lock);
      continue;
    }
    const uint64_t generation = generation_;
    if (cv_.wait_until(lock, deadline_) != std::cv_status::timeout)
      continue;  // disarmed / re-armed
    if (!armed_ || generation_ != generation) continue;
    expired_ = expiring_ = true;
    armed_ = false;
    // expire() runs without the lock: it may block while the call it ends unwinds, and the
    // disarm of that call needs the lock.
    lock.unlock();
    expire_();
    lock.lock();
    expiring_ = false;
    cv_.notify_all();
  }
}

}  // namespace epx::detail

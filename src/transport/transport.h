// src/transport/transport.h — the one small interface every backend's communication sits on
// (SPEC 4): allocate symmetric memory, reach a peer's copy, synchronise. Kernels and the cpu
// reference see only this; NCCL LSA windows, shared memory (threads or processes) and future
// CUDA-IPC / GIN transports implement it.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "epx/group.h"
#include "epx/tensor.h"

namespace epx::detail {

inline constexpr int kMaxRanks = 64;

// Memory of the same size on every rank; peer(p) is rank p's copy as addressable from here
// (a host pointer on cpu, an LSA device pointer on cuda). Zero-filled at allocation.
class SymmetricMemory {
 public:
  virtual ~SymmetricMemory() = default;
  void* local() const { return ptrs_[rank_]; }
  void* peer(int rank) const { return ptrs_[rank]; }
  size_t bytes() const { return bytes_; }
  int rank() const { return rank_; }

 protected:
  std::vector<void*> ptrs_;
  size_t bytes_ = 0;
  int rank_ = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual Backend backend() const = 0;
  virtual Device device() const = 0;
  virtual std::chrono::milliseconds timeout() const = 0;

  // Collective: every rank asks for the same number of bytes, in the same order.
  virtual std::shared_ptr<SymmetricMemory> allocate(size_t bytes) = 0;

  // Collective host barrier, bounded by timeout(). Throws Timeout naming `what` and the ranks that
  // did not arrive, or Internal if a peer called abort().
  virtual void barrier(const char* what) = 0;

  // Marks this rank failed: peers blocked in barrier() stop with an error that quotes `why`
  // instead of waiting for the timeout. The first abort() of the group wins (later ones, of any
  // rank, change nothing). The group is unusable afterwards.
  virtual void abort(const std::string& why) = 0;
};

// cpu backend, ranks are threads of this process sharing `world_name`.
std::shared_ptr<Transport> make_cpu_thread_transport(int rank, int size,
                                                     const std::string& world_name,
                                                     std::chrono::milliseconds timeout);
// cpu backend, ranks are processes on this host; POSIX shared memory named after `name`.
std::shared_ptr<Transport> make_cpu_process_transport(int rank, int size, const std::string& name,
                                                      std::chrono::milliseconds timeout);

}  // namespace epx::detail

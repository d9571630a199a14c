// src/cuda/kernels/rail/device_copy.cuh — the device-copy rail's exchange kernel (host side:
// src/cuda/device_copy_rail.cu; seam: src/transport/rail.h). Ranks share one GPU (the one-GPU
// test mode), so a receiver copies its partner's chunk straight from the partner's memory: no
// staging, one kernel per exchange on the caller's stream, nothing the host waits for.
//
// Region per rank (RailRegion, symmetric; offsets identical on every rank; i = slot of another
// node, Topology::other_index):
//   state      DeviceState               local: abort word, error claim
//   cta_epoch  uint32 [kRailCtas]        local: exchanges each CTA finished (the exchange number
//                                        e of the running one is cta_epoch[b] + 1; advanced on the
//                                        device, so CUDA-graph replays need no host work)
//   post       RailPost [kMaxRailNodes]  post[i]: this rank's send to node i for exchange `seq`
//                                        (address, bytes, leg tag), read by that node's partner
//   copied     uint32 [kMaxRailNodes]    copied[i]: +1 per CTA of this rank that finished copying
//                                        node i's chunk: e * kRailCtas after exchange e
//
// Exchange e on rank (n, g), every CTA b (kRailCtas CTAs):
//   CTA 0, thread i:   post[i] = {address, bytes, tag}; st_release(post[i].seq, e)
//                      -> read by the receiving partner's wait below
//   per receive from m (partner p = (m, g), j = other_index(n, m) its slot for node n):
//     thread 0:        wait_flag(p.post[j].seq reached e) (bounded: Timeout); seq != e or another
//                      tag: OutOfStep record (kDevErrRailStep); other bytes: kDevErrRailBytes
//     all threads:     this CTA's share of the chunk, p's memory -> the receive (ld_landed)
//     thread 0:        fence + red_add(copied[other_index(m, n)], 1)
//                      -> read by p's completion wait
//   CTA 0, thread i:   per send to node i's partner q: wait_flag(q.copied[other_index(n, m)]
//                      reached e * kRailCtas) (bounded) — the send memory is free again when the
//                      kernel ends, and the next exchange's post cannot overtake a reader
//   thread 0:          cta_epoch[b] = e
// A partner at another exchange of the rail (after a reset on one side only, or a leg skipped)
// shows as a seq or tag other than this rank's; one that never posts ends in Timeout. Either
// sets the abort word, so every later wait of this rail stops at once until reset().
#pragma once

#include <cstdint>

#include "cuda/device_error.h"
#include "cuda/kernels/sync.cuh"

namespace epx::detail {

inline constexpr int kRailCtas = 2;  // fits beside the peers: every one-GPU rank may run 2 CTAs
inline constexpr int kRailThreads = 256;
inline constexpr int kMaxRailNodes = 64;  // kMaxRanks: one rank per node at most

struct RailPost {
  uint64_t address;  // the sender's chunk (device memory of the shared GPU)
  uint64_t bytes;
  uint32_t tag;  // rail_leg_tag(what): which leg of which operation
  uint32_t seq;  // the exchange number; stored last (release)
};

struct RailRegion {
  DeviceState state;
  uint32_t cta_epoch[kRailCtas];
  RailPost post[kMaxRailNodes];
  uint32_t copied[kMaxRailNodes];
};

// One other node's chunks of an exchange: a send and a receive of equal size, or neither
// (plan_rail_exchange's rule), so one word says whether the pair takes part.
struct RailPair {
  const char* send;
  char* recv;
  uint64_t bytes;
  int active;
};

struct RailExchangeParams {
  RailRegion* local;
  RailRegion* partner[kMaxRailNodes];  // by node: the rank of this local index there
  RailPair pairs[kMaxRailNodes];       // by other_index
  int num_nodes;
  int node;
  int ranks_per_node;
  int local_index;  // this rank's index in its node: its partner on node m is rank m * G + it
  uint32_t tag;
  WaitContext wait;
};
static_assert(sizeof(RailExchangeParams) <= 4096, "kernel parameters are limited to 4 KB");

__device__ __forceinline__ int rail_other_index(int m, int n) {
  return m < n ? m : m - 1;
}

// This CTA's share [begin, end) of `bytes`, cut at 16-byte boundaries.
__device__ __forceinline__ void rail_share(uint64_t bytes, uint64_t* begin, uint64_t* end) {
  const uint64_t units = (bytes + 15) / 16, per = (units + gridDim.x - 1) / gridDim.x;
  *begin = min(bytes, per * blockIdx.x * 16);
  *end = min(bytes, per * (blockIdx.x + 1) * 16);
}

__device__ __forceinline__ void rail_copy(char* dst, const char* src, uint64_t begin,
                                          uint64_t end) {
  const bool vec =
      ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) & 15) == 0;
  uint64_t i = begin + 16 * threadIdx.x;
  if (vec) {
    for (; i + 16 <= end; i += 16 * blockDim.x)
      *reinterpret_cast<int4*>(dst + i) = ld_landed<int4>(src + i);
  }
  // The tail (the last CTA's share), or everything where an address is not 16-byte aligned.
  for (uint64_t j = vec ? (end - begin) / 16 * 16 + begin + threadIdx.x : begin + threadIdx.x;
       j < end; j += blockDim.x)
    dst[j] = ld_landed<char>(src + j);
}

__global__ void __launch_bounds__(kRailThreads, 1) rail_exchange_kernel(RailExchangeParams p) {
  RailRegion* me = p.local;
  __shared__ uint32_t epoch;
  if (threadIdx.x == 0) epoch = me->cta_epoch[blockIdx.x] + 1;  // only this CTA writes it
  __syncthreads();
  const uint32_t e = epoch;
  const int others = p.num_nodes - 1;
  if (blockIdx.x == 0 && threadIdx.x < others && p.pairs[threadIdx.x].active) {
    RailPost& post = me->post[threadIdx.x];
    post.address = reinterpret_cast<uint64_t>(p.pairs[threadIdx.x].send);
    post.bytes = p.pairs[threadIdx.x].bytes;
    post.tag = p.tag;
    st_release_sys(&post.seq, e);  // -> the partner's wait_flag on post.seq
  }
  __shared__ int ok_all;
  for (int i = 0; i < others; ++i) {
    const RailPair& pair = p.pairs[i];
    if (!pair.active) continue;
    const int m = i < p.node ? i : i + 1;
    const RailPost& theirs = p.partner[m]->post[rail_other_index(p.node, m)];
    if (threadIdx.x == 0) {
      const int peer = m * p.ranks_per_node + p.local_index;
      bool ok = wait_flag<true>(&theirs.seq, e, p.wait, kWaitRailPost, peer);
      if (ok) {
        const uint32_t seq = ld_acquire_sys(&theirs.seq);
        const uint32_t tag = *reinterpret_cast<const volatile uint32_t*>(&theirs.tag);
        const uint64_t bytes = *reinterpret_cast<const volatile uint64_t*>(&theirs.bytes);
        if (seq != e || tag != p.tag) {
          record_error(p.wait, kDevErrRailStep, peer,
                       static_cast<int64_t>(static_cast<uint64_t>(tag) << 32 | seq),
                       static_cast<int64_t>(static_cast<uint64_t>(p.tag) << 32 | e));
          ok = false;
        } else if (bytes != pair.bytes) {
          record_error(p.wait, kDevErrRailBytes, peer, static_cast<int64_t>(bytes),
                       static_cast<int64_t>(pair.bytes));
          ok = false;
        }
        if (!ok) atomicExch(&p.wait.state->abort, 1u);
      }
      ok_all = ok ? 1 : 0;
    }
    __syncthreads();
    if (!ok_all) return;
    uint64_t begin = 0, end = 0;
    rail_share(pair.bytes, &begin, &end);
    const auto* src =
        reinterpret_cast<const char*>(*reinterpret_cast<const volatile uint64_t*>(&theirs.address));
    rail_copy(pair.recv, src, begin, end);
    __syncthreads();  // every thread's loads of the partner's chunk before the signal
    if (threadIdx.x == 0) {
      fence_acq_rel_sys();
      red_add_relaxed_sys(&me->copied[i], 1u);  // -> the partner's completion wait
    }
  }
  if (blockIdx.x == 0 && threadIdx.x < others && p.pairs[threadIdx.x].active) {
    const int i = threadIdx.x, m = i < p.node ? i : i + 1;
    wait_flag<true>(&p.partner[m]->copied[rail_other_index(p.node, m)], e * kRailCtas, p.wait,
                    kWaitRailCopied, m * p.ranks_per_node + p.local_index);
  }
  __syncthreads();
  if (threadIdx.x == 0) me->cta_epoch[blockIdx.x] = e;
}

}  // namespace epx::detail

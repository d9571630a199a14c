// src/transport/nccl_rail.cc — the NCCL rail (nccl_rail.h): the network leg of the hierarchical
// algorithms as grouped ncclSend / ncclRecv on the rail communicator (docs/design.md §13).
//
// Data flow of exchange(what, sends, recvs, stream) on rank (n, g):
//   plan_rail_exchange (the checks; for s = 1 .. N - 1: the send to (n + s, g), the receive from
//   (n - s, g)) -> ncclGroupStart -> ncclSend / ncclRecv(op.data, op.bytes, ncclUint8, rail rank
//   op.node, comm, stream) per operation -> ncclGroupEnd, bounded by the watchdog.
// Every chunk has a fixed capacity the ranks derive from the agreed shape, so a send and its
// partner's receive post equal counts (NCCL 2.28.9's rule) with no count exchange, and the host
// never waits for data: inside a stream capture the group becomes graph nodes, and a replay moves
// the chunks again. The communicator is blocking (the mode NCCL captures); its host calls that
// can wait for a partner (ncclGroupEnd connects to a peer on first use, ncclCommFinalize waits
// for outstanding operations) run under a Watchdog that aborts the communicator at the group's
// timeout, so they raise Timeout instead of hanging.
#include "transport/nccl_rail.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <mutex>
#include <string>

#include "core/check.h"
#include "core/watchdog.h"
#include "cuda/cuda_check.h"
#include "transport/nccl_check.h"
#include "transport/nccl_transport.h"

namespace epx::detail {
namespace {

class NcclRail final : public RailTransport {
 public:
  NcclRail(ncclComm_t comm, Topology topology, int rank, size_t max_chunk_bytes, int device,
           std::chrono::milliseconds timeout)
      : comm_(comm),
        topology_(topology),
        rank_(rank),
        max_chunk_bytes_(max_chunk_bytes),
        device_(device),
        timeout_(timeout),
        watchdog_([this] { abort(); }) {}

  ~NcclRail() override {
    if (is_aborted()) return;
    cudaSetDevice(device_);
    // Bounded: a finalize that waits past the timeout for operations a partner never matched is
    // ended by the watchdog's abort, which frees the communicator.
    const bool expired = watchdog_.run(timeout_, [&] { ncclCommFinalize(comm_); });
    if (!expired) ncclCommDestroy(comm_);
  }

  size_t max_chunk_bytes() const override { return max_chunk_bytes_; }
  size_t bytes_allocated() const override { return 0; }
  void reset() override {}  // nothing numbered here (nccl_rail.h)

  void abort() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (aborted_) return;
    aborted_ = true;
    cudaSetDevice(device_);  // may run on the watchdog's thread
    ncclCommAbort(comm_);    // frees the communicator; kernels waiting for a partner return
  }

  void exchange(const char* what, const std::vector<RailChunk>& sends,
                const std::vector<RailChunk>& recvs, Stream stream) override {
    EPX_CHECK(!is_aborted(), ErrorCode::kInternal, what, ": the rail communicator was aborted ",
              "after an earlier timeout or failure; expected the rail of a usable group");
    const std::vector<RailOp> ops =
        plan_rail_exchange(what, topology_, rank_, sends, recvs, max_chunk_bytes_);
    if (ops.empty()) return;
    DeviceGuard guard(device_);
    auto s = static_cast<cudaStream_t>(stream);
    ncclResult_t result = ncclSuccess;
    const bool expired = watchdog_.run(timeout_, [&] {
      result = ncclGroupStart();
      if (result != ncclSuccess) return;
      for (const RailOp& op : ops) {
        result = op.send ? ncclSend(op.data, op.bytes, ncclUint8, op.node, comm_, s)
                         : ncclRecv(op.data, op.bytes, ncclUint8, op.node, comm_, s);
        if (result != ncclSuccess) break;
      }
      const ncclResult_t end = ncclGroupEnd();  // closes the group on every path
      if (result == ncclSuccess) result = end;
    });
    if (expired) {
      std::string peers;
      for (const RailOp& op : ops) peers += cat(peers.empty() ? "" : ", ", op.peer);
      throw_error(
          ErrorCode::kTimeout,
          cat(what, ": rank ", rank_, " waited ", timeout_.count(), " ms for its rail partners [",
              peers, "] to join the exchange; the rail ", "communicator was aborted"));
    }
    if (result != ncclSuccess) {
      abort();  // a group that failed half-way leaves the partners' operations unmatched
      throw_nccl(result, "ncclGroupStart / ncclSend / ncclRecv / ncclGroupEnd", what);
    }
  }

 private:
  bool is_aborted() {
    std::lock_guard<std::mutex> lock(mu_);
    return aborted_;
  }

  ncclComm_t comm_;
  Topology topology_;
  int rank_;  // in the group
  size_t max_chunk_bytes_;
  int device_;
  std::chrono::milliseconds timeout_;
  std::mutex mu_;  // guards aborted_: abort() may come from the watchdog's thread
  bool aborted_ = false;
  Watchdog watchdog_;  // last: its thread stops before the members it may touch go
};

}  // namespace

std::unique_ptr<RailTransport> make_nccl_rail(void* parent_comm, Topology topology,
                                              size_t max_chunk_bytes, int cuda_device,
                                              std::chrono::milliseconds timeout) {
  int rank = 0;
  auto comm = static_cast<ncclComm_t>(
      nccl_split(parent_comm, topology, false, cuda_device, &rank, "rail communicator"));
  return std::make_unique<NcclRail>(comm, topology, rank, max_chunk_bytes, cuda_device, timeout);
}

}  // namespace epx::detail

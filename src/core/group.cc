#include "epx/group.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <thread>
#include <vector>

#include "core/agree.h"
#include "core/check.h"
#include "core/env.h"
#include "transport/nccl_transport.h"
#include "transport/transport.h"

namespace epx {

const char* backend_name(Backend backend) { return backend == Backend::kCpu ? "cpu" : "cuda"; }

// Checks the options and the environment (every variable epx reads, core/env.h), then fills the
// defaults: a bad value is an InvalidArgument here, at group creation, never a silent default.
static GroupOptions resolve(GroupOptions o, const char* op) {
  const int64_t ms = o.timeout.count();
  EPX_CHECK_ARG(ms >= 0 && ms <= detail::kMaxTimeoutMs, op, ": GroupOptions::timeout is ", ms,
                " ms, expected 1..", detail::kMaxTimeoutMs, " ms, or 0 for the default ",
                "(EPX_TIMEOUT_MS, else ", detail::kDefaultTimeoutMs, ")");
  EPX_CHECK_ARG(o.num_sms >= 0 && o.num_sms <= detail::kMaxNumSms, op,
                ": GroupOptions::num_sms is ", o.num_sms, ", expected 0..", detail::kMaxNumSms,
                " (0 = EPX_NUM_SMS, else auto)");
  detail::check_environment(op);
  if (ms == 0) o.timeout = detail::env_default_timeout();
  if (o.num_sms == 0) o.num_sms = detail::env_default_num_sms();
  return o;
}

// The topology (GroupOptions::ranks_per_node) against the group's size: 0 (one node, resolved to
// the size) or a divisor of it; more than one node on the cpu backend, and on cuda only where
// ranks share one GPU (`virtual_nodes`: Group::cuda_shared_device, whose ht runs across nodes
// through the device-copy rail, docs/design.md §13.1); a group with a GPU per rank has no
// across-node path yet. A size the transport will refuse passes here unchanged (the transport
// names it).
static GroupOptions resolve_topology(GroupOptions o, int size, Backend backend, const char* op,
                                     bool virtual_nodes = false) {
  if (size < 1 || size > detail::kMaxRanks) return o;
  std::string divisors;
  for (int d = 1; d <= size; ++d)
    if (size % d == 0) divisors += detail::cat(divisors.empty() ? "" : ", ", d);
  const int rpn = o.ranks_per_node;
  EPX_CHECK_ARG(rpn >= 0 && rpn <= size && (rpn == 0 || size % rpn == 0), op,
                ": GroupOptions::ranks_per_node is ", rpn,
                ", expected 0 (every rank on one node) or a divisor of the group size ", size, " (",
                divisors, ")");
  if (rpn == 0) o.ranks_per_node = size;
  EPX_CHECK(backend == Backend::kCpu || virtual_nodes || o.ranks_per_node == size,
            ErrorCode::kUnsupported, op, ": GroupOptions::ranks_per_node = ", rpn, " makes ",
            size / rpn, " nodes of ", rpn,
            " ranks; the cuda backend has no across-node path yet for a GPU per rank (only for "
            "virtual nodes of Group::cuda_shared_device; docs/design.md §13), expected 0 or the "
            "group size ",
            size);
  return o;
}

Group::Group(std::shared_ptr<detail::Transport> t, GroupOptions options)
    : transport_(std::move(t)), options_(options) {}

Group Group::cpu_threads(int rank, int size, const std::string& world_name, GroupOptions options) {
  options = resolve_topology(resolve(options, "Group::cpu_threads"), size, Backend::kCpu,
                             "Group::cpu_threads");
  return Group(detail::make_cpu_thread_transport(rank, size, world_name, options.timeout), options);
}

Group Group::cpu_processes(int rank, int size, const std::string& name, GroupOptions options) {
  options = resolve_topology(resolve(options, "Group::cpu_processes"), size, Backend::kCpu,
                             "Group::cpu_processes");
  return Group(detail::make_cpu_process_transport(rank, size, name, options.timeout), options);
}

Group Group::cuda(int rank, int size, const UniqueId& id, int cuda_device, GroupOptions options) {
  options = resolve_topology(resolve(options, "Group::cuda"), size, Backend::kCuda, "Group::cuda");
  return Group(detail::make_nccl_transport(rank, size, id, cuda_device, options.timeout), options);
}

Group Group::cuda_shared_device(int rank, int size, const std::string& world_name,
                                int cuda_device, GroupOptions options) {
  options = resolve_topology(resolve(options, "Group::cuda_shared_device"), size, Backend::kCuda,
                             "Group::cuda_shared_device", /*virtual_nodes=*/true);
  auto t = detail::make_cuda_shared_device_transport(rank, size, world_name, cuda_device, &options);
  return Group(std::move(t), options);
}

Group Group::cuda_from_comm(void* nccl_comm, int cuda_device, GroupOptions options) {
  options = resolve(options, "Group::cuda_from_comm");
  EPX_CHECK_ARG(nccl_comm != nullptr, "Group::cuda_from_comm: argument 'nccl_comm' is null");
  auto t = detail::make_nccl_transport_from_comm(nccl_comm, cuda_device, options.timeout);
  options = resolve_topology(options, t->size(), Backend::kCuda, "Group::cuda_from_comm");
  return Group(std::move(t), options);
}

int Group::rank() const { return transport_->rank(); }
int Group::size() const { return transport_->size(); }
Backend Group::backend() const { return transport_->backend(); }
std::chrono::milliseconds Group::timeout() const { return options_.timeout; }
const GroupOptions& Group::options() const { return options_; }
void Group::barrier() const { transport_->barrier("Group::barrier"); }

std::vector<std::vector<int64_t>> Group::agree(const std::string& op,
                                               const std::vector<AgreeValue>& values,
                                               const std::vector<int64_t>& extra) const {
  std::vector<detail::AgreeField> fields;
  fields.reserve(values.size());
  for (const AgreeValue& v : values)
    fields.push_back({v.name, v.value, v.boolean ? detail::show_bool : detail::show_int});
  return detail::agree(*this, op, fields, extra);
}

UniqueId new_unique_id() { return detail::nccl_new_unique_id(); }

UniqueId exchange_unique_id_via_file(const std::string& path, int rank,
                                     std::chrono::milliseconds timeout) {
  UniqueId id;
  if (rank == 0) {
    id = new_unique_id();
    std::string tmp = path + ".tmp." + std::to_string(getpid());
    {
      std::ofstream f(tmp, std::ios::binary);
      f.write(id.bytes.data(), id.bytes.size());
      EPX_CHECK(f.good(), ErrorCode::kInternal, "exchange_unique_id_via_file: cannot write ", tmp);
    }
    EPX_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, ErrorCode::kInternal,
              "exchange_unique_id_via_file: cannot rename ", tmp, " to ", path);
    return id;
  }
  const auto start = std::chrono::steady_clock::now();
  while (true) {
    std::ifstream f(path, std::ios::binary);
    if (f && f.read(id.bytes.data(), id.bytes.size()) && f.gcount() == 128) return id;
    EPX_CHECK(std::chrono::steady_clock::now() - start < timeout, ErrorCode::kTimeout,
              "exchange_unique_id_via_file: rank ", rank, " waited ", timeout.count(),
              " ms for rank 0 to write '", path, "'");
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

int launch_local(int num_ranks, const std::function<int(int rank)>& body,
                 std::chrono::milliseconds timeout) {
  EPX_CHECK_ARG(num_ranks >= 1 && num_ranks <= detail::kMaxRanks,
                "launch_local: argument 'num_ranks' is ", num_ranks, ", expected 1..",
                detail::kMaxRanks);
  std::fflush(nullptr);
  std::vector<pid_t> pids;
  for (int r = 0; r < num_ranks; ++r) {
    pid_t pid = fork();
    EPX_CHECK(pid >= 0, ErrorCode::kInternal, "launch_local: fork failed");
    if (pid == 0) {
      int rc = 1;
      try {
        rc = body(r);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "[rank %d] %s\n", r, e.what());
        rc = 1;
      }
      std::fflush(nullptr);
      _exit(rc);
    }
    pids.push_back(pid);
  }
  int result = 0;
  size_t remaining = pids.size();
  const auto start = std::chrono::steady_clock::now();
  std::vector<bool> done(pids.size(), false);
  while (remaining > 0) {
    for (size_t i = 0; i < pids.size(); ++i) {
      if (done[i]) continue;
      int status = 0;
      pid_t w = waitpid(pids[i], &status, WNOHANG);
      if (w == pids[i]) {
        done[i] = true;
        --remaining;
        int rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        if (rc != 0 && result == 0) result = rc;
      }
    }
    if (remaining > 0 && std::chrono::steady_clock::now() - start > timeout) {
      for (size_t i = 0; i < pids.size(); ++i)
        if (!done[i]) kill(pids[i], SIGKILL);
      for (size_t i = 0; i < pids.size(); ++i)
        if (!done[i]) waitpid(pids[i], nullptr, 0);
      std::fprintf(stderr, "launch_local: killed ranks still running after %lld ms\n",
                   static_cast<long long>(timeout.count()));
      return result ? result : 124;
    }
    if (remaining > 0) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return result;
}

}  // namespace epx

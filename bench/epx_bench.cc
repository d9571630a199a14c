// bench/epx_bench.cc — epx-bench: benchmark and correctness check of the ht, ll and a2a modes
// (nccl-tests style). Command line, rank start-up, merging of the ranks' reports, the table and
// the JSON. The modes themselves are in epx_bench_{ht,ll,a2a}.cc; see epx_bench.h for the data
// flow and the definition of the byte counts.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "bench/epx_bench.h"
#include "core/cuda_runtime_shim.h"
#include "support/routing.h"
#include "transport/transport.h"

namespace epx::bench {
namespace {

#if defined(EPX_BENCH_CUDA)
constexpr bool kBuiltWithCuda = true;
#else
constexpr bool kBuiltWithCuda = false;
#endif

const char* kHelp = R"(usage: epx-bench [MODE...] [FLAGS]

Benchmarks (and with --check verifies) epx's dispatch/combine on R ranks and prints one table
row per operation: time, bytes moved, bandwidth, and on cuda the NCCL all-to-all and NVLink
ceiling of the same bytes measured in the same run.

MODE (positional, any of; default all):
  ht     high-throughput dispatch (bf16 and/or fp8, exact and cached) and combine
  ll     low-latency dispatch (fp8, bf16 or NVFP4) and combine
  a2a    fixed-geometry all-to-all: hidden bf16 + expert ids + weights, then combine
  all    ht ll a2a

FLAGS:
  --backend cpu|cuda  cpu: the reference backend on this host. cuda: one forked process per
                      GPU over NVLink. Default: cuda if epx was built with CUDA and a GPU is
                      visible, else cpu.
  --ranks R           EP group size. cpu default 4 (threads of this process); cuda default:
                      every visible GPU (one process per GPU, GPU i = rank i).
  --procs             cpu only: run the ranks as forked processes over POSIX shared memory
                      instead of threads.
  --nodes N           the R ranks as N nodes of R / N ranks, node-major
                      (GroupOptions::ranks_per_node = R / N; N must divide R). ht and ll then
                      run hierarchically: tokens cross between nodes once per node over the
                      rail, combines reduce inside each node first (docs/design.md §13); a2a is
                      the same on every topology. --check compares with the oracle of that
                      topology. Default 1. On cuda N > 1 runs ht only, and only on virtual
                      nodes (ranks sharing one GPU); elsewhere the group's Unsupported error
                      is reported naming the option (never a flat run).
  --tokens T[,T...]   tokens per rank (one table row group per value). Default (the
                      standard workloads): ht 4096, ll 128, a2a 128 on cuda; on cpu smaller so a
                      run takes seconds on a small machine: ht 256, ll 8, a2a 64.
                      For ll, T is also T_max (the buffer capacity).
  --hidden H          hidden size (default 7168; a multiple of 128 for fp8 and ll)
  --topk K            experts per token (default 8)
  --experts E         number of experts, a multiple of R (default 256)
  --dtype bf16|fp8|nvfp4, --quant (the same)
                      dispatch dtype of ht and ll (fp8 for ll means use_fp8; nvfp4, ll only:
                      e2m1 values + e4m3 scales per 16, global scale 448 * 6 / 8: the rows lie in
                      (-8, 8)). Default:
                      the standard set: ht bf16 and fp8, ll fp8. Combine is always bf16.
  --routing NAME      uniform (default), skewed, all_to_one, empty_rank, all_minus_one,
                      duplicates (the generators of tests/support/routing.h)
  --iters N           timed iterations per operation (default: cuda 50, cpu 10)
  --warmup N          untimed iterations before them (default: cuda 10, cpu 2)
  --num-sms N         SM budget of the cuda kernels (GroupOptions::num_sms); 0 = auto (default).
                      The NVLink ceiling uses the same number (16 when auto).
  --timing barrier|pipelined
                      cuda: how each call is timed, for epx and both baselines alike.
                      barrier (default): each call alone, CUDA events right around it after a
                      group barrier (it pays its launch and host time and the ranks' skew).
                      pipelined: after one barrier the --iters calls back to back, each between
                      its own two events (a call starts on the device when the previous one
                      ends): GPU time per call while the host keeps ahead, the way DeepEP's
                      tests time its kernels. The cpu backend has only barrier.
  --check             compare every operation's outputs, on every rank, with the naive oracle
                      of tests/support (exact, element by element; before and after timing).
                      Prints PASS/FAIL per operation; exits 1 if any check fails.
  --json FILE         also write every result (and the run's parameters) to FILE as JSON
  --seed S            seed of the routing and the data (default 1); rank r's inputs depend
                      only on (S, r, mode)
  --timeout-ms MS     bound on every wait for a peer (default: EPX_TIMEOUT_MS or 30000)
  --help              this text

COLUMNS:
  median/min/max us   time per call over --iters calls. cpu: wall clock of rank 0, all ranks
                      meeting at a barrier before each call. cuda: CUDA events around each call
                      (--timing says when each call starts).
                      Outputs come from a caching pool (as with PyTorch's allocator), so no
                      timed call pays cudaMalloc/cudaFree or fresh host pages.
  row B               bytes of one token row on the wire, per destination rank (ll: the
                      dispatch message, fp8 H + 4 H/128, bf16 2 H, nvfp4 H/2 + H/16 = 9 H/16;
                      combine 2 H); '-' where not reported.
  cross MB            bytes a rank receives from OTHER ranks (its own tokens excluded), per
                      rank, averaged over ranks: the payload rows (hidden plus fp8 scales; a2a:
                      all payloads) that must cross between GPUs. Routing metadata not counted.
  recv MB             all payload bytes a rank receives, its own tokens included (DeepEP's
                      "NVL" figure).
  GB/s                cross bytes / median time (per rank, one direction); recv GB/s likewise.
  nccl us, ceil us    cuda only: NCCL all-to-all, and an SM-driven peer copy (the NVLink
                      ceiling), each moving cross/(R-1) bytes to every peer, in the same run.
  epx/nccl            epx time / NCCL time (< 1: epx is faster).
  ceil/epx            ceiling time / epx time (1.0 = epx reaches the NVLink ceiling).
  SMs                 the SM budget given (auto = the backend's choice).
  sym MB              symmetric memory allocated per rank (Buffer/A2a::bytes_allocated).
  check               PASS / FAIL (with --check) or '-'.

Exit status: 0 ok, 1 a check failed, a rank raised an error or the --json file could not be
written, 2 bad command line (unknown flags and values, and combinations a selected mode cannot
run: ht --dtype fp8 and ll need --hidden a multiple of 128, a2a an even --hidden; an unwritable
--json path).
)";

[[noreturn]] void usage_error(const std::string& msg) {
  std::fprintf(stderr, "epx-bench: %s (see --help)\n", msg.c_str());
  std::exit(2);
}

int64_t parse_int(const std::string& flag, const std::string& v, int64_t lo, int64_t hi) {
  try {
    size_t pos = 0;
    long long x = std::stoll(v, &pos);
    if (pos != v.size() || x < lo || x > hi) throw std::out_of_range(v);
    return x;
  } catch (const std::exception&) {
    usage_error(flag + " is '" + v + "', expected an integer in [" + std::to_string(lo) + ", " +
                std::to_string(hi) + "]");
  }
}

// GPUs visible, counted in a forked child so this process never initialises CUDA (a CUDA context
// does not survive fork, and the ranks are forked later).
int count_gpus() {
  if (!kBuiltWithCuda) return 0;
  // The child exits with 100 + count; anything else (an exception: 1, a signal: 128 + n) means
  // no usable GPU.
  const int rc = launch_local(
      1, [](int) { return 100 + std::min(detail::cuda_device_count(), 100); },
      std::chrono::minutes(2));
  return rc >= 100 && rc <= 200 ? rc - 100 : 0;
}

Options parse(int argc, char** argv) {
  Options o;
  bool backend_given = false;
  std::string dtype;
  for (int i = 0; i < argc; ++i) {
    if (i > 0) o.command_line += ' ';
    o.command_line += argv[i];
  }
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i], v;
    const bool is_flag = a.rfind("--", 0) == 0;
    if (is_flag) {
      const size_t eq = a.find('=');
      if (eq != std::string::npos) {
        v = a.substr(eq + 1);
        a = a.substr(0, eq);
      }
    }
    auto value = [&]() -> std::string {
      if (!v.empty()) return v;
      if (i + 1 >= argc) usage_error(a + " needs a value");
      return argv[++i];
    };
    if (!is_flag) {
      if (a == "all") {
        o.modes = {"ht", "ll", "a2a"};
      } else if (a == "ht" || a == "ll" || a == "a2a") {
        if (std::find(o.modes.begin(), o.modes.end(), a) == o.modes.end()) o.modes.push_back(a);
      } else {
        usage_error("mode is '" + a + "', expected ht, ll, a2a or all");
      }
    } else if (a == "--help" || a == "-h") {
      std::fputs(kHelp, stdout);
      std::exit(0);
    } else if (a == "--backend") {
      const std::string b = value();
      if (b != "cpu" && b != "cuda") usage_error("--backend is '" + b + "', expected cpu or cuda");
      o.backend = b == "cpu" ? Backend::kCpu : Backend::kCuda;
      backend_given = true;
    } else if (a == "--ranks") {
      o.num_ranks = static_cast<int>(parse_int(a, value(), 1, detail::kMaxRanks));
    } else if (a == "--procs") {
      o.procs = true;
    } else if (a == "--nodes") {
      o.num_nodes = static_cast<int>(parse_int(a, value(), 1, detail::kMaxRanks));
    } else if (a == "--tokens") {
      std::stringstream ss(value());
      std::string item;
      while (std::getline(ss, item, ',')) o.tokens.push_back(parse_int(a, item, 0, 1 << 20));
      if (o.tokens.empty()) usage_error("--tokens needs at least one value");
    } else if (a == "--hidden") {
      o.hidden = parse_int(a, value(), 1, 1 << 20);
    } else if (a == "--topk") {
      o.top_k = static_cast<int>(parse_int(a, value(), 1, 32));
    } else if (a == "--experts") {
      o.num_experts = static_cast<int>(parse_int(a, value(), 1, 1 << 16));
    } else if (a == "--dtype" || a == "--quant") {
      dtype = value();
      if (dtype != "bf16" && dtype != "fp8" && dtype != "nvfp4")
        usage_error(a + " is '" + dtype + "', expected bf16, fp8 or nvfp4");
      o.dtype = dtype == "bf16"  ? DTypeChoice::kBf16
                : dtype == "fp8" ? DTypeChoice::kFp8
                                 : DTypeChoice::kNvfp4;
    } else if (a == "--routing") {
      o.routing = value();
      try {
        testing::routing_from_name(o.routing);
      } catch (const std::exception& e) {
        usage_error(std::string("--routing: ") + e.what());
      }
    } else if (a == "--iters") {
      o.iters = static_cast<int>(parse_int(a, value(), 1, 1 << 20));
    } else if (a == "--warmup") {
      o.warmup = static_cast<int>(parse_int(a, value(), 0, 1 << 20));
    } else if (a == "--num-sms") {
      o.num_sms = static_cast<int>(parse_int(a, value(), 0, kMaxGroupNumSms));
    } else if (a == "--timing") {
      const std::string t = value();
      if (t != "barrier" && t != "pipelined")
        usage_error("--timing is '" + t + "', expected barrier or pipelined");
      o.pipelined = t == "pipelined";
    } else if (a == "--check") {
      o.check = true;
    } else if (a == "--json") {
      o.json_path = value();
    } else if (a == "--seed") {
      o.seed = static_cast<uint64_t>(parse_int(a, value(), 0, INT64_MAX));
    } else if (a == "--timeout-ms") {
      o.timeout_ms = static_cast<int>(parse_int(a, value(), 1, kMaxGroupTimeoutMs));
    } else {
      usage_error("unknown flag '" + a + "'");
    }
  }
  if (o.modes.empty()) o.modes = {"ht", "ll", "a2a"};
  // Keep the canonical order ht, ll, a2a.
  std::vector<std::string> ordered;
  for (const char* m : {"ht", "ll", "a2a"})
    if (std::find(o.modes.begin(), o.modes.end(), m) != o.modes.end()) ordered.push_back(m);
  o.modes = ordered;

  const int num_gpus = (!backend_given || o.backend == Backend::kCuda) ? count_gpus() : 0;
  if (!backend_given) o.backend = num_gpus > 0 ? Backend::kCuda : Backend::kCpu;
  if (o.backend == Backend::kCuda) {
    if (!kBuiltWithCuda) usage_error("--backend cuda: epx-bench was built without CUDA");
    if (num_gpus == 0) usage_error("--backend cuda: no GPU is visible");
    if (o.procs) usage_error("--procs is for the cpu backend (cuda always uses processes)");
    if (o.num_ranks == 0) o.num_ranks = num_gpus;
    if (o.num_ranks > num_gpus)
      usage_error("--ranks is " + std::to_string(o.num_ranks) + ", but only " +
                  std::to_string(num_gpus) + " GPUs are visible");
  } else if (o.num_ranks == 0) {
    o.num_ranks = 4;
  }
  if (o.num_ranks % o.num_nodes != 0) {
    std::string divisors;
    for (int d = 1; d <= o.num_ranks; ++d)
      if (o.num_ranks % d == 0) divisors += (divisors.empty() ? "" : ", ") + std::to_string(d);
    usage_error("--nodes is " + std::to_string(o.num_nodes) + ", expected a divisor of --ranks " +
                std::to_string(o.num_ranks) + " (" + divisors + ")");
  }
  const bool cuda = o.backend == Backend::kCuda;
  if (o.pipelined && !cuda)
    usage_error("--timing pipelined times calls on the device; the cpu backend has only barrier");
  if (o.iters < 0) o.iters = cuda ? 50 : 10;
  if (o.warmup < 0) o.warmup = cuda ? 10 : 2;
  if (o.num_experts % o.num_ranks != 0)
    usage_error("--experts is " + std::to_string(o.num_experts) + ", expected a multiple of " +
                "--ranks (" + std::to_string(o.num_ranks) + ")");
  // Combinations a mode cannot run are refused here, before any rank starts: a mode never runs
  // half of its ops (a combine needs the dispatch that made its handle).
  auto has = [&](const char* m) {
    return std::find(o.modes.begin(), o.modes.end(), m) != o.modes.end();
  };
  const std::string hidden = std::to_string(o.hidden);
  const std::string only = " (select the modes that can run it, e.g. " +
                           std::string(o.hidden % 2 == 0 ? "ht a2a" : "ht") +
                           ", or another --hidden)";
  if (has("ht") && o.dtype == DTypeChoice::kFp8 && o.hidden % 128 != 0)
    usage_error("--dtype fp8 with --hidden " + hidden +
                ": ht fp8 needs --hidden a multiple of 128 (one scale per 128 channels); use "
                "--dtype bf16, or omit --dtype to run ht bf16 alone at this hidden size");
  if (o.dtype == DTypeChoice::kNvfp4 && (has("ht") || has("a2a")))
    usage_error(
        "--quant nvfp4 runs mode ll only (ht moves bf16 or fp8 rows, the a2a workload "
        "bf16); select mode ll");
  if (has("ll") && o.hidden % 128 != 0)
    usage_error("mode ll with --hidden " + hidden +
                ": ll needs --hidden a multiple of 128 (its fp8 groups)" + only);
  if (has("a2a") && o.hidden % 2 != 0)
    usage_error("mode a2a with --hidden " + hidden +
                ": a2a needs an even --hidden (payload rows of 2H bytes, a multiple of 4)" +
                only);
  if (o.top_k > o.num_experts)
    usage_error("--topk is " + std::to_string(o.top_k) + ", more than --experts (" +
                std::to_string(o.num_experts) + "); expected at most one selection per expert");
  // --json: the file must be writable before the run starts (else the results would be lost
  // after it); opened for appending, so nothing is truncated until the results are written.
  if (!o.json_path.empty()) {
    std::ofstream probe(o.json_path, std::ios::app);
    if (!probe)
      usage_error("--json '" + o.json_path + "': cannot open it for writing (" +
                  std::strerror(errno) + ")");
  }
  return o;
}

// ---- one rank -----------------------------------------------------------------------------------

int run_rank(const Options& opt, const Group& group, RankReport& report) {
  std::memset(static_cast<void*>(&report), 0, sizeof(report));
  const Device device = opt.backend == Backend::kCuda ? Device::cuda(group.rank()) : Device::cpu();
  try {
    Ctx ctx{opt,
            group,
            report,
            device,
            make_stream(device),
            opt.iters,
            opt.warmup,
            make_caching_allocator()};
    for (const std::string& mode : opt.modes) {
      const std::vector<int64_t> tokens =
          opt.tokens.empty() ? default_tokens(mode, opt.backend) : opt.tokens;
      for (int64_t T : tokens) {
        const int32_t rows_before = report.num_ops;
        try {
          if (mode == "ht") run_ht(ctx, T);
          if (mode == "ll") run_ll(ctx, T);
          if (mode == "a2a") run_a2a(ctx, T);
        } catch (const Error& e) {
          // Unsupported is a property of the build and backend, raised alike on every rank
          // before any communication: skip the mode, say why, go on with the others.
          if (e.code() != ErrorCode::kUnsupported) throw;
          report.num_ops = rows_before;
          OpResult& r = report.ops[report.num_ops++];
          std::memset(static_cast<void*>(&r), 0, sizeof(r));
          std::snprintf(r.op, sizeof(r.op), "%s", mode.c_str());
          r.num_tokens = T;
          r.skipped = true;
          std::snprintf(r.check_detail, sizeof(r.check_detail), "%s", e.what());
          if (group.rank() == 0)
            std::fprintf(stderr, "[epx-bench] %s T=%lld skipped: %s\n", mode.c_str(),
                         static_cast<long long>(T), e.what());
          break;  // the other token counts would be skipped for the same reason
        }
      }
    }
  } catch (const std::exception& e) {
    std::snprintf(report.error, sizeof(report.error), "%s", e.what());
    report.failed = 1;
    std::fprintf(stderr, "[epx-bench rank %d] error: %s\n", group.rank(), e.what());
    // Peers waiting for this rank stop with this message instead of timing out.
    group.transport()->abort(std::string("epx-bench rank ") + std::to_string(group.rank()) + ": " +
                             e.what());
  }
  return report.error[0] ? 1 : 0;  // check failures are reported per row
}

GroupOptions group_options(const Options& opt) {
  GroupOptions g;
  g.num_sms = opt.num_sms;
  g.ranks_per_node = opt.num_nodes > 1 ? opt.num_ranks / opt.num_nodes : 0;
  if (opt.timeout_ms > 0) g.timeout = std::chrono::milliseconds(opt.timeout_ms);
  return g;
}

// Records an error that happened outside run_rank (group creation) in the rank's report; an
// Unsupported topology is said to come from --nodes.
int rank_error(const Options& opt, RankReport& report, int rank, const std::exception& e) {
  const auto* error = dynamic_cast<const Error*>(&e);
  const std::string from = opt.num_nodes > 1 && error && error->code() == ErrorCode::kUnsupported
                               ? "--nodes " + std::to_string(opt.num_nodes) + ": "
                               : "";
  std::snprintf(report.error, sizeof(report.error), "%s%s", from.c_str(), e.what());
  report.failed = 1;
  std::fprintf(stderr, "[epx-bench rank %d] error: %s\n", rank, report.error);
  return 1;
}

// Runs every rank; the reports land in `reports[R]` (shared with forked children). Returns 0 when
// every rank finished without error (forked ranks: their exit status, so a crash counts too).
int run_all(const Options& opt, RankReport* reports) {
  const int R = opt.num_ranks;
  const GroupOptions gopt = group_options(opt);
  const std::string name = "epx-bench-" + std::to_string(getpid());
  const auto limit = std::chrono::hours(2);
  if (opt.backend == Backend::kCuda) {
    const UniqueId id = new_unique_id();  // before the fork: every child gets the same id
    return launch_local(
        R,
        [&](int r) {
          try {
            Group g = Group::cuda(r, R, id, r, gopt);
            return run_rank(opt, g, reports[r]);
          } catch (const std::exception& e) {
            return rank_error(opt, reports[r], r, e);
          }
        },
        limit);
  }
  if (opt.procs) {
    return launch_local(
        R,
        [&](int r) {
          try {
            Group g = Group::cpu_processes(r, R, name, gopt);
            return run_rank(opt, g, reports[r]);
          } catch (const std::exception& e) {
            return rank_error(opt, reports[r], r, e);
          }
        },
        limit);
  }
  std::vector<int> rc(R, 0);
  std::vector<std::thread> threads;
  for (int r = 0; r < R; ++r) {
    threads.emplace_back([&, r] {
      try {
        Group g = Group::cpu_threads(r, R, name, gopt);
        rc[r] = run_rank(opt, g, reports[r]);
      } catch (const std::exception& e) {
        rc[r] = rank_error(opt, reports[r], r, e);
      }
    });
  }
  for (auto& t : threads) t.join();
  return *std::max_element(rc.begin(), rc.end());
}

// ---- report -------------------------------------------------------------------------------------

struct Row {
  OpResult op;         // rank 0's timing and baselines
  CheckState check;    // merged over ranks
  std::string detail;  // first failure, "rank r: ..."
};

std::vector<Row> merge(const Options& opt, const RankReport* reports) {
  std::vector<Row> rows;
  const RankReport& r0 = reports[0];
  for (int i = 0; i < r0.num_ops; ++i) {
    Row row{r0.ops[i], r0.ops[i].check, ""};
    for (int r = 0; r < opt.num_ranks; ++r) {
      if (i >= reports[r].num_ops) continue;
      const OpResult& o = reports[r].ops[i];
      if (o.check == CheckState::kFail) {
        if (row.detail.empty()) row.detail = "rank " + std::to_string(r) + ": " + o.check_detail;
        row.check = CheckState::kFail;
      }
    }
    rows.push_back(row);
  }
  return rows;
}

const char* check_name(CheckState c) {
  return c == CheckState::kPass ? "PASS" : c == CheckState::kFail ? "FAIL" : "-";
}

std::string num(double v, int prec) {
  char b[64];
  std::snprintf(b, sizeof(b), "%.*f", prec, v);
  return b;
}

// " as N nodes x G" for --nodes N > 1, else "".
std::string nodes_label(const Options& opt) {
  if (opt.num_nodes == 1) return "";
  return " as " + std::to_string(opt.num_nodes) + " nodes x " +
         std::to_string(opt.num_ranks / opt.num_nodes);
}

void print_table(const Options& opt, const std::vector<Row>& rows) {
  const bool cuda = opt.backend == Backend::kCuda;
  std::printf(
      "\nepx-bench: backend %s%s, %d ranks%s, H=%lld K=%d E=%d, routing %s, %d iters "
      "(+%d warmup)%s, seed %llu\n",
      backend_name(opt.backend),
      cuda        ? " (one process per GPU)"
      : opt.procs ? " (processes)"
                  : " (threads)",
      opt.num_ranks, nodes_label(opt).c_str(), static_cast<long long>(opt.hidden), opt.top_k,
      opt.num_experts, opt.routing.c_str(), opt.iters, opt.warmup,
      !cuda           ? ""
      : opt.pipelined ? ", timing pipelined (calls back to back)"
                      : ", timing barrier (each call alone)",
      static_cast<unsigned long long>(opt.seed));
  // The op column as wide as the longest name, so long names keep the table aligned.
  int w = 24;
  for (const Row& row : rows) w = std::max(w, static_cast<int>(std::strlen(row.op.op)));
  std::printf("%-*s %6s %10s %10s %10s %7s %9s %9s %8s %8s", w, "op", "T", "median_us", "min_us",
              "max_us", "row_B", "cross_MB", "recv_MB", "GB/s", "recvGB/s");
  if (cuda) std::printf(" %9s %9s %8s %8s", "nccl_us", "ceil_us", "epx/nccl", "ceil/epx");
  std::printf(" %5s %9s %5s\n", "SMs", "sym_MB", "check");
  for (const Row& row : rows) {
    const OpResult& o = row.op;
    if (o.skipped) {
      std::printf("%-*s %6lld SKIPPED: %s\n", w, o.op, static_cast<long long>(o.num_tokens),
                  o.check_detail);
      continue;
    }
    const double med = o.time.median_us;
    const double gbs = med > 0 ? o.cross_bytes / (med * 1e3) : 0;
    const double rgbs = med > 0 ? o.recv_bytes / (med * 1e3) : 0;
    std::printf("%-*s %6lld %10.1f %10.1f %10.1f %7s %9.3f %9.3f %8.2f %8.2f", w, o.op,
                static_cast<long long>(o.num_tokens), med, o.time.min_us, o.time.max_us,
                o.row_bytes > 0 ? num(o.row_bytes, 0).c_str() : "-", o.cross_bytes / 1e6,
                o.recv_bytes / 1e6, gbs, rgbs);
    if (cuda) {
      if (o.has_baselines) {
        std::printf(" %9.1f %9.1f %8.2f %8.2f", o.nccl.median_us, o.ceiling.median_us,
                    o.nccl.median_us > 0 ? med / o.nccl.median_us : 0,
                    med > 0 ? o.ceiling.median_us / med : 0);
      } else {
        std::printf(" %9s %9s %8s %8s", "-", "-", "-", "-");
      }
    }
    std::printf(" %5s %9.3f %5s\n", o.num_sms > 0 ? std::to_string(o.num_sms).c_str() : "auto",
                o.sym_bytes / 1e6, check_name(row.check));
  }
  std::printf(
      "(MB = 1e6 bytes, GB/s = 1e9 bytes/s; cross = received from other ranks, recv = "
      "all received; see --help)\n");
}

std::string json_str(const std::string& s) {
  std::string o = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      o += '\\';
      o += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char b[8];
      std::snprintf(b, sizeof(b), "\\u%04x", c);
      o += b;
    } else {
      o += c;
    }
  }
  return o + "\"";
}

std::string json_timing(const Timing& t) {
  return "{\"median_us\": " + num(t.median_us, 3) + ", \"min_us\": " + num(t.min_us, 3) +
         ", \"max_us\": " + num(t.max_us, 3) + "}";
}

// Returns false (after saying why on stderr) when the file could not be written.
bool write_json(const Options& opt, const std::vector<Row>& rows, const RankReport* reports,
                const std::string& date) {
  std::ofstream f(opt.json_path);
  if (!f) {
    std::fprintf(stderr, "epx-bench: error: cannot write --json %s: %s\n", opt.json_path.c_str(),
                 std::strerror(errno));
    return false;
  }
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  f << "{\n  \"tool\": \"epx-bench\",\n  \"date\": " << json_str(date)
    << ",\n  \"host\": " << json_str(host)
    << ",\n  \"cpu_cores\": " << std::thread::hardware_concurrency()
    << ",\n  \"command\": " << json_str(opt.command_line)
    << ",\n  \"backend\": " << json_str(backend_name(opt.backend))
    << ",\n  \"ranks\": " << opt.num_ranks << ",\n  \"nodes\": " << opt.num_nodes
    << ",\n  \"procs\": " << (opt.procs ? "true" : "false") << ",\n  \"hidden\": " << opt.hidden
    << ",\n  \"topk\": " << opt.top_k << ",\n  \"experts\": " << opt.num_experts
    << ",\n  \"routing\": " << json_str(opt.routing) << ",\n  \"iters\": " << opt.iters
    << ",\n  \"warmup\": " << opt.warmup << ",\n  \"num_sms\": " << opt.num_sms
    << ",\n  \"timing\": " << json_str(opt.pipelined ? "pipelined" : "barrier")
    << ",\n  \"seed\": " << opt.seed << ",\n  \"check\": " << (opt.check ? "true" : "false")
    << ",\n  \"errors\": [";
  bool first = true;
  for (int r = 0; r < opt.num_ranks; ++r) {
    if (!reports[r].error[0]) continue;
    f << (first ? "" : ", ") << "{\"rank\": " << r
      << ", \"message\": " << json_str(reports[r].error) << "}";
    first = false;
  }
  f << "],\n  \"results\": [";
  for (size_t i = 0; i < rows.size(); ++i) {
    const OpResult& o = rows[i].op;
    const double med = o.time.median_us;
    if (o.skipped) {
      f << (i ? "," : "") << "\n    {\"op\": " << json_str(o.op) << ", \"tokens\": " << o.num_tokens
        << ", \"skipped\": " << json_str(o.check_detail) << "}";
      continue;
    }
    f << (i ? "," : "") << "\n    {\"op\": " << json_str(o.op) << ", \"tokens\": " << o.num_tokens
      << ", \"time\": " << json_timing(o.time) << ", \"cross_bytes\": " << num(o.cross_bytes, 0)
      << ", \"recv_bytes\": " << num(o.recv_bytes, 0) << ", \"row_bytes\": " << num(o.row_bytes, 0)
      << ", \"cross_gbps\": " << num(med > 0 ? o.cross_bytes / (med * 1e3) : 0, 3)
      << ", \"recv_gbps\": " << num(med > 0 ? o.recv_bytes / (med * 1e3) : 0, 3);
    if (o.has_baselines) {
      f << ", \"nccl\": " << json_timing(o.nccl) << ", \"ceiling\": " << json_timing(o.ceiling)
        << ", \"ceiling_sms\": " << o.ceiling_sms
        << ", \"epx_over_nccl\": " << num(o.nccl.median_us > 0 ? med / o.nccl.median_us : 0, 4)
        << ", \"ceiling_over_epx\": " << num(med > 0 ? o.ceiling.median_us / med : 0, 4);
    }
    f << ", \"num_sms\": " << o.num_sms << ", \"sym_bytes_per_rank\": " << o.sym_bytes
      << ", \"check\": " << json_str(check_name(rows[i].check));
    if (!rows[i].detail.empty()) f << ", \"check_detail\": " << json_str(rows[i].detail);
    f << "}";
  }
  f << "\n  ]\n}\n";
  f.flush();
  if (!f) {
    std::fprintf(stderr, "epx-bench: error: writing --json %s failed: %s\n",
                 opt.json_path.c_str(), std::strerror(errno));
    return false;
  }
  std::fprintf(stderr, "[epx-bench] wrote %s\n", opt.json_path.c_str());
  return true;
}

int main_impl(int argc, char** argv) {
  const Options opt = parse(argc, argv);
  const time_t now = std::time(nullptr);
  char date[64];
  std::strftime(date, sizeof(date), "%Y-%m-%d %H:%M:%S %Z", std::localtime(&now));

  // Reports live in an anonymous shared mapping so forked ranks can write them.
  const size_t bytes = sizeof(RankReport) * opt.num_ranks;
  void* mem = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) {
    std::perror("epx-bench: mmap");
    return 1;
  }
  auto* reports = static_cast<RankReport*>(mem);
  std::memset(static_cast<void*>(reports), 0, bytes);
  std::fprintf(stderr, "[epx-bench] %s backend, %d ranks%s, modes:", backend_name(opt.backend),
               opt.num_ranks, nodes_label(opt).c_str());
  for (const auto& m : opt.modes) std::fprintf(stderr, " %s", m.c_str());
  std::fprintf(stderr, "%s\n", opt.check ? " (with --check)" : "");

  const int ranks_status = run_all(opt, reports);

  const std::vector<Row> rows = merge(opt, reports);
  print_table(opt, rows);
  int status = 0;
  if (ranks_status != 0) {
    std::printf("ERROR: a rank exited with status %d\n", ranks_status);
    status = 1;
  }
  for (int r = 0; r < opt.num_ranks; ++r) {
    if (reports[r].error[0]) {
      std::printf("ERROR rank %d: %s\n", r, reports[r].error);
      status = 1;
    }
  }
  if (opt.check) {
    for (const Row& row : rows) {
      if (row.op.skipped) {
        std::printf("SKIP %s T=%lld: %s\n", row.op.op, static_cast<long long>(row.op.num_tokens),
                    row.op.check_detail);
        continue;
      }
      std::printf("%s %s T=%lld%s%s\n", check_name(row.check), row.op.op,
                  static_cast<long long>(row.op.num_tokens), row.detail.empty() ? "" : ": ",
                  row.detail.c_str());
      if (row.check == CheckState::kFail) status = 1;
    }
    const bool any_skipped =
        std::any_of(rows.begin(), rows.end(), [](const Row& r) { return r.op.skipped; });
    std::printf("check: %s%s\n", status == 0 ? "all PASS" : "FAILED",
                any_skipped ? " (skipped modes not checked)" : "");
  }
  if (!opt.json_path.empty() && !write_json(opt, rows, reports, date)) {
    std::printf("ERROR: --json %s was not written\n", opt.json_path.c_str());
    status = 1;
  }
  std::fflush(stdout);
  munmap(mem, bytes);
  return status;
}

}  // namespace
}  // namespace epx::bench

int main(int argc, char** argv) {
  try {
    return epx::bench::main_impl(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "epx-bench: %s\n", e.what());
    return 1;
  }
}

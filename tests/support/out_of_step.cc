// tests/support/out_of_step.cc — see out_of_step.h.
#include "support/out_of_step.h"

#include <algorithm>
#include <barrier>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <thread>

#include "epx/buffer.h"
#include "epx/dispatcher.h"
#include "epx/error.h"
#include "support/harness.h"

namespace epx::testing {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr int kRanks = kOutOfStepRanks;
constexpr int kIterations = 24;
constexpr int64_t kH = 128, kTMax = 12;
constexpr int kK = 3, kE = 6;

enum Point { kBeforeDispatch, kBeforeCombine, kBeforeHook, kBeforeReset, kNumPoints };

// Where and how long the straggler of one step waits.
struct Fault {
  int rank = -1;
  int point = kBeforeDispatch;
  milliseconds delay{0};
  void at(int r, int p) const {
    if (r == rank && p == point && delay.count() > 0) std::this_thread::sleep_for(delay);
  }
};

// Inputs of one rank for one step: random, so rows of another step never look right.
struct StepInput {
  int64_t T;
  std::vector<uint16_t> x;
  std::vector<int64_t> topk;
  std::vector<float> w;
  std::vector<uint16_t> y_ll;  // ll expert outputs [L, R*T_max, H]
};

StepInput make_input(int step, int rank) {
  std::mt19937_64 rng(1000003ull * static_cast<uint64_t>(step) + 17ull * rank + 5);
  StepInput in;
  in.T = 1 + static_cast<int64_t>(rng() % kTMax);
  in.x.resize(in.T * kH);
  for (auto& v : in.x) v = static_cast<uint16_t>(0x3c00 + rng() % 0x0800);  // modest finite bf16
  in.topk.resize(in.T * kK);
  for (int64_t t = 0; t < in.T; ++t) {
    std::vector<int64_t> experts(kE);
    for (int e = 0; e < kE; ++e) experts[e] = e;
    std::shuffle(experts.begin(), experts.end(), rng);
    for (int k = 0; k < kK; ++k) in.topk[t * kK + k] = (rng() % 5 == 0) ? -1 : experts[k];
  }
  in.w.resize(in.T * kK);
  for (auto& v : in.w) v = static_cast<float>(rng() % 1000) / 997.0f;
  const int64_t L = kE / kRanks;
  in.y_ll.resize(L * kRanks * kTMax * kH);
  for (auto& v : in.y_ll) v = static_cast<uint16_t>(0x3c00 + rng() % 0x0800);
  return in;
}

// One rank's objects of a scenario and one step through them; returns every output's bytes.
class Rank {
 public:
  Rank(const Group& g, StepMode mode, StepIo io) : g_(g), mode_(mode), io_(std::move(io)) {
    const MoeShape shape{kH, kK, kE, kTMax};
    if (mode == StepMode::kDispatcher) {
      DispatcherConfig c;
      c.num_experts = kE;
      c.hidden = kH;
      c.top_k = kK;
      c.max_tokens_per_rank = kTMax;
      c.mode = DispatchMode::kNormal;
      c.allocator = io_.allocator;
      disp_ = std::make_unique<Dispatcher>(g, c);
      return;
    }
    BufferConfig c;
    c.enable_ht = mode == StepMode::kHt || mode == StepMode::kHtCached;
    c.enable_ll = !c.enable_ht;
    buf_ = std::make_unique<Buffer>(g, shape, c);
  }

  std::vector<uint8_t> step(int s, const Fault& f) {
    const int r = g_.rank();
    const StepInput in = make_input(s, r);
    const Tensor x = io_.upload(in.x.data(), in.x.size() * 2, DType::kBF16, {in.T, kH});
    const Tensor topk = io_.upload(in.topk.data(), in.topk.size() * 8, DType::kI64, {in.T, kK});
    const Tensor w = io_.upload(in.w.data(), in.w.size() * 4, DType::kF32, {in.T, kK});
    std::vector<uint8_t> out;
    auto add = [&](const TensorView& t) {
      if (!t.defined()) return;
      const std::vector<uint8_t> b = io_.download(t);
      out.insert(out.end(), b.begin(), b.end());
    };
    f.at(r, kBeforeDispatch);
    if (mode_ == StepMode::kDispatcher) {
      DispatchOutput d =
          disp_->dispatch(x, topk, w, ForwardMode::kExtend, std::nullopt, io_.stream);
      add(d.x);
      add(d.topk_idx);
      add(d.topk_weights);
      f.at(r, kBeforeCombine);
      CombineInput ci;
      ci.y = d.x;
      add(disp_->combine(ci));
      return out;
    }
    if (mode_ == StepMode::kHt || mode_ == StepMode::kHtCached) {
      HtDispatchArgs a;
      a.x = x;
      a.topk_idx = topk;
      a.topk_weights = w;
      a.stream = io_.stream;
      HtDispatchResult d = buf_->ht_dispatch(a, io_.allocator);
      add(d.recv_x);
      add(d.recv_topk_idx);
      add(d.recv_topk_weights);
      if (mode_ == StepMode::kHtCached) {
        f.at(r, kBeforeHook);  // the point between the two dispatches
        HtDispatchArgs cached;
        cached.x = x;
        cached.handle = &d.handle;
        cached.stream = io_.stream;
        add(buf_->ht_dispatch(cached, io_.allocator).recv_x);
      }
      f.at(r, kBeforeCombine);
      HtCombineArgs c;
      c.y = d.recv_x;
      c.topk_weights = d.recv_topk_weights;
      c.handle = &d.handle;
      c.stream = io_.stream;
      HtCombineResult cr = buf_->ht_combine(c, io_.allocator);
      add(cr.out);
      add(cr.combined_topk_weights);
      buf_->check();  // cuda: a kernel's error surfaces here (its outputs are not compared)
      return out;
    }
    LlDispatchArgs a;
    a.x = x;
    a.topk_idx = topk;
    a.use_fp8 = false;
    a.return_recv_hook = mode_ == StepMode::kLlHook;
    a.stream = io_.stream;
    LlDispatchResult d = buf_->ll_dispatch(a, io_.allocator);
    if (d.hook) {
      f.at(r, kBeforeHook);
      d.hook();
    }
    // Rows past each expert's count are not written: compare the counted ones only.
    const std::vector<uint8_t> counts = io_.download(d.recv_count);
    const std::vector<uint8_t> rows = io_.download(d.recv_x);
    out.insert(out.end(), counts.begin(), counts.end());
    const int64_t L = kE / kRanks, RT = kRanks * kTMax;
    for (int64_t l = 0; l < L; ++l) {
      int32_t n = 0;
      std::memcpy(&n, counts.data() + 4 * l, 4);
      if (n < 0 || n > RT) n = 0;  // garbage of a failed call: compared as such (counts differ)
      const uint8_t* p = rows.data() + l * RT * kH * 2;
      out.insert(out.end(), p, p + n * kH * 2);
    }
    f.at(r, kBeforeCombine);
    const Tensor y = io_.upload(in.y_ll.data(), in.y_ll.size() * 2, DType::kBF16, {L, RT, kH});
    LlCombineArgs c;
    c.y = y;
    c.topk_idx = topk;
    c.topk_weights = w;
    c.handle = &d.handle;
    c.return_recv_hook = mode_ == StepMode::kLlHook;
    c.stream = io_.stream;
    LlCombineResult cr = buf_->ll_combine(c, io_.allocator);
    if (cr.hook) {
      f.at(r, kBeforeHook);
      cr.hook();
    }
    add(cr.out);
    buf_->check();
    return out;
  }

  void reset() {
    if (disp_)
      disp_->reset();
    else
      buf_->reset();
  }

 private:
  const Group& g_;
  StepMode mode_;
  StepIo io_;
  std::unique_ptr<Buffer> buf_;
  std::unique_ptr<Dispatcher> disp_;
};

// The outputs of every step on every rank, from a run of the cpu backend without faults.
std::vector<std::vector<std::vector<uint8_t>>> reference(StepMode mode, int num_steps,
                                                         int ranks_per_node) {
  std::vector<std::vector<std::vector<uint8_t>>> ref(num_steps,
                                                     std::vector<std::vector<uint8_t>>(kRanks));
  GroupOptions options;
  options.ranks_per_node = ranks_per_node;
  run_threads(
      kRanks,
      [&](const Group& g) {
        Rank rank(g, mode, cpu_step_io());
        for (int s = 0; s < num_steps; ++s) ref[s][g.rank()] = rank.step(s, Fault{});
      },
      options);
  return ref;
}

// What a step (or reset) did on one rank.
enum Result : int { kOk, kTimeoutSeen, kOutOfStepSeen, kWrongRows, kOtherError };
const char* result_name(int r) {
  static const char* names[] = {"exact", "Timeout", "OutOfStep", "WRONG ROWS", "other error"};
  return names[r];
}

Result classify(const Error& e) {
  if (e.code() == ErrorCode::kTimeout) return kTimeoutSeen;
  if (e.code() == ErrorCode::kOutOfStep) return kOutOfStepSeen;
  return kOtherError;
}

}  // namespace

const char* step_mode_name(StepMode m) {
  switch (m) {
    case StepMode::kHt: return "ht";
    case StepMode::kHtCached: return "ht cached";
    case StepMode::kLl: return "ll";
    case StepMode::kLlHook: return "ll with hooks";
    case StepMode::kDispatcher: return "Dispatcher (normal mode)";
  }
  return "?";
}

StepIo cpu_step_io() {
  StepIo io;
  io.upload = [](const void* p, size_t bytes, DType dtype, const std::vector<int64_t>& shape) {
    Tensor t = default_allocator()(dtype, shape, Device::cpu());
    std::memcpy(t.data, p, bytes);
    return t;
  };
  io.download = [](const TensorView& t) {
    const auto* p = static_cast<const uint8_t*>(t.data);
    return std::vector<uint8_t>(p, p + t.numel() * dtype_size(t.dtype));
  };
  io.allocator = poison_allocator(0xA5);
  return io;
}

std::string ScenarioReport::summary(StepMode mode) const {
  char head[160];
  std::snprintf(head, sizeof(head), "[out of step] %s: %d steps x %d ranks in %.1f s",
                step_mode_name(mode), kIterations, kRanks, seconds);
  std::string s = head;
  for (const auto& [what, n] : counts) s += "\n  " + what + ": " + std::to_string(n);
  return s;
}

ScenarioReport run_out_of_step_scenario(
    StepMode mode, milliseconds timeout,
    const std::function<void(const std::function<void(const Group&)>&)>& run_ranks,
    const std::function<StepIo(const Group&)>& make_io,
    const std::function<void(const ScenarioReport&)>& on_done, int ranks_per_node) {
  // Steps 2i: the faulty step of iteration i; 2i + 1: the check after it, without faults.
  const auto ref = reference(mode, 2 * kIterations, ranks_per_node);
  std::mt19937 rng(static_cast<uint32_t>(mode) + 77);
  const double delays[] = {0, 0.24, 0.8, 1.32, 1.8, 2.48, 3.6};  // x the timeout
  std::vector<Fault> faults(kIterations);
  for (int i = 0; i < kIterations; ++i) {
    Fault& f = faults[i];
    f.rank = static_cast<int>(rng() % kRanks);
    do {
      f.point = static_cast<int>(rng() % kNumPoints);
    } while (f.point == kBeforeHook && mode != StepMode::kLlHook && mode != StepMode::kHtCached);
    f.delay = milliseconds(static_cast<int64_t>(delays[rng() % std::size(delays)] *
                                                static_cast<double>(timeout.count())));
  }

  ScenarioReport report;
  std::mutex mu;
  std::vector<int> step_result(kRanks);
  std::barrier sync(kRanks);
  const auto start = Clock::now();
  run_ranks([&](const Group& g) {
    const int r = g.rank();
    Rank rank(g, mode, make_io(g));
    auto note = [&](const std::string& what, int result, const std::string& detail = "") {
      std::lock_guard<std::mutex> lock(mu);
      ++report.counts[what + ": " + result_name(result)];
      if (result == kWrongRows || result == kOtherError)
        report.failures.push_back("rank " + std::to_string(r) + ", " + what + ": " +
                                  result_name(result) + " " + detail);
    };
    auto try_step = [&](int s, const Fault& f) -> std::pair<int, std::string> {
      try {
        return {rank.step(s, f) == ref[s][r] ? kOk : kWrongRows, ""};
      } catch (const Error& e) {
        return {classify(e), e.what()};
      }
    };
    auto try_reset = [&](const Fault& f) -> std::pair<int, std::string> {
      f.at(r, kBeforeReset);
      try {
        rank.reset();
        return {kOk, ""};
      } catch (const Error& e) {
        return {classify(e), e.what()};
      }
    };
    for (int i = 0; i < kIterations; ++i) {
      const Fault& f = faults[i];
      // A reset-point fault needs a failed step: its straggler is also late in the step.
      Fault step_fault = f;
      if (f.point == kBeforeReset) step_fault = Fault{f.rank, kBeforeDispatch, 2 * timeout};
      auto [res, what] = try_step(2 * i, step_fault);
      note("faulty step", res, what);
      if (res == kTimeoutSeen) {
        // Refused until the reset, without a collective wait (a refusal names the earlier
        // Timeout; the time bound only catches a call stuck on its peers, loosely, as the ranks
        // may share two cores).
        const auto t0 = Clock::now();
        auto [again, why] = try_step(2 * i, Fault{});
        const bool quick = Clock::now() - t0 < 4 * timeout;
        note("call after a Timeout",
             again == kOutOfStepSeen && quick ? kOutOfStepSeen : kOtherError,
             why + (quick ? "" : " (not at once)"));
      }
      if (res != kOk) {
        // Straight into the reset, as an engine would: it may meet a peer still in the step.
        auto [rr, rwhat] = try_reset(f);
        note("reset right after the failure", rr, rwhat);
      }
      step_result[r] = res;
      sync.arrive_and_wait();
      bool any_failed = false;
      for (int p = 0; p < kRanks; ++p) any_failed |= step_result[p] != kOk;
      if (r == 0 && any_failed) {
        std::lock_guard<std::mutex> lock(mu);
        ++report.failed_steps;
      }
      sync.arrive_and_wait();
      if (any_failed) {
        // Every rank resets together now (the engine's control plane saw the failure): this
        // must succeed.
        auto [rr, rwhat] = try_reset(Fault{});
        note("reset of every rank", rr == kOk ? kOk : kOtherError, rwhat);
      }
      auto [check, cwhat] = try_step(2 * i + 1, Fault{});
      note("step after it", check == kOk ? kOk : (check == kWrongRows ? kWrongRows : kOtherError),
           cwhat);
      sync.arrive_and_wait();
    }
    if (r == 0 && on_done) {
      report.seconds = std::chrono::duration<double>(Clock::now() - start).count();
      on_done(report);
    }
  });
  report.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return report;
}

}  // namespace epx::testing

// tests/support/out_of_step.h — the straggler scenarios of docs/semantics.md §4.3, shared by the
// cpu tier (tests/unit/out_of_step_test.cc) and the GPU tier (tests/gpu/out_of_step_gpu_test.cc).
//
// A scenario runs kIterations steps of one object and mode on kRanks ranks, with a straggler per
// step drawn from a seeded generator: its rank, its delay (from well under the group's timeout to
// past the reset's wait, twice the timeout) and where it waits (before the dispatch, before the
// combine, before a hook or the cached dispatch, before the reset after a failed step). Each rank
// resets right after a failure (meeting peers still in the step), then every rank resets together
// and runs a step without delays. Every step's outputs are compared, byte for byte, with a
// fault-free run of the same step on the cpu backend (inputs differ per step, so rows of another
// step never pass).
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "epx/group.h"
#include "epx/tensor.h"

namespace epx::testing {

enum class StepMode { kHt, kHtCached, kLl, kLlHook, kDispatcher };
const char* step_mode_name(StepMode m);

// How one rank's step moves data: inputs onto the group's device, outputs back as host bytes.
struct StepIo {
  // Host bytes -> a tensor the backend takes (cpu: a copy in host memory).
  std::function<Tensor(const void*, size_t, DType, const std::vector<int64_t>&)> upload;
  // A tensor's bytes (contiguous), after the rank's work is done.
  std::function<std::vector<uint8_t>(const TensorView&)> download;
  Allocator allocator;
  Stream stream = nullptr;
};
StepIo cpu_step_io();

struct ScenarioReport {
  std::map<std::string, int> counts;  // "<what>: <result>" -> times, over every rank and step
  std::vector<std::string> failures;  // wrong rows, unexpected errors, failed recoveries
  int failed_steps = 0;               // faulty steps that did not complete on some rank
  double seconds = 0;
  std::string summary(StepMode mode) const;
};

// Runs the scenario: `run_ranks(body)` runs body(group) on the scenario's ranks, every group with
// the given timeout; `io(group)` is each rank's StepIo. `on_done`, if given, gets the report on
// rank 0 inside body, once every rank finished (for runners that run the ranks in a child
// process, where the returned report stays empty). `ranks_per_node`: the topology run_ranks'
// groups have (GroupOptions::ranks_per_node; the fault-free reference runs on the same).
ScenarioReport run_out_of_step_scenario(
    StepMode mode, std::chrono::milliseconds timeout,
    const std::function<void(const std::function<void(const Group&)>&)>& run_ranks,
    const std::function<StepIo(const Group&)>& io,
    const std::function<void(const ScenarioReport&)>& on_done = {}, int ranks_per_node = 0);

inline constexpr int kOutOfStepRanks = 3;

}  // namespace epx::testing

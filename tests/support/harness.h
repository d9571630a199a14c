// tests/support/harness.h — run a body on R ranks of the cpu backend, as threads or processes.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "epx/group.h"
#include "epx/tensor.h"

namespace epx::testing {

// A process-unique name for a group ("epx-test-<pid>-<counter>-<tag>").
std::string unique_group_name(const std::string& tag);

// Runs body(group) on R threads, each with its own rank of a fresh cpu_threads group. Rethrows
// the first exception a rank threw (after all threads finished).
void run_threads(int num_ranks, const std::function<void(const Group&)>& body,
                 GroupOptions options = {});

// default_allocator() with every byte of each new tensor set to `byte`, so an output element the
// library forgets to write shows up.
Allocator poison_allocator(uint8_t byte);

// Runs body(group) in R forked processes over a fresh cpu_processes group. Returns 0 when every
// rank's body returned 0 (exceptions print and count as failure).
int run_processes(int num_ranks, const std::function<int(const Group&)>& body,
                  GroupOptions options = {});

}  // namespace epx::testing

// src/core/agree.h — values every rank must pass alike, and the one message for a difference
// (docs/semantics.md §4, "Agreement"):
//
//   "<op>: <what> differs across ranks: rank 0 has 256, rank 1 has 512; expected the same on every
//    rank"
//
// Construction (Buffer, A2a, Dispatcher, the Python drop-ins' lazily created buffers) calls
// agree(): ONE small exchange through the group's transport (Transport::allgather: two barriers,
// no allocation) BEFORE anything is validated further or mapped, so a difference is an
// InvalidArgument on every rank, naming every field that differs with each rank's value, never a
// mapping of another rank's size (SIGBUS) or a silently wrong layout. Per-call values are
// compared by the backends inside the exchange each operation already has (cpu: the published
// headers; cuda: the kernels' messages, reported through the device error record), with
// differs_message() for the text.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "epx/group.h"

namespace epx::detail {

// How a value reads in a message.
using ShowValue = std::string (*)(int64_t);
std::string show_int(int64_t v);
std::string show_bool(int64_t v);   // false / true
std::string show_dtype(int64_t v);  // dtype_name(DType(v)); -1: "none"
std::string show_f32_bits(int64_t v);  // the float32 whose bits are the low 32 bits of v

// "rank 0 has 256, rank 1 has 512"; ranks with the same value are listed together, values in the
// order of their first rank: "ranks 0, 2 have 256, rank 1 has 512" ("ranks 0-5, 7 have ..." for
// runs). values[p] is rank p's.
std::string per_rank_values(const std::vector<int64_t>& values, ShowValue show = show_int);
// "<op>: <what> differs across ranks: <per_rank_values>; expected the same on every rank".
std::string differs_message(const std::string& op, const std::string& what,
                            const std::vector<int64_t>& values, ShowValue show = show_int);
bool all_equal(const std::vector<int64_t>& values);

struct AgreeField {
  std::string name;  // as messages name it: "shape.hidden", "argument 'num_experts'"
  int64_t value = 0;
  ShowValue show = show_int;
};

// Collective over `group` (every rank calls it at the same point with the same `op` and the same
// field names): one Transport::allgather of the values. Every rank then throws InvalidArgument
// naming EVERY field that differs (differs_message, joined by "; "), or naming the rank that is at
// another agreement (another op: ranks creating different objects). `extra` values need not
// agree: their per-rank values are returned, rank-major ([R][extra.size()]). R = 1: no exchange.
// At most kMaxAgreeValues fields + extra values.
inline constexpr int kMaxAgreeValues = 52;
std::vector<std::vector<int64_t>> agree(const Group& group, const std::string& op,
                                        const std::vector<AgreeField>& fields,
                                        const std::vector<int64_t>& extra = {});

}  // namespace epx::detail

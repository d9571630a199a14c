// epx/shape.h — the MoE problem a buffer is sized for (kept apart from tuning knobs).
#pragma once

#include <cstdint>
#include <string>

namespace epx {

// The problem: fixed for the lifetime of a Buffer, equal on every rank.
struct MoeShape {
  int64_t hidden = 0;               // H; multiple of 128 where fp8 is used (ll always)
  int top_k = 0;                    // K, 1..32
  int num_experts = 0;              // E, a multiple of the group size R
  int64_t max_tokens_per_rank = 0;  // ht: largest T per call; ll: T_max (>= 1)

  int num_local_experts(int num_ranks) const { return num_experts / num_ranks; }
  std::string describe() const;  // "H=7168 K=8 E=256 max_tokens=4096"
};

// The three communication modes. Names are the same everywhere: ht, ll, a2a.
enum class Mode { kHt, kLl, kA2a };
const char* mode_name(Mode mode);

}  // namespace epx

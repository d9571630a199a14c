// src/core/ht_copy.cc — parse_ht_copy (declared in cuda/tuning.h): the syntax of EPX_HT_COPY.
// Plain C++ in the core so that every build, with or without CUDA, checks the variable at group
// creation (core/env.cc check_environment); the cuda backend reads it once (ht_copy_config).
#include <cstdlib>
#include <string>

#include "core/check.h"
#include "cuda/tuning.h"

namespace epx::detail {

HtCopyConfig parse_ht_copy(const std::string& spec, const char* what) {
  HtCopyConfig c;
  auto bad = [&]() {
    throw_error(
        ErrorCode::kInvalidArgument,
        cat(what, " is '", spec,
            "', expected warp[:bN], ce[:kept][:combine|:combine-auto][:bN] or bulk[:SxC][:bN] ",
            "(2 <= S <= 8 stages of C bytes, C a multiple of 16 in [16, 65536]; N >= 1 ",
            "tokens per batch)"));
  };
  size_t colon = spec.find(':');
  const std::string head = spec.substr(0, colon);
  if (head == "warp") {
    c.mode = HtCopyMode::kWarp;
  } else if (head == "bulk") {
    c.mode = HtCopyMode::kBulk;
  } else if (head == "ce") {
    c.mode = HtCopyMode::kEngine;
    std::string rest = colon == std::string::npos ? "" : spec.substr(colon);
    // A trailing ":bN": tokens per sender warp between two signals (the kernel senders' batch).
    const size_t last = rest.rfind(':');
    if (last != std::string::npos && last + 1 < rest.size() && rest[last + 1] == 'b') {
      char* end = nullptr;
      const long n = std::strtol(rest.c_str() + last + 2, &end, 10);
      if (last + 2 >= rest.size() || *end != '\0' || n < 1 || n > 1024) bad();
      c.send_batch = static_cast<int>(n);
      rest.resize(last);
    }
    const bool kept = rest.rfind(":kept", 0) == 0;
    const std::string tail = rest.substr(kept ? 5 : 0);
    if (tail == "") {
      c.engine_combine = HtEngineCombine::kOff;
    } else if (tail == ":combine") {
      c.engine_combine = HtEngineCombine::kOn;
    } else if (tail == ":combine-auto") {
      c.engine_combine = HtEngineCombine::kAuto;
    } else {
      bad();
    }
    c.engine_kept_only = kept;
    return c;
  } else {
    bad();
  }
  while (colon != std::string::npos) {
    const size_t next = spec.find(':', colon + 1);
    const std::string tok =
        spec.substr(colon + 1, next == std::string::npos ? next : next - colon - 1);
    colon = next;
    char* end = nullptr;
    if (!tok.empty() && tok[0] == 'b') {
      const long n = std::strtol(tok.c_str() + 1, &end, 10);
      if (tok.size() < 2 || *end != '\0' || n < 1 || n > 1024) bad();
      c.send_batch = static_cast<int>(n);
      continue;
    }
    const size_t x = tok.find('x');
    if (x == std::string::npos) bad();
    const long st = std::strtol(tok.c_str(), &end, 10);
    if (end != tok.c_str() + x) bad();
    const long ch = std::strtol(tok.c_str() + x + 1, &end, 10);
    if (x + 1 >= tok.size() || *end != '\0') bad();
    if (st < 2 || st > 8 || ch < 16 || ch > 65536 || ch % 16 != 0) bad();
    c.stages = static_cast<int>(st);
    c.chunk = static_cast<int>(ch);
  }
  return c;
}

}  // namespace epx::detail

// src/cuda/tuning.h — the one place the cuda backend turns "auto" tuning into numbers
// (STYLE: the problem apart from tuning). GroupOptions::num_sms (or EPX_NUM_SMS, read by
// src/core/env.cc) bounds the CTAs of every ht kernel; 0 means auto.
#pragma once

namespace epx::detail {

struct HtTuning {
  int num_sms = 16;            // CTAs of the dispatch and combine kernels (one per SM)
  int dispatch_send_ctas = 8;  // of which send (the rest receive)
  int combine_send_ctas = 8;
};

// Auto: 16 SMs (enough to saturate NVLink at EP2 with the copy-out alongside), clamped to the
// device; senders take half of the CTAs (none when R = 1: nothing leaves the rank).
HtTuning resolve_ht_tuning(int requested_sms, int device_sms, int num_ranks);

// Benchmark hook (never set by the library itself): values > 0 replace the SM count and the
// senders' share (percent) of the CTAs for buffers created afterwards in this process.
void set_ht_tuning_override(int num_sms, int dispatch_send_percent, int combine_send_percent);

}  // namespace epx::detail

// src/cuda/ll_send.cu — the send half of a hooked ll dispatch (kernels/ll/dispatch.cuh, steps
// 1-4), in a translation unit, and so a module, of its own.
//
// DeepEP's harness (and any profiler table an engine reads) matches kernel rows by name, one name
// per op, so the hook's two launches must carry the dispatch kernel's name. Compiled with the
// receive in one kernel, the send's registers and code followed every change to the receive
// (docs/perf.md §5 items 75-76). Here the send is a kernel of the same name and template
// arguments, epx::ll::dispatch<kQuant, kShrink, false>, with internal linkage: the same device
// symbol and demangled name, its own module and host stub. dispatch.cuh leaves its own kernel out
// of this file (EPX_LL_DISPATCH_SEND_MODULE), so there is one definition per translation unit.
#define EPX_LL_DISPATCH_SEND_MODULE 1

#include "cuda/ll_send.h"

#include "cuda/kernels/ll/dispatch.cuh"
#include "cuda/launch.h"

namespace epx::ll {

// The send half alone, on the whole CTA (kFused is false: the name's third argument).
template <int kQuant, bool kShrink, bool kFused>
static __global__ void __launch_bounds__(detail::kLlThreads, 1)
    dispatch(detail::LlDispatchParams p) {
  using namespace detail;
  static_assert(!kFused, "the send module holds the hooked send only");
  pdl_begin(p.pdl);
  const uint32_t e = ll_dispatch_epoch(p);
  EPX_LL_STAMP(p, 0, kTrDEntry);
  ll_dispatch_send<kQuant, kShrink, false>(p, e, ll_team_all());
}

}  // namespace epx::ll

namespace epx::detail {

namespace {
template <bool kShrink>
void launch_send_form(int ctas, cudaStream_t stream, const char* what, const LlDispatchParams& p) {
  ll_with_quant(p, [&](auto quant) {
    launch_kernel(ll::dispatch<decltype(quant)::value, kShrink, false>, ctas, kLlThreads, 0, stream,
                  p.pdl, what, p);
  });
}
}  // namespace

void launch_ll_dispatch_send(int ctas, cudaStream_t stream, const char* what,
                             const LlDispatchParams& p) {
  if (p.symm.shrink)
    launch_send_form<true>(ctas, stream, what, p);
  else
    launch_send_form<false>(ctas, stream, what, p);
}

}  // namespace epx::detail

// src/cuda/a2a.cu — the cuda backend of the a2a mode (docs/semantics.md §3): CudaA2a (set-up, the
// shape agreement, device-error reporting, teardown) and the dispatch / combine launchers. Device
// code is in kernels/a2a/ (layout: a2a_layout.cuh; protocols: dispatch.cuh, combine.cuh). The
// lifecycle every mode shares (device, workspace, error record, decode, teardown) is its
// DeviceObject (device_object.h).
//
// Data flow, rank r of R, C CTAs per kernel (GroupOptions::num_sms, auto 64):
//   construction  symmetric workspace (transport allocate: collective, zeroed) -> header {shape,
//                 C} published -> barrier -> every peer's header read on the device -> barrier ->
//                 every rank compares with rank 0 (InvalidArgument on all ranks on a mismatch)
//   dispatch      ONE kernel on the caller's stream: routing + push of every payload row into the
//                 destinations' receive rows + counts + completion counters + wait for all
//                 sources + sanitising; returns views of the workspace. No host synchronisation.
//   combine       ONE kernel on the caller's stream: (copy y into the region) + signal + wait +
//                 pull and reduce in ascending rank order into out [T, H] from the allocator.
// Both are CUDA-graph capturable: epochs live on the device and advance in the kernels; T, M,
// pointers and vector widths are fixed at capture like any kernel argument.
//
// View lifetime: a peer pushes its next dispatch into this rank's receive rows only after this
// rank entered that dispatch (entry flags), so views stay valid until this rank's next dispatch.
//   set_active_ranks  ONE single-CTA kernel on the given stream (kernels/a2a/resync.cuh): writes
//                 the mask into device memory and resets the epochs among the active ranks, so a
//                 captured graph replayed later sees the new mask and consistent epochs.
// Errors found on the device (out-of-range expert ids, geometry differing across ranks,
// timeouts, masks differing across active ranks) are raised by check(), which epx::A2a calls at
// the start of every operation. After a timeout epx::A2a refuses to run until set_active_ranks.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/buffer_impl.h"
#include "core/check.h"
#include "cuda/a2a.h"
#include "cuda/cuda_check.h"
#include "cuda/device_object.h"
#include "cuda/kernels/a2a/combine.cuh"
#include "cuda/kernels/a2a/dispatch.cuh"
#include "cuda/kernels/a2a/resync.cuh"
#include "transport/transport.h"

namespace epx::detail {

namespace {

constexpr const char* kShapeFieldNames[] = {"max_tokens_per_rank", "top_k", "num_experts",
                                            "combine_bytes_per_token", "payload_bytes_per_token"};
constexpr int kNumShapeFields = 4 + kMaxA2aPayloads;

// Auto tuning of the a2a kernels, in one place: C CTAs of 512 threads for both kernels. 64 is
// enough to keep NVLink busy at EP2 in both directions (docs/perf.md §3: pushes saturate
// from 8-16 CTAs, pulls from 16-32) while small calls still spread over many SMs.
int resolve_a2a_ctas(int requested, int device_sms) {
  const int c = requested > 0 ? requested : kA2aDefaultCtas;
  return std::clamp(c, 1, std::min(kMaxA2aCtas, std::max(1, device_sms)));
}

// Largest copy unit (16/8/4/2/1 bytes) dividing every address and byte size given.
int vector_bytes(std::initializer_list<uint64_t> values) {
  uint64_t acc = 0;
  for (uint64_t v : values) acc |= v;
  for (int b : {16, 8, 4, 2})
    if (acc % b == 0) return b;
  return 1;
}

void shape_fields(const A2aShape& s, int64_t* f) {
  f[0] = s.max_tokens_per_rank;
  f[1] = s.top_k;
  f[2] = s.num_experts;
  f[3] = static_cast<int64_t>(s.combine_bytes_per_token);
  for (int i = 0; i < kMaxA2aPayloads; ++i)
    f[4 + i] = i < static_cast<int>(s.payload_bytes_per_token.size())
                   ? static_cast<int64_t>(s.payload_bytes_per_token[i])
                   : 0;
}

// out[p] = rank p's header (construction only, after a barrier: nothing writes headers then).
__global__ void a2a_gather_headers_kernel(A2aSymm symm, A2aHeader* out) {
  constexpr int kWords = sizeof(A2aHeader) / sizeof(int64_t);
  const int p = blockIdx.x;
  const auto* src = reinterpret_cast<const int64_t*>(symm.layout.header(symm.peers[p]));
  if (threadIdx.x < kWords)
    reinterpret_cast<int64_t*>(out + p)[threadIdx.x] =
        __ldcg(reinterpret_cast<const long long*>(src) + threadIdx.x);
}

// What an a2a wait awaited (DeviceErrorRecord::a, ::op), in the words of the a2a protocol.
const char* a2a_awaited(const DeviceErrorRecord& e) {
  if (e.op == kOpA2aResync) return "the peer to take part in set_active_ranks";
  if (e.a == kWaitReady) return "the peer to enter the same dispatch";
  return e.op == kOpA2aDispatch ? "the rows and counts the peer sends"
                                : "the peer's combine payload";
}

class CudaA2a final : public A2aImpl {
 public:
  CudaA2a(const Group& group, const A2aShape& shape);
  ~CudaA2a() override;

  size_t bytes_allocated() const override { return dev_.bytes(); }
  void check() override;
  A2aDispatchResult dispatch(const A2aDispatchArgs& args) override;
  TensorView combine_payload_view(int64_t runtime_max, int64_t hidden, DType dtype) override {
    return TensorView::contiguous(layout_.combine(local()), dtype,
                                  {group.size(), runtime_max, hidden}, Device::cuda(dev_.device()));
  }
  Tensor combine(const TensorView& y, int64_t runtime_max, bool payload_in_workspace, Stream stream,
                 const Allocator& alloc) override;
  void set_active_ranks(uint64_t active_mask, Stream stream) override;
  A2aDropCounts dropped_counts() override;
  void reset_dropped_counts(Stream stream) override;

 private:
  char* local() const { return dev_.local(); }
  A2aSymm symm() const;
  template <A2aElem kElem>
  void launch_combine(int vector_bytes, const A2aCombineParams& p, cudaStream_t stream);

  // The device, the workspace, the error record; closed first in ~CudaA2a.
  DeviceObject dev_;
  int num_ctas_ = 1;
  uint32_t peer_ctas_[kMaxRanks] = {};
  A2aLayout layout_;
  uint32_t resync_generation_ = 0;  // set_active_ranks calls so far
  // The last dispatch (combine reduces its tokens).
  int64_t num_tokens_ = 0;
  int64_t runtime_max_ = 0;
  int64_t row_bytes_[kMaxA2aPayloads] = {};
};

CudaA2a::CudaA2a(const Group& group, const A2aShape& shape)
    : A2aImpl(group, shape), dev_(group, "A2a") {
  const int R = group.size(), me = group.rank();
  DeviceGuard guard(dev_.device());
  num_ctas_ = resolve_a2a_ctas(group.options().num_sms, dev_.multiprocessors());
  layout_ = A2aLayout::make(shape, R);

  // The workspace (collective; zeroed).
  dev_.allocate_region(layout_.total_bytes, layout_.state_off + offsetof(A2aState, dev));

  // Every rank must have built the same layout: publish the shape (and C), read every peer's.
  A2aHeader header{};
  shape_fields(shape, header.shape);
  header.num_ctas = num_ctas_;
  EPX_CUDA_CHECK(
      cudaMemcpy(layout_.header(local()), &header, sizeof(header), cudaMemcpyHostToDevice), "A2a");
  group.transport()->barrier("A2a (publish shape)");
  A2aHeader* gathered = nullptr;
  EPX_CUDA_CHECK(cudaMalloc(&gathered, sizeof(A2aHeader) * R), "A2a");
  std::vector<A2aHeader> headers(R);
  a2a_gather_headers_kernel<<<R, 32>>>(symm(), gathered);
  cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess)
    e = cudaMemcpy(headers.data(), gathered, sizeof(A2aHeader) * R, cudaMemcpyDeviceToHost);
  cudaFree(gathered);
  if (e != cudaSuccess) throw_cuda(e, "reading the peers' headers", "A2a");
  group.transport()->barrier("A2a (check shape)");  // nobody frees a header a peer still reads
  for (int f = 0; f < kNumShapeFields; ++f) {
    for (int p = 1; p < R; ++p) {
      if (headers[p].shape[f] == headers[0].shape[f]) continue;
      throw_error(ErrorCode::kInvalidArgument,
                  cat("A2a: A2aShape field ", kShapeFieldNames[f < 4 ? f : 4],
                      f < 4 ? std::string() : cat("[", f - 4, "]"),
                      " differs across ranks: rank 0 has ", headers[0].shape[f], ", rank ", p,
                      " has ", headers[p].shape[f], "; expected the same value on every rank"));
    }
  }
  for (int p = 0; p < R; ++p) {
    EPX_CHECK(headers[p].num_ctas >= 1 && headers[p].num_ctas <= kMaxA2aCtas, ErrorCode::kInternal,
              "A2a: rank ", p, " published ", headers[p].num_ctas, " CTAs (rank ", me, ")");
    peer_ctas_[p] = static_cast<uint32_t>(headers[p].num_ctas);
  }
}

CudaA2a::~CudaA2a() {
  dev_.close("A2a destruction");
}

A2aSymm CudaA2a::symm() const {
  A2aSymm s{};
  s.local = local();
  for (int p = 0; p < group.size(); ++p) {
    s.peers[p] = dev_.peer(p);
    s.peer_ctas[p] = peer_ctas_[p];
  }
  s.layout = layout_;
  return s;
}

void CudaA2a::check() {
  const std::optional<DeviceErrorRecord> rec = dev_.recorded();
  if (!rec) return;
  const DeviceErrorRecord& e = *rec;
  const char* op = device_op_name(e.op);
  // Timeouts and mask differences keep the record (every later check() raises again) until
  // set_active_ranks clears it: the ranks no longer agree on epochs or on the mask.
  if (e.code == kDevErrTimeout) {
    dev_.raise_timeout(e, {.awaited = a2a_awaited(e),
                           .unusable = "this A2a is unusable until every surviving rank calls "
                                       "set_active_ranks (without the failed ranks)",
                           .timeout_multiple = e.op == kOpA2aResync ? 2 : 1});
  }
  if (e.code == kDevErrA2aMask) {
    auto show = [&](int64_t v) {
      std::string s = "[";
      for (int p = 0; p < group.size(); ++p) s += (static_cast<uint64_t>(v) >> p & 1) ? "1" : "0";
      return s + "]";
    };
    throw_error(ErrorCode::kInvalidArgument,
                cat(op, ": argument 'active' differs across active ranks: rank ", e.rank, " has ",
                    show(e.a), ", rank ", e.peer, " has ", show(e.b),
                    " (rank 0 first); expected the same mask on every active rank"));
  }
  // Not fatal: the collective completed. Let the device report the next error.
  dev_.rearm();
  if (e.code == kDevErrA2aGeometry) {
    const int64_t field = e.a >> 32;
    const auto mine = static_cast<int32_t>(static_cast<uint32_t>(e.a & 0xffffffff));
    std::string what;
    auto show = [&](int64_t v) {
      return field == kGeomCombineDtype ? std::string(dtype_name(static_cast<DType>(v)))
                                        : std::to_string(v);
    };
    if (field == kGeomRuntimeMax) {
      what = "argument 'runtime_max_tokens_per_rank'";
    } else if (field >= kGeomRowBytes && field < kGeomRowBytes + kMaxA2aPayloads) {
      what = cat("the bytes per token of argument 'payloads[", field - kGeomRowBytes, "]'");
    } else if (field == kGeomCombineHidden) {
      what = "the hidden size (dim 2) of argument 'y'";
    } else {
      what = "the dtype of argument 'y'";
    }
    throw_error(ErrorCode::kInvalidArgument,
                cat(op, ": ", what, " differs across ranks: rank ", e.rank, " has ", show(mine),
                    ", rank ", e.peer, " has ", show(e.b),
                    "; expected the same value on every rank (the outputs of this call are "
                    "undefined)"));
  }
  DeviceObject::raise_common(e, shape.num_experts);  // out-of-range expert ids, unknown codes
}

A2aDispatchResult CudaA2a::dispatch(const A2aDispatchArgs& args) {
  DeviceGuard guard(dev_.device());
  const int R = group.size(), me = group.rank();
  const TensorView& idx = args.topk_idx;
  const int64_t T = idx.shape[0], M = args.runtime_max_tokens_per_rank;
  const int P = static_cast<int>(args.payloads.size());

  A2aDispatchParams p{};
  p.topk_idx = idx.data;
  p.topk_stride = idx.strides[0];
  p.topk_is_i64 = idx.dtype == DType::kI64;
  p.num_tokens = static_cast<int32_t>(T);
  p.top_k = shape.top_k;
  p.num_experts = shape.num_experts;
  p.num_local_experts = shape.num_experts / R;
  p.num_ranks = R;
  p.rank = me;
  p.runtime_max = static_cast<int32_t>(M);
  p.num_payloads = P;
  for (int i = 0; i < P; ++i) {
    const TensorView& v = args.payloads[i];
    int64_t row = static_cast<int64_t>(dtype_size(v.dtype));  // dims 1.. (works for T = 0)
    for (int d = 1; d < v.ndim; ++d) row *= v.shape[d];
    row_bytes_[i] = row;
    p.payloads[i].src = static_cast<const char*>(v.data);
    p.payloads[i].row_bytes = row;
    p.payloads[i].vec_bytes =
        vector_bytes({reinterpret_cast<uint64_t>(v.data), static_cast<uint64_t>(row)});
  }
  p.sanitise_index = args.invalid_expert_id.has_value() ? args.expert_id_payload_index : -1;
  p.invalid_expert_id = args.invalid_expert_id.value_or(0);
  p.symm = symm();
  p.wait = dev_.wait_context(kOpA2aDispatch);
  a2a_dispatch_kernel<<<num_ctas_, kA2aThreads, 0, static_cast<cudaStream_t>(args.stream)>>>(p);
  EPX_CUDA_CHECK(cudaGetLastError(), "a2a dispatch");
  num_tokens_ = T;
  runtime_max_ = M;

  A2aDispatchResult result;
  for (int i = 0; i < P; ++i) {
    const TensorView& v = args.payloads[i];
    std::vector<int64_t> dims = {R, M};
    for (int d = 1; d < v.ndim; ++d) dims.push_back(v.shape[d]);
    result.recv.push_back(TensorView::contiguous(layout_.recv(local(), i), v.dtype, dims,
                                                 Device::cuda(dev_.device())));
  }
  result.recv_counts = TensorView::contiguous(layout_.counts(local()), DType::kI32, {R},
                                              Device::cuda(dev_.device()));
  return result;
}

// The combine kernel for y's element type and the widest vector every address and row allows.
template <A2aElem kElem>
void CudaA2a::launch_combine(int vector_bytes, const A2aCombineParams& p, cudaStream_t stream) {
  switch (vector_bytes) {
    case 16:
      a2a_combine_kernel<uint4, kElem><<<num_ctas_, kA2aThreads, 0, stream>>>(p);
      break;
    case 8:
      a2a_combine_kernel<uint2, kElem><<<num_ctas_, kA2aThreads, 0, stream>>>(p);
      break;
    case 4:
      a2a_combine_kernel<uint32_t, kElem><<<num_ctas_, kA2aThreads, 0, stream>>>(p);
      break;
    default:  // 2: one 16-bit element (f32 rows are 4-byte aligned: the caller's max(vb, 4))
      if constexpr (kElemBytes<kElem> == 2)
        a2a_combine_kernel<uint16_t, kElem><<<num_ctas_, kA2aThreads, 0, stream>>>(p);
      else
        EPX_CHECK(false, ErrorCode::kInternal, "a2a combine: f32 rows with 2-byte vectors");
      break;
  }
}

Tensor CudaA2a::combine(const TensorView& y, int64_t runtime_max, bool payload_in_workspace,
                        Stream stream_handle, const Allocator& alloc) {
  DeviceGuard guard(dev_.device());
  auto stream = static_cast<cudaStream_t>(stream_handle);
  const int R = group.size(), me = group.rank();
  const int64_t H = y.shape[2], M = runtime_max;
  const int64_t elem = static_cast<int64_t>(dtype_size(y.dtype));
  char* region = layout_.combine(local());

  A2aCombineParams p{};
  p.y = payload_in_workspace ? region : static_cast<const char*>(y.data);
  p.y_stride0 = payload_in_workspace ? M * H * elem : y.strides[0] * elem;
  p.y_stride1 = payload_in_workspace ? H * elem : y.strides[1] * elem;
  p.hidden_bytes = H * elem;
  p.hidden = static_cast<int32_t>(H);
  p.dtype = static_cast<int32_t>(y.dtype);
  p.num_tokens = static_cast<int32_t>(num_tokens_);
  p.num_ranks = R;
  p.rank = me;
  p.runtime_max = static_cast<int32_t>(M);
  p.in_workspace = payload_in_workspace;
  p.symm = symm();
  p.wait = dev_.wait_context(kOpA2aCombine);

  // The output first. If the allocator fails, still run the collective part (publish, signal,
  // wait; no reduction) so the peers complete, then report.
  Tensor out;
  std::exception_ptr failed;
  try {
    out = alloc(y.dtype, {num_tokens_, H}, Device::cuda(dev_.device()));
    EPX_CHECK(num_tokens_ * H == 0 || (out.data != nullptr && out.is_contiguous() &&
                                       out.device == Device::cuda(dev_.device())),
              ErrorCode::kInvalidArgument, "a2a combine: the allocator returned ", out.describe(),
              ", expected a contiguous tensor [", num_tokens_, ", ", H,
              "] on cuda:", dev_.device());
    p.out = static_cast<char*>(out.data);
  } catch (...) {
    failed = std::current_exception();
    p.out = nullptr;
    p.num_tokens = 0;
  }

  int vb = vector_bytes({reinterpret_cast<uint64_t>(p.y), static_cast<uint64_t>(p.y_stride0),
                         static_cast<uint64_t>(p.y_stride1), static_cast<uint64_t>(p.hidden_bytes),
                         reinterpret_cast<uint64_t>(p.out), reinterpret_cast<uint64_t>(region)});
  vb = std::max(vb, static_cast<int>(elem));  // rows of whole elements (validated dtype)
  switch (y.dtype) {
    case DType::kBF16:
      launch_combine<A2aElem::kBf16>(vb, p, stream);
      break;
    case DType::kF16:
      launch_combine<A2aElem::kF16>(vb, p, stream);
      break;
    default:  // f32 (validate_a2a_combine admits no other)
      launch_combine<A2aElem::kF32>(vb, p, stream);
      break;
  }
  EPX_CUDA_CHECK(cudaGetLastError(), "a2a combine");
  if (failed) std::rethrow_exception(failed);
  return out;
}

void CudaA2a::set_active_ranks(uint64_t active_mask, Stream stream) {
  DeviceGuard guard(dev_.device());
  // The record of an earlier Timeout would be raised again by the next check() before the
  // resync kernel clears it on the device; the claim word stays set until then, so no kernel can
  // write a new record in between.
  dev_.clear_record();
  A2aResyncParams p{};
  p.symm = symm();
  p.wait = dev_.wait_context(kOpA2aResync);
  p.wait.timeout_ns = 2 * dev_.timeout_ns();
  p.error = dev_.error_on_device();
  p.active_mask = active_mask;
  p.generation = resync_generation_ + 1;
  p.num_ranks = group.size();
  p.rank = group.rank();
  a2a_resync_kernel<<<1, kA2aThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
  EPX_CUDA_CHECK(cudaGetLastError(), "a2a set_active_ranks");
  ++resync_generation_;  // only a launched resync counts (a failed launch leaves it for a retry)
}

A2aDropCounts CudaA2a::dropped_counts() {
  DeviceGuard guard(dev_.device());
  EPX_CUDA_CHECK(cudaDeviceSynchronize(), "a2a dropped_counts");
  unsigned long long v[2] = {0, 0};
  EPX_CUDA_CHECK(
      cudaMemcpy(v, &layout_.state(local())->dropped_tokens, sizeof(v), cudaMemcpyDeviceToHost),
      "a2a dropped_counts");
  return A2aDropCounts{static_cast<int64_t>(v[0]), static_cast<int64_t>(v[1])};
}

static_assert(offsetof(A2aState, dropped_selections) ==
                  offsetof(A2aState, dropped_tokens) + sizeof(unsigned long long),
              "dropped_counts copies both counters at once");

void CudaA2a::reset_dropped_counts(Stream stream) {
  DeviceGuard guard(dev_.device());
  EPX_CUDA_CHECK(cudaMemsetAsync(&layout_.state(local())->dropped_tokens, 0,
                                 2 * sizeof(unsigned long long), static_cast<cudaStream_t>(stream)),
                 "a2a reset_dropped_counts");
}

}  // namespace

// Called by make_cuda_a2a / cuda_a2a_bytes (src/cuda/cuda_buffer.cc).
std::unique_ptr<A2aImpl> cuda_a2a_create(const Group& group, const A2aShape& shape) {
  EPX_CHECK(group.backend() == Backend::kCuda, ErrorCode::kInvalidArgument,
            "A2a: the cuda backend needs a cuda group");
  // The limits of the a2a kernels, before anything is allocated.
  const int R = group.size();
  EPX_CHECK(R <= kMaxRanks, ErrorCode::kUnsupported, "A2a: the group has ", R,
            " ranks; the cuda a2a kernels support at most ", kMaxRanks);
  EPX_CHECK(shape.max_tokens_per_rank * R <= (int64_t{1} << 30), ErrorCode::kUnsupported,
            "A2a: shape.max_tokens_per_rank is ", shape.max_tokens_per_rank, " on ", R,
            " ranks; the cuda a2a kernels support at most 2^30 receive rows per rank");
  return std::make_unique<CudaA2a>(group, shape);
}

size_t cuda_a2a_layout_bytes(const A2aShape& shape, int num_ranks) {
  return A2aLayout::make(shape, num_ranks).total_bytes;
}

}  // namespace epx::detail

// src/cuda/ll_nodes.cu — CudaLlNodes (cuda/ll_nodes.h): the hierarchical ll on virtual nodes, its
// host steps and the launches of kernels/ll/nodes.cuh (and ht's pack). Every launch and copy is on
// the caller's stream; the host never waits (the counts the outputs need stay on the device).
#include "cuda/ll_nodes.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "core/check.h"
#include "cuda/cuda_check.h"
#include "cuda/ht_nodes.h"
#include "cuda/kernels/ht/nodes_pack.cuh"
#include "cuda/kernels/ll/nodes.cuh"
#include "cuda/launch.h"
#include "cuda/ll.h"
#include "transport/device_copy_rail.h"
#include "transport/transport.h"

namespace epx::detail {

namespace {

MoeShape node_shape(const MoeShape& s, int num_nodes) {
  MoeShape n = s;
  n.num_experts = s.num_experts / num_nodes;
  return n;
}

TensorView view(void* data, DType dtype, int64_t rows, int64_t cols, int device) {
  return TensorView::contiguous(data, dtype, {rows, cols}, Device::cuda(device));
}

bool aligned16(const void* p, int64_t stride_bytes) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0 && stride_bytes % 16 == 0;
}

}  // namespace

struct CudaLlNodes::State {
  std::vector<LlHandle> handles;  // [N]: the node-local dispatch's handle of source node m
};

size_t cuda_ll_nodes_bytes(const MoeShape& shape, int num_ranks, int num_nodes) {
  return cuda_ll_layout_bytes(node_shape(shape, num_nodes), num_ranks / num_nodes) +
         static_cast<size_t>(
             LlNodesLayout::make(shape.max_tokens_per_rank, shape.hidden, shape.top_k, num_nodes)
                 .total) +
         device_copy_rail_bytes();
}

CudaLlNodes::CudaLlNodes(const Group& group, const MoeShape& shape, uint64_t buffer_id)
    : VirtualNodes(group, shape, buffer_id, "ll", "epx-ll-nodes-", kLlNodesMaxNodes),
      grid_(group.options().num_sms > 0 ? group.options().num_sms : 16) {
  ll_ = cuda_ll_create(*node_group_, node_shape(shape, topology_.num_nodes), false);
  layout_ = LlNodesLayout::make(shape.max_tokens_per_rank, shape.hidden, shape.top_k,
                                topology_.num_nodes);
  open_scratch(static_cast<size_t>(layout_.slot), static_cast<size_t>(layout_.total));
  own_ = reinterpret_cast<float*>(scratch_ + layout_.own_off);
  own_ids_ = reinterpret_cast<int32_t*>(scratch_ + layout_.own_ids_off);
}

void CudaLlNodes::unsupported(const char* what, const char* expected) const {
  throw_error(ErrorCode::kUnsupported,
              cat(what, " ", where(), " is not built; expected ", expected));
}

size_t CudaLlNodes::bytes() const {
  return cuda_ll_allocated(ll_.get()) + shared_bytes();
}

void CudaLlNodes::check() {
  rail_->check();
  cuda_ll_check(*ll_);
}

// Every rank: the node-local ll_clean (collective over the node), then, with every rank of the
// group past it, the rail's reset and a closing barrier (as CudaHtNodes::reset).
void CudaLlNodes::clean() {
  ++hooks_->generation;  // the hooks of dispatches before it refuse to run
  hooks_->in_flight[0] = hooks_->in_flight[1] = false;
  num_dispatches_ = 0;
  cuda_ll_clean(*ll_);
  nodes_reset_rail(group_, *rail_, "ll_clean (ll across nodes)",
                   "ll_clean (ll across nodes, done)");
}

const CudaLlNodes::State& CudaLlNodes::state_of(const LlHandle& h, const char* op) const {
  const auto* st = static_cast<const State*>(h.backend_state.get());
  EPX_CHECK_ARG(h.buffer_id != buffer_id_ || st == nullptr || !st->handles.empty(), op,
                ": argument 'handle' is of an ll_dispatch whose hook was not called; expected "
                "its hook called first");
  return nodes_state_of<State>(h, buffer_id_, topology_.num_nodes, op, "ll_dispatch");
}

// ht's pack (kernels/ht/nodes.cuh): per other node m, C slots of (x's row when x is given,
// weights when given) and the ids renumbered to m's experts; own_ids for this node.
void CudaLlNodes::pack(const TensorView& x, const TensorView& topk_idx, const TensorView& weights,
                       int64_t num_tokens, int32_t* own_ids, cudaStream_t stream,
                       const char* what) {
  HtNodesPackParams p{};
  HtNodesChunk chunk;
  if (x.defined()) {
    p.x = static_cast<const char*>(x.data);
    p.x_stride = x.strides[0] * 2;
    p.row_bytes = shape_.hidden * 2;
    chunk.rows_off = layout_.dispatch_rows_off;
    chunk.ids_off = layout_.dispatch_ids_off;
    chunk.bytes = layout_.dispatch_bytes;
  } else {
    chunk.ids_off = layout_.route_ids_off;
    chunk.weights_off = layout_.route_weights_off;
    chunk.bytes = layout_.route_bytes;
    p.weights = weights.ptr<const float>();
    p.weights_stride0 = weights.strides[0];
    p.weights_stride1 = weights.strides[1];
  }
  p.topk_idx = topk_idx.data;
  p.topk_stride = topk_idx.strides[0];
  p.topk_is_i64 = topk_idx.dtype == DType::kI64;
  p.own_ids = own_ids;
  p.num_tokens = static_cast<int>(num_tokens);
  p.max_tokens = static_cast<int>(shape_.max_tokens_per_rank);
  p.top_k = shape_.top_k;
  p.num_experts = shape_.num_experts;
  p.num_nodes = topology_.num_nodes;
  p.node = node_;
  p.ranks_per_node = topology_.ranks_per_node;
  p.chunks = send_slot(0);
  p.chunk_stride = layout_.slot;
  p.chunk = chunk;
  launch_nodes_pack(p, grid_, stream, what);
}

void CudaLlNodes::exchange(const char* what, size_t bytes, char* recv, int64_t recv_stride,
                           cudaStream_t stream) {
  nodes_exchange(*rail_, topology_, node_, what, bytes, send_slot(0), layout_.slot, recv,
                 recv_stride, stream);
}

void CudaLlNodes::receive(const LlDispatchArgs& args, int b, const Allocator& alloc,
                          LlDispatchResult* res, State& st) {
  const int N = topology_.num_nodes, K = shape_.top_k;
  const int64_t T = args.x.shape[0], C = shape_.max_tokens_per_rank, H = shape_.hidden;
  char* chunks = batch(b);
  auto stream = static_cast<cudaStream_t>(args.stream);

  // One node-local dispatch per source node, in node order.
  std::vector<LlDispatchResult> blocks(N);
  for (int m = 0; m < N; ++m) {
    LlDispatchArgs a = args;
    a.return_recv_hook = false;
    if (m == node_) {
      a.topk_idx = view(chunks + layout_.batch_ids_off, DType::kI32, T, K, device_);
    } else {
      char* c = chunks + Topology::other_index(m, node_) * layout_.dispatch_bytes;
      a.x = view(c + layout_.dispatch_rows_off, DType::kBF16, C, H, device_);
      a.topk_idx = view(c + layout_.dispatch_ids_off, DType::kI32, C, K, device_);
    }
    blocks[m] = cuda_ll_dispatch(*ll_, a, alloc, buffer_id_);
  }
  for (const LlDispatchResult& blk : blocks) st.handles.push_back(blk.handle);
  if (res == nullptr) return;

  // The blocks assembled into the flat outputs.
  LlNodesAssembleParams p{};
  for (int m = 0; m < N; ++m) {
    const LlDispatchResult& blk = blocks[m];
    p.blocks[m] = {static_cast<const uint8_t*>(blk.recv_x.data),
                   static_cast<const uint32_t*>(blk.recv_scales.data),
                   blk.recv_count.ptr<const int32_t>(), blk.handle.src_info.ptr<const int32_t>(),
                   blk.handle.layout_range.ptr<const int64_t>()};
  }
  p.num_nodes = N;
  p.ranks_per_node = topology_.ranks_per_node;
  p.num_local_experts = static_cast<int>(res->recv_count.shape[0]);
  p.scale_cols = args.use_fp8 ? static_cast<int>(res->recv_scales.shape[2]) : 0;
  p.block_rows = topology_.ranks_per_node * C;
  p.rows = group_.size() * C;
  p.row_bytes = H * (args.use_fp8 ? 1 : 2);
  p.x = static_cast<uint8_t*>(res->recv_x.data);
  p.scales = static_cast<uint32_t*>(res->recv_scales.data);
  p.count = res->recv_count.ptr<int32_t>();
  p.src_info = res->handle.src_info.ptr<int32_t>();
  p.layout_range = res->handle.layout_range.ptr<int64_t>();
  launch_kernel(ll_nodes_assemble_kernel, grid_, kLlNodesThreads, 0, stream, false,
                "ll_dispatch: outputs", p);
}

LlDispatchResult CudaLlNodes::dispatch(const LlDispatchArgs& args, const Allocator& alloc) {
  const char* op = "ll_dispatch";
  if (args.use_nvfp4) unsupported("ll_dispatch: use_nvfp4", "use_nvfp4 = false");
  if (args.dispatch_wait_recv_cost_stats.defined())
    unsupported("ll_dispatch: dispatch_wait_recv_cost_stats", "no tensor");
  const int b = static_cast<int>(num_dispatches_ % 2);
  ll_require_dispatch_slot(op, b, hooks_->in_flight[b]);
  DeviceGuard guard(device_);
  const int R = group_.size(), L = shape_.num_experts / R;
  const int64_t T = args.x.shape[0], C = shape_.max_tokens_per_rank, H = shape_.hidden;
  const int64_t RT = R * C;
  auto stream = static_cast<cudaStream_t>(args.stream);
  ++num_dispatches_;

  // The send half: with the hook, x's rows into this batch (this node's dispatch reads them in
  // the hook), then the pack and the rail leg into this batch's chunks.
  LlDispatchArgs recv_args = args;
  if (args.return_recv_hook) {
    char* rows = batch(b) + layout_.batch_rows_off;
    if (T > 0)
      EPX_CUDA_CHECK(cudaMemcpy2DAsync(rows, H * 2, args.x.data, args.x.strides[0] * 2, H * 2, T,
                                       cudaMemcpyDeviceToDevice, stream),
                     op);
    recv_args.x = view(rows, DType::kBF16, T, H, device_);
  }
  pack(args.x, args.topk_idx, {}, T,
       reinterpret_cast<int32_t*>(batch(b) + layout_.batch_ids_off), stream, "ll_dispatch: pack");
  exchange("ll_dispatch (rail)", static_cast<size_t>(layout_.dispatch_bytes), batch(b),
           layout_.dispatch_bytes, stream);

  // The flat outputs (CudaLl's, checked the same way). If the allocator fails, the node-local
  // dispatches still run (collective over the node; nothing assembled), then the error.
  LlDispatchResult res;
  std::exception_ptr failed;
  try {
    allocate_ll_dispatch_outputs(res, alloc, device_, args, L, R, RT, H, op);
  } catch (...) {
    failed = std::current_exception();
  }
  res.handle.max_tokens = C;
  res.handle.hidden = H;
  res.handle.num_experts = shape_.num_experts;
  res.handle.num_tokens = T;
  res.handle.buffer_id = buffer_id_;
  auto st = std::make_shared<State>();
  res.handle.backend_state = st;

  if (failed || !args.return_recv_hook) {
    receive(recv_args, b, alloc, failed ? nullptr : &res, *st);
    if (failed) std::rethrow_exception(failed);
    return res;
  }
  // The hook: the receive, from epx's memory only (this batch's chunks, ids and rows); it keeps
  // the outputs it writes alive, the caller the stats tensor.
  hooks_->in_flight[b] = true;
  std::weak_ptr<Hooks> weak = hooks_;
  auto keep = std::make_shared<LlDispatchResult>(res);
  auto called = std::make_shared<bool>(false);
  res.hook = [this, weak, generation = hooks_->generation, called, b, recv_args, alloc, keep,
              st]() {
    std::shared_ptr<Hooks> hooks = weak.lock();
    ll_hook_begin("ll_dispatch hook", hooks != nullptr, *called,
                  hooks && hooks->generation != generation);
    hooks->in_flight[b] = false;
    DeviceGuard hguard(device_);
    receive(recv_args, b, alloc, keep.get(), *st);
  };
  return res;
}

LlCombineResult CudaLlNodes::combine(const LlCombineArgs& args, const Allocator& alloc) {
  const char* op = "ll_combine";
  if (args.zero_copy) unsupported("ll_combine: zero_copy", "zero_copy = false");
  if (args.return_recv_hook)
    unsupported("ll_combine: return_recv_hook", "return_recv_hook = false");
  if (args.use_logfmt) unsupported("ll_combine: use_logfmt", "use_logfmt = false");
  if (args.overlap) unsupported("ll_combine: overlap", "no overlap");
  if (args.combine_wait_recv_cost_stats.defined())
    unsupported("ll_combine: combine_wait_recv_cost_stats", "no tensor");
  const LlHandle& h = *args.handle;
  const State& st = state_of(h, op);
  DeviceGuard guard(device_);
  const int N = topology_.num_nodes, G = topology_.ranks_per_node, R = group_.size();
  const int K = shape_.top_k, L = shape_.num_experts / R;
  const int64_t T = h.num_tokens, C = shape_.max_tokens_per_rank, H = shape_.hidden;
  auto stream = static_cast<cudaStream_t>(args.stream);

  // Leg 1: the routing and weights of this rank's tokens that reach each other node.
  pack({}, args.topk_idx, args.topk_weights, T, own_ids_, stream, "ll_combine: pack");
  exchange("ll_combine (rail, routing)", static_cast<size_t>(layout_.route_bytes), recv_slot(0),
           layout_.slot, stream);

  // One node-local combine per source node: y's block m restaged into the node-local combine
  // buffer, reduced zero-copy into a float32 partial (this rank's own, or the rail chunk for m).
  const int64_t y_bytes0 = args.y.strides[0] * 2, y_bytes1 = args.y.strides[1] * 2;
  const bool vec = aligned16(args.y.data, y_bytes0) && y_bytes1 % 16 == 0;
  for (int m = 0; m < N; ++m) {
    const LlHandle& hm = st.handles[m];
    const TensorView comb = cuda_ll_next_combine_buffer(*ll_, hm);
    LlNodesRestageParams rp{};
    rp.y = static_cast<const uint16_t*>(args.y.data);
    rp.y_stride0 = args.y.strides[0];
    rp.y_stride1 = args.y.strides[1];
    rp.layout_range = h.layout_range.ptr<const int64_t>();
    rp.layout_stride = h.layout_range.strides[0];
    rp.block = m;
    rp.ranks_per_node = G;
    rp.num_local_experts = L;
    rp.hidden = H;
    rp.comb_y = static_cast<uint16_t*>(comb.data);
    rp.block_rows = G * C;
    if (vec) {
      launch_kernel(ll_nodes_restage_kernel<uint4>, grid_, kLlNodesThreads, 0, stream, false,
                    "ll_combine: restage", rp);
    } else {
      launch_kernel(ll_nodes_restage_kernel<uint16_t>, grid_, kLlNodesThreads, 0, stream, false,
                    "ll_combine: restage", rp);
    }
    LlCombineArgs a;
    a.handle = &hm;
    a.zero_copy = true;
    a.stream = args.stream;
    float* out = own_;
    if (m == node_) {
      a.topk_idx = view(own_ids_, DType::kI32, T, K, device_);
      a.topk_weights = args.topk_weights;
    } else {
      const int i = Topology::other_index(m, node_);
      char* c = recv_slot(i);
      a.topk_idx = view(c + layout_.route_ids_off, DType::kI32, C, K, device_);
      a.topk_weights = view(c + layout_.route_weights_off, DType::kF32, C, K, device_);
      out = reinterpret_cast<float*>(send_slot(i));
    }
    cuda_ll_combine_f32(*ll_, a, out);
  }
  // Leg 2: the partials back to their sources.
  exchange("ll_combine (rail, partials)", static_cast<size_t>(layout_.partial_bytes),
           recv_slot(0), layout_.slot, stream);

  LlCombineResult res;
  if (args.out.defined()) {
    static_cast<TensorView&>(res.out) = args.out;
  } else {
    res.out = alloc(DType::kBF16, {T, H}, Device::cuda(device_));
  }
  LlNodesAddParams p{};
  p.own = own_;
  p.partials = recv_slot(0);
  p.partial_stride = layout_.slot;
  p.topk_idx = args.topk_idx.data;
  p.topk_stride = args.topk_idx.strides[0];
  p.topk_is_i64 = args.topk_idx.dtype == DType::kI64;
  p.num_tokens = T;
  p.hidden = H;
  p.top_k = K;
  p.experts_per_node = shape_.num_experts / N;
  p.num_nodes = N;
  p.node = node_;
  p.out = res.out.ptr<uint16_t>();
  p.out_stride = res.out.strides[0];
  launch_kernel(ll_nodes_add_kernel, grid_, kLlNodesThreads, 0, stream, false,
                "ll_combine: partials", p);
  return res;
}

}  // namespace epx::detail

// src/cuda/ll_nodes.cu — CudaLlNodes (cuda/ll_nodes.h): the hierarchical ll on virtual nodes, its
// host steps and the launches of kernels/ll/nodes.cuh (and ht's pack). Every launch and copy is on
// the caller's stream; the host never waits (the counts the outputs need stay on the device).
#include "cuda/ll_nodes.h"

#include <cuda_runtime.h>

#include <algorithm>
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
    : group_(group),
      shape_(shape),
      buffer_id_(buffer_id),
      topology_(Topology::of(group)),
      node_(topology_.node_of(group.rank())),
      device_(group.transport()->device().index) {
  require_virtual_nodes(group, topology_, "ll");
  EPX_CHECK(topology_.num_nodes <= kLlNodesMaxNodes, ErrorCode::kUnsupported, "Buffer: ll ",
            where(), ": at most ", kLlNodesMaxNodes, " nodes are built");
  grid_ = group.options().num_sms > 0 ? group.options().num_sms : 16;
  node_group_ = make_virtual_node_group(group, topology_, "epx-ll-nodes-");
  ll_ = cuda_ll_create(*node_group_, node_shape(shape, topology_.num_nodes), false);
  layout_ = LlNodesLayout::make(shape.max_tokens_per_rank, shape.hidden, shape.top_k,
                                topology_.num_nodes);
  rail_ = make_device_copy_rail(group, topology_, static_cast<size_t>(layout_.slot));
  memory_ = node_group_->transport()->allocate(static_cast<size_t>(layout_.total));  // zeroed
  scratch_ = static_cast<char*>(memory_->local());
  own_ = reinterpret_cast<float*>(scratch_ + layout_.own_off);
  own_ids_ = reinterpret_cast<int32_t*>(scratch_ + layout_.own_ids_off);
}

CudaLlNodes::~CudaLlNodes() {
  ll_.reset();  // its destruction barrier first: no node peer reads the scratch after it
}

std::string CudaLlNodes::where() const {
  return cat("across nodes on cuda (", topology_.num_nodes, " nodes of ", topology_.ranks_per_node,
             " ranks)");
}

void CudaLlNodes::unsupported(const char* what, const char* expected) const {
  throw_error(ErrorCode::kUnsupported,
              cat(what, " ", where(), " is not built; expected ", expected));
}

size_t CudaLlNodes::bytes() const {
  return cuda_ll_allocated(ll_.get()) + memory_->bytes() + rail_->bytes_allocated();
}

void CudaLlNodes::check() {
  rail_->check();
  cuda_ll_check(*ll_);
}

// Every rank: the node-local ll_clean (collective over the node), then, with every rank of the
// group past it, the rail's reset and a closing barrier (as CudaHtNodes::reset).
void CudaLlNodes::clean() {
  cuda_ll_clean(*ll_);
  nodes_reset_rail(group_, *rail_, "ll_clean (ll across nodes)",
                   "ll_clean (ll across nodes, done)");
}

const CudaLlNodes::State& CudaLlNodes::state_of(const LlHandle& h, const char* op) const {
  return nodes_state_of<State>(h, buffer_id_, topology_.num_nodes, op, "ll_dispatch");
}

// ht's pack (kernels/ht/nodes.cuh): per other node m, C slots of (x's row when x is given,
// weights when given) and the ids renumbered to m's experts; own_ids_ for this node.
void CudaLlNodes::pack(const TensorView& x, const TensorView& topk_idx, const TensorView& weights,
                       int64_t num_tokens, cudaStream_t stream, const char* what) {
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
  p.own_ids = own_ids_;
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

void CudaLlNodes::exchange(const char* what, size_t bytes, cudaStream_t stream) {
  nodes_exchange(*rail_, topology_, node_, what, bytes, send_slot(0), layout_.slot, recv_slot(0),
                 layout_.slot, stream);
}

LlDispatchResult CudaLlNodes::dispatch(const LlDispatchArgs& args, const Allocator& alloc) {
  if (args.return_recv_hook)
    unsupported("ll_dispatch: return_recv_hook", "return_recv_hook = false");
  if (args.use_nvfp4) unsupported("ll_dispatch: use_nvfp4", "use_nvfp4 = false");
  if (args.dispatch_wait_recv_cost_stats.defined())
    unsupported("ll_dispatch: dispatch_wait_recv_cost_stats", "no tensor");
  DeviceGuard guard(device_);
  const int N = topology_.num_nodes, G = topology_.ranks_per_node, R = group_.size();
  const int K = shape_.top_k, L = shape_.num_experts / R;
  const int64_t T = args.x.shape[0], C = shape_.max_tokens_per_rank, H = shape_.hidden;
  const int64_t RT = R * C, BT = G * C;
  auto stream = static_cast<cudaStream_t>(args.stream);

  pack(args.x, args.topk_idx, {}, T, stream, "ll_dispatch: pack");
  exchange("ll_dispatch (rail)", static_cast<size_t>(layout_.dispatch_bytes), stream);

  // One node-local dispatch per source node, in node order.
  std::vector<LlDispatchResult> blocks(N);
  for (int m = 0; m < N; ++m) {
    LlDispatchArgs a = args;
    if (m == node_) {
      a.topk_idx = view(own_ids_, DType::kI32, T, K, device_);
    } else {
      char* c = recv_slot(Topology::other_index(m, node_));
      a.x = view(c + layout_.dispatch_rows_off, DType::kBF16, C, H, device_);
      a.topk_idx = view(c + layout_.dispatch_ids_off, DType::kI32, C, K, device_);
    }
    blocks[m] = cuda_ll_dispatch(*ll_, a, alloc, buffer_id_);
  }

  // The flat outputs (as CudaLl allocates them), then the blocks assembled into them.
  LlDispatchResult res;
  const Device dev = Device::cuda(device_);
  res.recv_x = alloc(args.use_fp8 ? DType::kF8E4M3 : DType::kBF16, {L, RT, H}, dev);
  int64_t cols = 0;
  if (args.use_fp8) {
    cols = args.use_ue8m0 ? (H / 128 + 3) / 4 : H / 128;
    res.recv_scales = alloc(args.use_ue8m0 ? DType::kI32 : DType::kF32, {L, cols, RT}, dev);
    res.recv_scales.shape = {L, RT, cols};
    res.recv_scales.strides = {cols * RT, 1, RT};
  }
  res.recv_count = alloc(DType::kI32, {L}, dev);
  allocate_ll_handle(
      res.handle, [&](DType dt, const std::vector<int64_t>& s) { return alloc(dt, s, dev); }, L, R,
      RT);
  res.handle.max_tokens = C;
  res.handle.hidden = H;
  res.handle.num_experts = shape_.num_experts;
  res.handle.num_tokens = T;
  res.handle.buffer_id = buffer_id_;

  LlNodesAssembleParams p{};
  for (int m = 0; m < N; ++m) {
    const LlDispatchResult& b = blocks[m];
    p.blocks[m] = {static_cast<const uint8_t*>(b.recv_x.data),
                   static_cast<const uint32_t*>(b.recv_scales.data),
                   b.recv_count.ptr<const int32_t>(), b.handle.src_info.ptr<const int32_t>(),
                   b.handle.layout_range.ptr<const int64_t>()};
  }
  p.num_nodes = N;
  p.ranks_per_node = G;
  p.num_local_experts = L;
  p.scale_cols = static_cast<int>(cols);
  p.block_rows = BT;
  p.rows = RT;
  p.row_bytes = H * (args.use_fp8 ? 1 : 2);
  p.x = static_cast<uint8_t*>(res.recv_x.data);
  p.scales = static_cast<uint32_t*>(res.recv_scales.data);
  p.count = res.recv_count.ptr<int32_t>();
  p.src_info = res.handle.src_info.ptr<int32_t>();
  p.layout_range = res.handle.layout_range.ptr<int64_t>();
  launch_kernel(ll_nodes_assemble_kernel, grid_, kLlNodesThreads, 0, stream, false,
                "ll_dispatch: outputs", p);
  auto st = std::make_shared<State>();
  for (const LlDispatchResult& b : blocks) st->handles.push_back(b.handle);
  res.handle.backend_state = st;
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
  pack({}, args.topk_idx, args.topk_weights, T, stream, "ll_combine: pack");
  exchange("ll_combine (rail, routing)", static_cast<size_t>(layout_.route_bytes), stream);

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
  exchange("ll_combine (rail, partials)", static_cast<size_t>(layout_.partial_bytes), stream);

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

// src/cuda/ht_nodes.cu — CudaHtNodes (cuda/ht_nodes.h): the hierarchical ht on virtual nodes,
// its host steps and the launches of kernels/ht/nodes.cuh. Every launch and copy is on the
// caller's stream; the host waits only where the node-local exact dispatch does (its count
// exchange, once per source node). So the cached dispatch and the combine can be captured into a
// CUDA graph (the rail's and the node-local ht's exchange numbers live on the device: a replay is
// the next exchange); an exact dispatch on a capturing stream is refused before it gets here
// (CudaBuffer::ht_dispatch).
#include "cuda/ht_nodes.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/validate.h"
#include "cuda/cuda_check.h"
#include "cuda/kernels/ht/nodes.cuh"
#include "cuda/launch.h"
#include "cuda/tuning.h"
#include "transport/device_copy_rail.h"
#include "transport/transport.h"

namespace epx::detail {

namespace {

size_t align16(size_t v) { return (v + 15) / 16 * 16; }

// The scratch allocation's offsets (ht_nodes.h), the same on every rank.
struct NodesScratch {
  size_t slot = 0, own = 0, own_w = 0, own_ids = 0, cols = 0, recv_cols = 0, total = 0;

  static NodesScratch make(const MoeShape& s, int R, int N) {
    const int64_t C = s.max_tokens_per_rank, H = s.hidden, K = s.top_k;
    const int G = R / N;
    NodesScratch x;
    // The largest dispatch chunk (bf16 rows, the most scales fp8 can carry, ids and weights),
    // a combine partial (f32 rows and weights), the count columns.
    const auto dispatch = static_cast<size_t>(
        HtNodesChunk::make(C, 2 * H, H % 128 == 0 ? static_cast<int>(H / 128) : 0, K, true, false)
            .bytes);
    const size_t partial = align16(C * H * 4) + align16(C * K * 4);
    x.slot = std::max({dispatch, partial, align16(size_t{4} * R * G)});
    size_t at = 2 * (N - 1) * x.slot;
    x.own = at;
    at += align16(C * H * 4);
    x.own_w = at;
    at += align16(C * K * 4);
    x.own_ids = at;
    at += align16(C * K * 4);
    x.cols = at;
    at += align16(size_t{4} * R * G);
    x.recv_cols = at;
    at += (N - 1) * align16(size_t{4} * R * G);
    x.total = at;
    return x;
  }
};

MoeShape node_shape(const MoeShape& s, int num_nodes) {
  MoeShape n = s;
  n.num_experts = s.num_experts / num_nodes;
  return n;
}

// A name every rank of the group agrees on, new for each CudaHtNodes of the process: rank 0's
// draw, allgathered (the node groups' rendezvous names).
int64_t agreed_serial(const Group& group) {
  static std::atomic<int64_t> next{1};
  const int64_t mine = group.rank() == 0 ? next.fetch_add(1) : 0;
  return group.transport()->allgather("Buffer (across nodes)", {mine})[0][0];
}

// Rows [first, first + rows) of a [rows, ...] view (null data stays null).
TensorView rows_of(const TensorView& t, int64_t first, int64_t rows) {
  TensorView v = t;
  if (v.data != nullptr)
    v.data = static_cast<char*>(v.data) + first * v.strides[0] * dtype_size(v.dtype);
  v.shape[0] = rows;
  return v;
}

TensorView view(void* data, DType dtype, int64_t rows, int64_t cols, int device) {
  return TensorView::contiguous(data, dtype, {rows, cols}, Device::cuda(device));
}

int vector_bytes_of(uint64_t acc) {
  for (int b : {16, 8, 4, 2})
    if (acc % b == 0) return b;
  return 1;
}

// Diagnostics builds (set_ht_nodes_step_sync): the stream synchronised after `step`, a CUDA error
// raised naming it, then a barrier of the group, so no rank starts the next step before every
// rank's is known clean (the first step that fails is the one whose kernel faulted). Nothing in
// the default build.
void step_done(const Group& group, cudaStream_t stream, const char* step) {
#ifdef EPX_DIAGNOSTICS
  if (!ht_nodes_step_sync()) return;
  EPX_CUDA_CHECK(cudaStreamSynchronize(stream), step);
  group.transport()->barrier(step);
#else
  (void)group;
  (void)stream;
  (void)step;
#endif
}

template <typename V>
void launch_pack(const HtNodesPackParams& p, int grid, cudaStream_t stream, const char* what) {
  launch_kernel(ht_nodes_pack_kernel<V>, grid, kHtNodesThreads, 0, stream, false, what, p);
}

}  // namespace

void require_virtual_nodes(const Group& group, const Topology& topology, const char* mode) {
  EPX_CHECK(group.transport()->ranks_share_device(), ErrorCode::kUnsupported, "Buffer: ", mode,
            " across nodes on cuda (", topology.num_nodes, " nodes of ", topology.ranks_per_node,
            " ranks) is built for virtual nodes, ranks that share one GPU "
            "(Group::cuda_shared_device); expected such a group");
}

Group make_virtual_node_group(const Group& group, const Topology& topology, const char* prefix) {
  const int64_t serial = agreed_serial(group);
  GroupOptions o;
  o.timeout = group.timeout();
  o.num_sms = group.options().num_sms;  // every rank of every node stays co-resident
  const int node = topology.node_of(group.rank());
  return Group::cuda_shared_device(topology.local_of(group.rank()), topology.ranks_per_node,
                                   cat(prefix, serial, "-node-", node),
                                   group.transport()->device().index, o);
}

void launch_nodes_pack(const HtNodesPackParams& p, int grid, cudaStream_t stream,
                       const char* what) {
  const int vb = vector_bytes_of(reinterpret_cast<uint64_t>(p.x) |
                                 static_cast<uint64_t>(p.x_stride) |
                                 static_cast<uint64_t>(p.row_bytes) |
                                 static_cast<uint64_t>(p.chunk_stride));
  switch (vb) {
    case 16: launch_pack<uint4>(p, grid, stream, what); break;
    case 8: launch_pack<uint2>(p, grid, stream, what); break;
    case 4: launch_pack<uint32_t>(p, grid, stream, what); break;
    case 2: launch_pack<uint16_t>(p, grid, stream, what); break;
    default: launch_pack<uint8_t>(p, grid, stream, what); break;
  }
}

struct CudaHtNodes::State {
  std::vector<HtHandle> handles;     // [N]: the node-local dispatch's handle of source node m
  std::vector<int64_t> block_rows;   // [N]: its rows (block m of the outputs)
};

size_t cuda_ht_nodes_bytes(const MoeShape& shape, int num_ranks, int num_nodes) {
  const int G = num_ranks / num_nodes;
  const MoeShape s = node_shape(shape, num_nodes);
  return HtRegion::make(s.hidden, s.top_k, s.num_experts, s.max_tokens_per_rank, G).total_bytes +
         NodesScratch::make(shape, num_ranks, num_nodes).total + device_copy_rail_bytes();
}

VirtualNodes::VirtualNodes(const Group& group, const MoeShape& shape, uint64_t buffer_id,
                           const char* mode, const char* prefix, int max_nodes)
    : group_(group),
      shape_(shape),
      buffer_id_(buffer_id),
      topology_(Topology::of(group)),
      node_(topology_.node_of(group.rank())),
      device_(group.transport()->device().index) {
  require_virtual_nodes(group, topology_, mode);
  EPX_CHECK(max_nodes == 0 || topology_.num_nodes <= max_nodes, ErrorCode::kUnsupported,
            "Buffer: ", mode, " ", where(), ": at most ", max_nodes, " nodes are built");
  node_group_ = make_virtual_node_group(group, topology_, prefix);
}

std::string VirtualNodes::where() const {
  return cat("across nodes on cuda (", topology_.num_nodes, " nodes of ", topology_.ranks_per_node,
             " ranks)");
}

void VirtualNodes::open_scratch(size_t slot_bytes, size_t total_bytes) {
  slot_bytes_ = slot_bytes;
  rail_ = make_device_copy_rail(group_, topology_, slot_bytes);
  memory_ = node_group_->transport()->allocate(total_bytes);  // zeroed
  scratch_ = static_cast<char*>(memory_->local());
}

size_t VirtualNodes::shared_bytes() const { return memory_->bytes() + rail_->bytes_allocated(); }

CudaHtNodes::CudaHtNodes(const Group& group, const MoeShape& shape, uint64_t buffer_id)
    : VirtualNodes(group, shape, buffer_id, "ht", "epx-ht-nodes-", 0) {
  const int R = group.size(), N = topology_.num_nodes;
  ht_ = std::make_unique<CudaHt>(*node_group_, node_shape(shape, N), buffer_id);
  const NodesScratch s = NodesScratch::make(shape, R, N);
  open_scratch(s.slot, s.total);
  own_ = reinterpret_cast<float*>(scratch_ + s.own);
  own_w_ = reinterpret_cast<float*>(scratch_ + s.own_w);
  own_ids_ = reinterpret_cast<int32_t*>(scratch_ + s.own_ids);
  cols_ = reinterpret_cast<int32_t*>(scratch_ + s.cols);
  recv_cols_ = scratch_ + s.recv_cols;
}

size_t CudaHtNodes::bytes() const { return ht_->bytes() + shared_bytes(); }

void CudaHtNodes::check() {
  rail_->check();
  ht_->check();
}

// Every rank: the node-local reset (device synchronised, node resync, control words zeroed),
// then, with every rank of the group past it, the rail's (local) and a closing barrier so no
// rank posts to a rail not yet reset.
void CudaHtNodes::reset() {
  ht_->reset();
  nodes_reset_rail(group_, *rail_, "reset (ht across nodes)", "reset (ht across nodes, done)");
}

void nodes_reset_rail(const Group& group, RailTransport& rail, const char* what,
                      const char* done) {
  Transport& t = *group.transport();
  t.resync(what, t.all_members(), 2 * group.timeout());
  rail.reset();
  t.barrier(done);
}

const CudaHtNodes::State& CudaHtNodes::state_of(const HtHandle& h, const char* op) const {
  return nodes_state_of<State>(h, buffer_id_, topology_.num_nodes, op, "ht_dispatch");
}

TensorView CudaHtNodes::combine_buffer(const HtHandle&) const {
  throw_error(ErrorCode::kUnsupported,
              cat("ht_combine_buffer: the zero-copy combine across nodes on cuda (",
                  topology_.num_nodes, " nodes of ", topology_.ranks_per_node,
                  " ranks) is not built; expected ht_combine with zero_copy = false"));
}

HtLayout CudaHtNodes::layout(const TensorView& topk_idx, Stream stream, const Allocator& alloc) {
  HtLayout out = ht_->layout_of(topk_idx, stream, alloc, group_.size(), shape_.num_experts);
  step_done(group_, static_cast<cudaStream_t>(stream), "ht_layout");
  return out;
}

void nodes_exchange(RailTransport& rail, const Topology& topology, int node, const char* what,
                    size_t bytes, char* send_base, size_t send_stride, char* recv_base,
                    size_t recv_stride, cudaStream_t stream) {
  std::vector<RailChunk> sends, recvs;
  for (int m = 0; m < topology.num_nodes; ++m) {
    if (m == node) continue;
    const int i = Topology::other_index(m, node);
    sends.push_back({m, send_base + i * send_stride, bytes});
    recvs.push_back({m, recv_base + i * recv_stride, bytes});
  }
  rail.exchange(what, sends, recvs, stream);
}

void CudaHtNodes::exchange(const char* what, size_t bytes, char* send_base, size_t send_stride,
                           char* recv_base, size_t recv_stride, cudaStream_t stream) {
  nodes_exchange(*rail_, topology_, node_, what, bytes, send_base, send_stride, recv_base,
                 recv_stride, stream);
}

void CudaHtNodes::pack(const HtDispatchArgs& args, const HtNodesChunk& chunk,
                       cudaStream_t stream) {
  const TensorView& x = args.x;
  HtNodesPackParams p{};
  p.x = static_cast<const char*>(x.data);
  p.x_stride = x.strides[0] * static_cast<int64_t>(dtype_size(x.dtype));
  p.row_bytes = shape_.hidden * static_cast<int64_t>(dtype_size(x.dtype));
  if (chunk.scales_off >= 0) {
    p.scales = static_cast<const uint32_t*>(args.x_scales.data);
    p.scale_stride0 = args.x_scales.strides[0];
    p.scale_stride1 = args.x_scales.strides[1];
    p.num_scales = static_cast<int>(args.x_scales.shape[1]);
  }
  if (args.handle != nullptr) {
    p.cached = 1;
    p.in_rank = args.handle->is_token_in_rank.ptr<const bool>();
  } else {
    p.topk_idx = args.topk_idx.data;
    p.topk_stride = args.topk_idx.strides[0];
    p.topk_is_i64 = args.topk_idx.dtype == DType::kI64;
    if (args.topk_weights.defined()) {
      p.weights = args.topk_weights.ptr<const float>();
      p.weights_stride0 = args.topk_weights.strides[0];
      p.weights_stride1 = args.topk_weights.strides[1];
    }
    p.own_ids = own_ids_;
  }
  p.num_tokens = static_cast<int>(x.shape[0]);
  p.max_tokens = static_cast<int>(shape_.max_tokens_per_rank);
  p.top_k = shape_.top_k;
  p.num_experts = shape_.num_experts;
  p.num_nodes = topology_.num_nodes;
  p.node = node_;
  p.ranks_per_node = topology_.ranks_per_node;
  p.chunks = send_slot(0);
  p.chunk_stride = static_cast<int64_t>(slot_bytes_);
  p.chunk = chunk;
  launch_nodes_pack(p, std::max(1, ht_->tuning().num_sms), stream, "ht_dispatch: pack");
}

HtDispatchResult CudaHtNodes::dispatch(const HtDispatchArgs& args, const Allocator& alloc) {
  ht_->require_usable("ht_dispatch");
  DeviceGuard guard(device_);
  const int N = topology_.num_nodes, K = shape_.top_k;
  const int64_t T = args.x.shape[0], C = shape_.max_tokens_per_rank, H = shape_.hidden;
  EPX_CHECK(!args.zero_copy, ErrorCode::kUnsupported, "ht_dispatch: zero_copy across nodes on ",
            "cuda (", N, " nodes of ", topology_.ranks_per_node,
            " ranks) is not built; expected zero_copy = false");
  EPX_CHECK(args.num_worst_tokens == 0, ErrorCode::kUnsupported,
            "ht_dispatch: worst-case mode (num_worst_tokens = ", args.num_worst_tokens,
            ") across nodes on cuda (", N, " nodes of ", topology_.ranks_per_node,
            " ranks) is not built; expected num_worst_tokens = 0");
  EPX_CHECK(T <= C, ErrorCode::kOutOfCapacity, "ht_dispatch: x has ", T,
            " tokens, expected at most max_tokens_per_rank = ", C);
  auto stream = static_cast<cudaStream_t>(args.stream);
  const bool cached = args.handle != nullptr;
  const State* cached_state = cached ? &state_of(*args.handle, "ht_dispatch") : nullptr;
  EPX_CHECK_ARG(!cached || args.handle->num_tokens == T, "ht_dispatch: x has ", T,
                " tokens but the cached handle was made for ", args.handle->num_tokens);
  const bool fp8 = args.x.dtype == DType::kF8E4M3;
  const int num_scales =
      fp8 && args.x_scales.defined() ? static_cast<int>(args.x_scales.shape[1]) : 0;
  const int64_t row_bytes = H * static_cast<int64_t>(dtype_size(args.x.dtype));
  const bool weights = !cached && args.topk_weights.defined();
  const HtNodesChunk chunk = HtNodesChunk::make(C, row_bytes, num_scales, K, weights, cached);

  // Pack and the rail leg (a rank whose call differs in dtypes or weights sends another size:
  // the rail raises Internal naming both).
  pack(args, chunk, stream);
  step_done(group_, stream, "ht_dispatch: pack");
  exchange(cached ? "ht_dispatch (cached, rail)" : "ht_dispatch (rail)",
           static_cast<size_t>(chunk.bytes), send_slot(0), slot_bytes_, recv_slot(0), slot_bytes_,
           stream);
  step_done(group_, stream, "ht_dispatch: rail");

  // One node-local dispatch per source node, in node order.
  std::vector<HtDispatchResult> blocks(N);
  for (int m = 0; m < N; ++m) {
    HtDispatchArgs a;
    a.expert_alignment = 1;
    a.stream = args.stream;
    a.handle = cached ? &cached_state->handles[m] : nullptr;
    if (m == node_) {
      a.x = args.x;
      a.x_scales = args.x_scales;
      if (!cached) a.topk_idx = view(own_ids_, DType::kI32, T, K, device_);
      a.topk_weights = cached ? TensorView{} : args.topk_weights;
    } else {
      char* c = recv_slot(Topology::other_index(m, node_));
      a.x = view(c + chunk.rows_off, args.x.dtype, C, H, device_);
      if (num_scales > 0)
        a.x_scales = view(c + chunk.scales_off, args.x_scales.dtype, C, num_scales, device_);
      if (!cached) a.topk_idx = view(c + chunk.ids_off, DType::kI32, C, K, device_);
      if (weights) a.topk_weights = view(c + chunk.weights_off, DType::kF32, C, K, device_);
    }
    blocks[m] = ht_->dispatch(a, alloc);
    step_done(group_, stream, "ht_dispatch: node-local dispatch");
  }

  // The outputs: the blocks in node order.
  auto st = std::make_shared<State>();
  st->block_rows.resize(N);
  int64_t rows = 0;
  for (int m = 0; m < N; ++m) {
    st->block_rows[m] = cached ? cached_state->block_rows[m] : blocks[m].handle.num_recv_tokens;
    rows += st->block_rows[m];
  }
  HtDispatchResult res;
  const Device dev = Device::cuda(device_);
  res.recv_x = alloc(args.x.dtype, {rows, H}, dev);
  if (num_scales > 0) res.recv_x_scales = alloc(args.x_scales.dtype, {rows, num_scales}, dev);
  if (!cached) {
    res.recv_topk_idx = alloc(args.topk_idx.dtype, {rows, K}, dev);
    if (weights) res.recv_topk_weights = alloc(DType::kF32, {rows, K}, dev);
    res.recv_src_idx = alloc(DType::kI32, {rows}, dev);
  }
  auto copy_rows = [&](const Tensor& to, const Tensor& from, int64_t first, int64_t n) {
    if (n == 0 || !to.defined()) return;
    const size_t row = static_cast<size_t>(to.numel() / std::max<int64_t>(to.shape[0], 1)) *
                       dtype_size(to.dtype);
    EPX_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(to.data) + first * row, from.data, n * row,
                                   cudaMemcpyDeviceToDevice, stream),
                   "ht_dispatch: outputs");
  };
  int64_t first = 0;
  for (int m = 0; m < N; ++m) {
    const HtDispatchResult& b = blocks[m];
    const int64_t n = st->block_rows[m];
    copy_rows(res.recv_x, b.recv_x, first, n);
    copy_rows(res.recv_x_scales, b.recv_x_scales, first, n);
    if (!cached) {
      copy_rows(res.recv_topk_weights, b.recv_topk_weights, first, n);
      copy_rows(res.recv_src_idx, b.recv_src_idx, first, n);
      if (args.topk_idx.dtype == DType::kI32) {
        copy_rows(res.recv_topk_idx, b.recv_topk_idx, first, n);
      } else if (n > 0) {
        launch_kernel(ht_nodes_widen_kernel, std::max(1, ht_->tuning().num_sms),
                      kHtNodesThreads, 0, stream, false, "ht_dispatch: recv_topk_idx",
                      b.recv_topk_idx.ptr<const int32_t>(),
                      res.recv_topk_idx.ptr<int64_t>() + first * K, n * K);
      }
    }
    first += n;
  }
  step_done(group_, stream, "ht_dispatch: outputs");
  if (cached) {
    res.handle = *args.handle;
  } else {
    res.num_recv_tokens_per_expert.assign(shape_.num_experts / group_.size(), 0);
    for (const HtDispatchResult& b : blocks)
      for (size_t l = 0; l < b.num_recv_tokens_per_expert.size(); ++l)
        res.num_recv_tokens_per_expert[l] += b.num_recv_tokens_per_expert[l];
    const int align = std::max(1, args.expert_alignment);
    for (int& v : res.num_recv_tokens_per_expert) v = (v + align - 1) / align * align;
    finish_handle(args, blocks, alloc, res.handle, stream);
    res.handle.num_recv_tokens = rows;
    res.handle.recv_src_idx = res.recv_src_idx;
    for (int m = 0; m < N; ++m) st->handles.push_back(blocks[m].handle);
    res.handle.backend_state = st;
  }
  rail_->check();  // the rail legs ran before the node-local count exchanges the host awaited
  return res;
}

// The flat handle: this node's columns of the count matrix (from the node-local prefix
// matrices) to every other node over the rail, theirs back, then the prefix matrix,
// is_token_in_rank and send_pos (kernels/ht/nodes.cuh).
void CudaHtNodes::finish_handle(const HtDispatchArgs& args,
                                const std::vector<HtDispatchResult>& blocks,
                                const Allocator& alloc, HtHandle& h, cudaStream_t stream) {
  const int R = group_.size(), G = topology_.ranks_per_node, N = topology_.num_nodes;
  const int64_t T = args.x.shape[0];
  HtNodesColumnsParams cp{};
  for (int m = 0; m < N; ++m) cp.node_rpm[m] = blocks[m].handle.rank_prefix_matrix.ptr<int32_t>();
  cp.cols = cols_;
  cp.num_nodes = N;
  cp.ranks_per_node = G;
  launch_kernel(ht_nodes_columns_kernel, 1, kHtNodesThreads, 0, stream, false,
                "ht_dispatch: count columns", cp);
  step_done(group_, stream, "ht_dispatch: count columns");
  const size_t cols_bytes = align16(size_t{4} * R * G);
  // (One send buffer for every node: the same columns go to each.)
  exchange("ht_dispatch (rail, counts)", size_t{4} * R * G, reinterpret_cast<char*>(cols_), 0,
           recv_cols_, cols_bytes, stream);
  step_done(group_, stream, "ht_dispatch: rail (counts)");
  const Device dev = Device::cuda(device_);
  h.rank_prefix_matrix = alloc(DType::kI32, {R, R}, dev);
  h.is_token_in_rank = alloc(DType::kBool, {T, R}, dev);
  h.send_pos = alloc(DType::kI32, {T, R}, dev);
  h.num_tokens = T;
  h.top_k = shape_.top_k;
  h.buffer_id = buffer_id_;
  HtNodesHandleParams p{};
  p.own_cols = cols_;
  p.recv_cols = recv_cols_;
  p.cols_stride = static_cast<int64_t>(cols_bytes);
  p.topk_idx = args.topk_idx.data;
  p.topk_stride = args.topk_idx.strides[0];
  p.topk_is_i64 = args.topk_idx.dtype == DType::kI64;
  p.num_tokens = static_cast<int>(T);
  p.top_k = shape_.top_k;
  p.num_local_experts = shape_.num_experts / R;
  p.num_nodes = N;
  p.node = node_;
  p.ranks_per_node = G;
  p.rank = group_.rank();
  p.rank_prefix_matrix = h.rank_prefix_matrix.ptr<int32_t>();
  p.is_token_in_rank = h.is_token_in_rank.ptr<bool>();
  p.send_pos = h.send_pos.ptr<int32_t>();
  launch_kernel(ht_nodes_handle_kernel, 1, kHtNodesThreads, 0, stream, false,
                "ht_dispatch: handle", p);
  step_done(group_, stream, "ht_dispatch: handle");
}

HtCombineResult CudaHtNodes::combine(const HtCombineArgs& args, const Allocator& alloc) {
  ht_->require_usable("ht_combine");
  DeviceGuard guard(device_);
  const int N = topology_.num_nodes, K = shape_.top_k;
  const int64_t C = shape_.max_tokens_per_rank, H = shape_.hidden;
  EPX_CHECK(!args.zero_copy, ErrorCode::kUnsupported, "ht_combine: zero_copy across nodes on ",
            "cuda (", N, " nodes of ", topology_.ranks_per_node,
            " ranks) is not built; expected zero_copy = false");
  const HtHandle& h = *args.handle;
  const State& st = state_of(h, "ht_combine");
  auto stream = static_cast<cudaStream_t>(args.stream);
  const bool weights = args.topk_weights.defined();
  const size_t weights_off = align16(C * H * 4);
  // One node-local combine per source node: this node's partial with the biases, the other
  // nodes' into their rail chunks.
  int64_t first = 0;
  for (int m = 0; m < N; ++m) {
    const int64_t rows = st.block_rows[m];
    HtCombineArgs a;
    a.y = rows_of(args.y, first, rows);
    if (weights) a.topk_weights = rows_of(args.topk_weights, first, rows);
    a.handle = &st.handles[m];
    a.stream = args.stream;
    float* out = own_;
    float* out_w = own_w_;
    if (m == node_) {
      a.bias0 = args.bias0;
      a.bias1 = args.bias1;
    } else {
      char* c = send_slot(Topology::other_index(m, node_));
      out = reinterpret_cast<float*>(c);
      out_w = reinterpret_cast<float*>(c + weights_off);
    }
    ht_->combine_partial(a, out, weights ? out_w : nullptr);
    step_done(group_, stream, "ht_combine: node-local combine");
    first += rows;
  }
  exchange("ht_combine (rail)", weights_off + (weights ? C * K * 4 : 0), send_slot(0),
           slot_bytes_, recv_slot(0), slot_bytes_, stream);
  step_done(group_, stream, "ht_combine: rail");
  HtCombineResult res;
  const Device dev = Device::cuda(device_);
  res.out = alloc(DType::kBF16, {h.num_tokens, H}, dev);
  if (weights) res.combined_topk_weights = alloc(DType::kF32, {h.num_tokens, K}, dev);
  HtNodesAddParams p{};
  p.own = own_;
  p.own_w = own_w_;
  p.partials = recv_slot(0);
  p.partial_stride = static_cast<int64_t>(slot_bytes_);
  p.weights_off = static_cast<int64_t>(weights_off);
  p.num_other = N - 1;
  p.num_tokens = h.num_tokens;
  p.hidden = H;
  p.top_k = K;
  p.out = res.out.ptr<uint16_t>();
  p.combined_weights = weights ? res.combined_topk_weights.ptr<float>() : nullptr;
  launch_kernel(ht_nodes_add_kernel, std::max(1, ht_->tuning().num_sms), kHtNodesThreads, 0,
                stream, false, "ht_combine: partials", p);
  step_done(group_, stream, "ht_combine: partials");
  return res;
}

}  // namespace epx::detail

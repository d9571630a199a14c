// tests/gpu/gpu_support.cc — see gpu_support.h.
#include "gpu/gpu_support.h"

#include <cuda_runtime.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <thread>

#include "core/numeric.h"
#include "epx/error.h"
#include "support/harness.h"
#include "support/ll_cases.h"
#include "support/routing.h"
#include "transport/transport.h"

namespace epx::gpu_testing {

int visible_gpus() {
  static int cached = -1;
  if (cached >= 0) return cached;
  int fds[2];
  if (pipe(fds) != 0) return 0;
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
    if (write(fds[1], &n, sizeof(n)) != sizeof(n)) _exit(1);
    _exit(0);
  }
  close(fds[1]);
  int n = 0;
  if (pid < 0 || read(fds[0], &n, sizeof(n)) != sizeof(n)) n = 0;
  close(fds[0]);
  if (pid > 0) waitpid(pid, nullptr, 0);
  cached = n;
  return n;
}

int run_cuda_ranks(int num_ranks, const std::function<int(const Group&)>& body,
                   GroupOptions options) {
  static int counter = 0;
  const std::string path =
      "/tmp/epx-gpu-test-uid-" + std::to_string(getpid()) + "-" + std::to_string(counter++);
  std::remove(path.c_str());
  const int rc = launch_local(
      num_ranks,
      [&](int rank) {
        const UniqueId id =
            exchange_unique_id_via_file(path, rank, std::chrono::milliseconds(60000));
        Group g = Group::cuda(rank, num_ranks, id, rank, options);
        return body(g);
      },
      std::chrono::minutes(5));
  std::remove(path.c_str());
  return rc;
}

namespace {
thread_local cudaStream_t t_rank_stream = nullptr;
thread_local cudaStream_t t_rank_side_stream = nullptr;
// This rank's own memory pool under run_cuda_ranks_one_gpu (nullptr: the device's default pool).
// With one pool for all ranks, cudaMallocAsync may reuse a block another rank freed with
// cudaFreeAsync and make this rank's stream wait for that rank's stream (the pool's
// cudaMemPoolReuseAllowInternalDependencies): a hidden cross-rank dependency, which deadlocks
// until the group timeout when the other stream is behind a kernel waiting for this rank.
thread_local cudaMemPool_t t_rank_pool = nullptr;

bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && std::strcmp(v, "1") == 0;
}
}  // namespace

cudaStream_t rank_stream() { return t_rank_stream; }

cudaStream_t rank_side_stream() { return t_rank_side_stream; }

int device_of(const Group& group) { return group.transport()->device().index; }

int run_cuda_ranks_one_gpu(int num_ranks, int device, const std::function<int(const Group&)>& body,
                           GroupOptions options) {
  const std::string name = testing::unique_group_name("onegpu");
  return launch_local(
      1,
      [&](int) {
        setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 1);  // before CUDA starts in this child
        setenv("CUDA_MODULE_LOADING", "EAGER", 1);       // (Group::cuda_shared_device)
        std::vector<int> rcs(num_ranks, 1);
        std::mutex mu;
        std::vector<std::thread> threads;
        for (int r = 0; r < num_ranks; ++r) {
          threads.emplace_back([&, r] {
            cudaStream_t stream = nullptr, side = nullptr;
            cudaMemPool_t pool = nullptr;
            try {
              CUDA_OK(cudaSetDevice(device));
              CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
              CUDA_OK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
              t_rank_stream = stream;
              t_rank_side_stream = side;
              if (!env_flag("EPX_TEST_SHARED_POOL")) {  // 1: the default pool (the A/B)
                cudaMemPoolProps props{};
                props.allocType = cudaMemAllocationTypePinned;
                props.location.type = cudaMemLocationTypeDevice;
                props.location.id = device;
                CUDA_OK(cudaMemPoolCreate(&pool, &props));
                uint64_t keep = UINT64_MAX;  // keep freed blocks for reuse (no trim at syncs)
                CUDA_OK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
                t_rank_pool = pool;
              }
              Group g = Group::cuda_shared_device(r, num_ranks, name, device, options);
              rcs[r] = body(g);
              CUDA_OK(cudaStreamSynchronize(stream));
            } catch (const std::exception& e) {
              std::lock_guard<std::mutex> lock(mu);
              std::fprintf(stderr, "[one GPU, rank %d of %d] %s\n", r, num_ranks, e.what());
              rcs[r] = 1;
            }
            t_rank_stream = nullptr;
            t_rank_side_stream = nullptr;
            t_rank_pool = nullptr;
            if (side) cudaStreamDestroy(side);
            if (stream) cudaStreamDestroy(stream);
            if (pool) cudaMemPoolDestroy(pool);  // after the stream's frees completed
          });
        }
        for (auto& t : threads) t.join();
        int rc = 0;
        for (int r = 0; r < num_ranks; ++r)
          if (rcs[r] != 0) {
            std::fprintf(stderr, "[one GPU] rank %d of %d returned %d\n", r, num_ranks, rcs[r]);
            if (rc == 0) rc = rcs[r];
          }
        return rc;
      },
      std::chrono::minutes(5));
}

void trace_step(const Group& group, const char* step) {
  static const bool on = env_flag("EPX_TEST_TRACE");
  if (!on) return;
  static const auto t0 = std::chrono::steady_clock::now();
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  std::fprintf(stderr, "[trace %9.1f ms] rank %d: %s\n", ms, group.rank(), step);
}

Allocator device_allocator() {
  cudaStream_t stream = rank_stream();
  if (!stream) return default_allocator();
  return [stream, pool = t_rank_pool, base = default_allocator()](
             DType dtype, const std::vector<int64_t>& shape, Device device) {
    if (device.type != DeviceType::kCuda) return base(dtype, shape, device);
    Tensor t;
    static_cast<TensorView&>(t) = TensorView::contiguous(nullptr, dtype, shape, device);
    const size_t bytes = t.nbytes();
    if (bytes == 0) return t;
    void* p = nullptr;
    const size_t padded = (bytes + 15) / 16 * 16;
    if (pool) {
      CUDA_OK(cudaMallocFromPoolAsync(&p, padded, pool, stream));
    } else {
      CUDA_OK(cudaMallocAsync(&p, padded, stream));
    }
    t.data = p;
    t.storage = std::shared_ptr<void>(p, [stream](void* q) { cudaFreeAsync(q, stream); });
    return t;
  };
}

void upload_on_rank_stream(void* dst, const void* host, size_t bytes, cudaStream_t stream) {
  CUDA_OK(cudaStreamSynchronize(stream));
  if (bytes > 0) CUDA_OK(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
}

Tensor to_device(const void* host, size_t bytes, DType dtype, const std::vector<int64_t>& shape,
                 int device) {
  Tensor t = device_allocator()(dtype, shape, Device::cuda(device));
  if (cudaStream_t s = rank_stream()) {
    upload_on_rank_stream(t.data, host, bytes, s);
    return t;
  }
  if (bytes > 0 && cudaMemcpy(t.data, host, bytes, cudaMemcpyHostToDevice) != cudaSuccess)
    throw Error(ErrorCode::kCuda, "to_device: cudaMemcpy failed");
  return t;
}

std::vector<uint8_t> to_host_bytes(const TensorView& t) {
  if (cudaStream_t s = rank_stream()) {
    std::vector<uint8_t> out(t.nbytes());
    CUDA_OK(cudaStreamSynchronize(s));
    if (!out.empty()) CUDA_OK(cudaMemcpyAsync(out.data(), t.data, out.size(), cudaMemcpyDeviceToHost, s));
    CUDA_OK(cudaStreamSynchronize(s));
    return out;
  }
  if (cudaDeviceSynchronize() != cudaSuccess)
    throw Error(ErrorCode::kCuda,
                std::string("to_host: ") + cudaGetErrorString(cudaGetLastError()));
  std::vector<uint8_t> out(t.nbytes());
  if (!out.empty() &&
      cudaMemcpy(out.data(), t.data, out.size(), cudaMemcpyDeviceToHost) != cudaSuccess)
    throw Error(ErrorCode::kCuda, "to_host: cudaMemcpy failed");
  return out;
}

Tensor host_copy(const TensorView& t, std::vector<std::vector<uint8_t>>& keep) {
  Tensor h;
  if (!t.defined()) return h;
  keep.push_back(to_host_bytes(t));
  static_cast<TensorView&>(h) = t;
  h.data = keep.back().data();
  h.device = Device::cpu();
  return h;
}

std::vector<uint16_t> rows_image(const std::vector<uint16_t>& src, int64_t n, int64_t H,
                                 bool padded, int64_t* stride, int64_t pad) {
  *stride = padded ? H + pad : H;
  std::vector<uint16_t> data(std::max<int64_t>(n, 1) * *stride, 0xDEAD);
  for (int64_t i = 0; i < n; ++i) std::copy_n(src.begin() + i * H, H, data.begin() + i * *stride);
  return data;
}

Tensor upload_rows(const std::vector<uint16_t>& src, int64_t n, int64_t H, bool padded, int device,
                   int64_t* stride, int64_t pad) {
  const std::vector<uint16_t> data = rows_image(src, n, H, padded, stride, pad);
  return to_device(data, DType::kBF16, {static_cast<int64_t>(data.size())}, device);
}

Tensor upload_topk(const std::vector<int64_t>& topk, int64_t T, int K, bool i32, int device) {
  if (i32)
    return to_device(std::vector<int32_t>(topk.begin(), topk.end()), DType::kI32, {T, K}, device);
  return to_device(topk, DType::kI64, {T, K}, device);
}

LlDispatchArgs ll_dispatch_inputs(const testing::LlCase& c, const testing::LlRankInput& in,
                                  int device, std::vector<Tensor>& keep) {
  const int64_t T = in.num_tokens, H = c.p.hidden;
  int64_t stride = H;
  keep.push_back(upload_rows(in.x, T, H, c.padded, device, &stride, c.unaligned_x ? 1 : 64));
  LlDispatchArgs a;
  a.x = TensorView::contiguous(keep.back().data, DType::kBF16, {T, H}, Device::cuda(device));
  a.x.strides[0] = stride;
  keep.push_back(upload_topk(in.topk_idx, T, c.p.top_k, c.topk_i32, device));
  a.topk_idx = keep.back();
  a.use_fp8 = c.p.use_fp8;
  a.round_scale = c.p.round_scale;
  a.use_ue8m0 = c.p.use_ue8m0;
  return a;
}

LlCombineArgs ll_combine_inputs(const testing::LlCase& c, const testing::LlRankInput& in,
                                const std::vector<uint16_t>* y, int device,
                                std::vector<Tensor>& keep) {
  const int64_t T = in.num_tokens, H = c.p.hidden, RT = c.p.rows_per_expert();
  const int K = c.p.top_k, L = c.p.num_local_experts();
  LlCombineArgs a;
  keep.push_back(upload_topk(in.topk_idx, T, K, c.topk_i32, device));
  a.topk_idx = keep.back();
  keep.push_back(to_device(in.topk_weights, DType::kF32, {T, K}, device));
  a.topk_weights = keep.back();
  if (y != nullptr) {
    // unaligned_y: a row stride of H + 1, so y's rows are not 16-byte aligned (the combine
    // routes this rank's rows through its buffer: kernels/ll/combine.cuh copy_own).
    int64_t stride = H;
    keep.push_back(
        upload_rows(*y, L * RT, H, c.padded, device, &stride, c.unaligned_y ? 1 : 64));
    a.y = TensorView::contiguous(keep.back().data, DType::kBF16, {L, RT, H}, Device::cuda(device));
    a.y.strides = {RT * stride, stride, 1};
  }
  return a;
}

LlDispatchResult host_ll_dispatch(const LlDispatchResult& d,
                                  std::vector<std::vector<uint8_t>>& keep) {
  keep.reserve(keep.size() + 8);
  LlDispatchResult h;
  h.recv_x = host_copy(d.recv_x, keep);
  h.recv_scales = host_copy(d.recv_scales, keep);
  h.recv_count = host_copy(d.recv_count, keep);
  h.handle = d.handle;
  h.handle.src_info = host_copy(d.handle.src_info, keep);
  h.handle.layout_range = host_copy(d.handle.layout_range, keep);
  return h;
}

std::vector<uint8_t> storage_bytes(const TensorView& t, int64_t elems) {
  std::vector<uint8_t> out(static_cast<size_t>(elems) * dtype_size(t.dtype));
  if (out.empty()) return out;
  if (t.device.type == DeviceType::kCpu) {
    std::memcpy(out.data(), t.data, out.size());
  } else {
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemcpy(out.data(), t.data, out.size(), cudaMemcpyDeviceToHost));
  }
  return out;
}

std::vector<uint8_t> logical_bytes(const TensorView& t) {
  const size_t es = dtype_size(t.dtype);
  int64_t n = 1, extent = 1;
  for (int d = 0; d < t.ndim; ++d) {
    n *= t.shape[d];
    extent += (t.shape[d] - 1) * t.strides[d];
  }
  if (n == 0) return {};
  const std::vector<uint8_t> raw = storage_bytes(t, extent);
  std::vector<uint8_t> out(static_cast<size_t>(n) * es);
  for (int64_t i = 0; i < n; ++i) {
    int64_t rem = i, off = 0;
    for (int d = t.ndim - 1; d >= 0; --d) {
      off += (rem % t.shape[d]) * t.strides[d];
      rem /= t.shape[d];
    }
    std::memcpy(out.data() + i * es, raw.data() + off * es, es);
  }
  return out;
}

std::string diff_bytes(const std::string& what, const std::vector<uint8_t>& want,
                       const std::vector<uint8_t>& got) {
  if (want.size() != got.size())
    return what + ": " + std::to_string(got.size()) + " bytes, expected " +
           std::to_string(want.size());
  size_t first = want.size(), count = 0;
  for (size_t i = 0; i < want.size(); ++i)
    if (want[i] != got[i]) {
      if (first == want.size()) first = i;
      ++count;
    }
  if (count == 0) return "";
  char buf[160];
  std::snprintf(buf, sizeof(buf),
                ": %zu of %zu bytes differ, first at byte %zu (got 0x%02x, "
                "expected 0x%02x)",
                count, want.size(), first, got[first], want[first]);
  return what + buf;
}

double graph_replays_us(const Group& group, cudaStream_t stream, cudaGraphExec_t exec,
                        int replays) {
  group.transport()->barrier("graph replays");
  for (int i = 0; i < 2; ++i) CUDA_OK(cudaGraphLaunch(exec, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  group.transport()->barrier("graph replays, warm");
  cudaEvent_t ev[2];
  for (cudaEvent_t& e : ev) CUDA_OK(cudaEventCreate(&e));
  CUDA_OK(cudaEventRecord(ev[0], stream));
  for (int i = 0; i < replays; ++i) CUDA_OK(cudaGraphLaunch(exec, stream));
  CUDA_OK(cudaEventRecord(ev[1], stream));
  CUDA_OK(cudaEventSynchronize(ev[1]));
  float ms = 0;
  CUDA_OK(cudaEventElapsedTime(&ms, ev[0], ev[1]));
  for (cudaEvent_t e : ev) cudaEventDestroy(e);
  return 1000.0 * ms;
}

std::vector<std::string> split_commas(const std::string& list) {
  std::vector<std::string> v;
  for (size_t p = 0; p < list.size();) {
    size_t q = list.find(',', p);
    if (q == std::string::npos) q = list.size();
    if (q > p) v.push_back(list.substr(p, q - p));
    p = q + 1;
  }
  return v;
}

std::vector<int64_t> parse_int_list(const std::string& list) {
  std::vector<int64_t> v;
  for (size_t p = 0; p < list.size();) {
    size_t q = list.find(',', p);
    if (q == std::string::npos) q = list.size();
    v.push_back(std::atoll(list.substr(p, q - p).c_str()));
    p = q + 1;
  }
  return v;
}

Allocator poison_allocator(int byte) {
  return [byte](DType dtype, const std::vector<int64_t>& shape, Device device) {
    Tensor t = device_allocator()(dtype, shape, device);
    if (t.nbytes() == 0) return t;
    if (cudaStream_t s = device.type == DeviceType::kCuda ? rank_stream() : nullptr) {
      CUDA_OK(cudaMemsetAsync(t.data, byte, t.nbytes(), s));
      CUDA_OK(cudaStreamSynchronize(s));
    } else if (device.type == DeviceType::kCuda) {
      if (cudaMemset(t.data, byte, t.nbytes()) != cudaSuccess ||
          cudaDeviceSynchronize() != cudaSuccess)
        throw Error(ErrorCode::kCuda, "poison_allocator: cudaMemset failed");
    } else {
      std::memset(t.data, byte, t.nbytes());
    }
    return t;
  };
}

cudaGraph_t capture_graph(cudaStream_t stream, const std::function<void()>& fn) {
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  cudaGraph_t graph = nullptr;
  try {
    fn();
  } catch (...) {
    if (cudaStreamEndCapture(stream, &graph) != cudaSuccess) (void)cudaGetLastError();
    if (graph != nullptr) cudaGraphDestroy(graph);
    throw;
  }
  if (cudaStreamEndCapture(stream, &graph) != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return graph;
}

Allocator Arena::allocator() {
  return [this](DType dtype, const std::vector<int64_t>& shape, Device device) {
    if (recording) {
      tensors.push_back(base(dtype, shape, device));
      return tensors.back();
    }
    Tensor t = tensors.at(next++);
    bool ok = t.dtype == dtype && t.ndim == static_cast<int>(shape.size());
    for (size_t i = 0; ok && i < shape.size(); ++i) ok = t.shape[i] == shape[i];
    if (!ok) throw Error(ErrorCode::kInternal, "arena: allocation sequence changed under capture");
    return t;
  };
}

int expect_error(int rank, const char* what, const std::function<void()>& f, ErrorCode code,
                 std::initializer_list<const char*> words) {
  try {
    f();
    std::fprintf(stderr, "[rank %d] %s: no error\n", rank, what);
    return 1;
  } catch (const Error& e) {
    bool ok = e.code() == code;
    for (const char* w : words) ok = ok && std::string(e.what()).find(w) != std::string::npos;
    if (!ok) std::fprintf(stderr, "[rank %d] %s: %s\n", rank, what, e.what());
    return ok ? 0 : 1;
  }
}

int expect_unsupported(int rank, const char* what, const std::function<void()>& f,
                       std::initializer_list<const char*> words) {
  return expect_error(rank, what, f, ErrorCode::kUnsupported, words);
}

std::string TopologyParamName::topology_suffix(int nodes, int per_node) {
  return testing::topology_name({nodes, per_node});
}

}  // namespace epx::gpu_testing

// tests/gpu/gpu_support.cc — see gpu_support.h.
#include "gpu/gpu_support.h"

#include <cuda_runtime.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <thread>

#include "epx/error.h"
#include "support/harness.h"
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
}

cudaStream_t rank_stream() { return t_rank_stream; }

int device_of(const Group& group) { return group.transport()->device().index; }

int run_cuda_ranks_one_gpu(int num_ranks, int device, const std::function<int(const Group&)>& body,
                           GroupOptions options) {
  const std::string name = testing::unique_group_name("onegpu");
  return launch_local(
      1,
      [&](int) {
        setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 1);  // before CUDA starts in this child
        std::vector<int> rcs(num_ranks, 1);
        std::mutex mu;
        std::vector<std::thread> threads;
        for (int r = 0; r < num_ranks; ++r) {
          threads.emplace_back([&, r] {
            cudaStream_t stream = nullptr;
            try {
              CUDA_OK(cudaSetDevice(device));
              CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
              t_rank_stream = stream;
              Group g = Group::cuda_shared_device(r, num_ranks, name, device, options);
              rcs[r] = body(g);
              CUDA_OK(cudaStreamSynchronize(stream));
            } catch (const std::exception& e) {
              std::lock_guard<std::mutex> lock(mu);
              std::fprintf(stderr, "[one GPU, rank %d of %d] %s\n", r, num_ranks, e.what());
              rcs[r] = 1;
            }
            t_rank_stream = nullptr;
            if (stream) cudaStreamDestroy(stream);
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

Allocator device_allocator() {
  cudaStream_t stream = rank_stream();
  if (!stream) return default_allocator();
  return [stream, base = default_allocator()](DType dtype, const std::vector<int64_t>& shape,
                                              Device device) {
    if (device.type != DeviceType::kCuda) return base(dtype, shape, device);
    Tensor t;
    static_cast<TensorView&>(t) = TensorView::contiguous(nullptr, dtype, shape, device);
    const size_t bytes = t.nbytes();
    if (bytes == 0) return t;
    void* p = nullptr;
    CUDA_OK(cudaMallocAsync(&p, (bytes + 15) / 16 * 16, stream));
    t.data = p;
    t.storage = std::shared_ptr<void>(p, [stream](void* q) { cudaFreeAsync(q, stream); });
    return t;
  };
}

Tensor to_device(const void* host, size_t bytes, DType dtype, const std::vector<int64_t>& shape,
                 int device) {
  Tensor t = device_allocator()(dtype, shape, Device::cuda(device));
  if (cudaStream_t s = rank_stream()) {
    if (bytes > 0) CUDA_OK(cudaMemcpyAsync(t.data, host, bytes, cudaMemcpyHostToDevice, s));
    CUDA_OK(cudaStreamSynchronize(s));
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

}  // namespace epx::gpu_testing

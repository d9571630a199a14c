// tests/gpu/gpu_support.cc — see gpu_support.h.
#include "gpu/gpu_support.h"

#include <cuda_runtime.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>

#include "epx/error.h"

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

Tensor to_device(const void* host, size_t bytes, DType dtype, const std::vector<int64_t>& shape,
                 int device) {
  Tensor t = default_allocator()(dtype, shape, Device::cuda(device));
  if (bytes > 0 && cudaMemcpy(t.data, host, bytes, cudaMemcpyHostToDevice) != cudaSuccess)
    throw Error(ErrorCode::kCuda, "to_device: cudaMemcpy failed");
  return t;
}

std::vector<uint8_t> to_host_bytes(const TensorView& t) {
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
    Tensor t = default_allocator()(dtype, shape, device);
    if (t.nbytes() == 0) return t;
    if (device.type == DeviceType::kCuda) {
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

// src/core/expert_load.cc — see expert_load.h. Data flow: the received routing of one dispatch
// (ht local ids [rows, K], a2a global ids [R, M, K] + counts [R], or ll counts [L]) -> +1 per
// (row, distinct local expert) into host_[L] (cpu tensors, counted here) or device_[L] (cuda
// tensors, counted by src/cuda/quant.cu's kernels on the caller's stream).
#include "core/expert_load.h"

#include <algorithm>

#include "core/check.h"
#include "core/quant_cuda.h"

namespace epx::detail {

namespace {

// Distinct local experts of one row of local ids (-1 or out of range = none) into `load`.
template <typename Idx>
void count_row(const Idx* row, int64_t stride, int64_t K, int L, int64_t* load) {
  for (int64_t k = 0; k < K; ++k) {
    const int64_t l = row[k * stride];
    if (l < 0 || l >= L) continue;
    bool seen = false;
    for (int64_t j = 0; j < k && !seen; ++j) seen = row[j * stride] == row[k * stride];
    if (!seen) ++load[l];
  }
}

}  // namespace

ExpertLoad::ExpertLoad(int num_local_experts, Device device)
    : num_local_experts_(num_local_experts), host_(static_cast<size_t>(num_local_experts), 0) {
  if (device.type != DeviceType::kCuda) return;
  device_ = default_allocator()(DType::kI64, {num_local_experts_}, device);
  cuda_expert_load_zero(device_, nullptr, /*wait=*/true);
}

const Tensor& ExpertLoad::device_counter(const Device& device, Stream stream, const char* op) {
  if (!device_.defined()) {
    device_ = default_allocator()(DType::kI64, {num_local_experts_}, device);
    cuda_expert_load_zero(device_, stream);
  }
  EPX_CHECK_ARG(device_.device == device, op, ": tensors on ", device.str(),
                ", expected the device of the earlier dispatches (", device_.device.str(), ")");
  return device_;
}

void ExpertLoad::add_local_ids(const TensorView& ids, Stream stream) {
  const char* op = "expert load (local ids)";
  check_dtype(ids, op, "ids", {DType::kI64, DType::kI32});
  check_shape(ids, op, "ids", {-1, -1});
  if (ids.device.type == DeviceType::kCuda) {
    cuda_expert_load_add_local_ids(ids, device_counter(ids.device, stream, op), stream);
    return;
  }
  const int L = num_local_experts_;
  for (int64_t row = 0; row < ids.shape[0]; ++row) {
    const int64_t off = row * ids.strides[0];
    if (ids.dtype == DType::kI64)
      count_row(ids.ptr<int64_t>() + off, ids.strides[1], ids.shape[1], L, host_.data());
    else
      count_row(ids.ptr<int32_t>() + off, ids.strides[1], ids.shape[1], L, host_.data());
  }
}

void ExpertLoad::add_global_ids(const TensorView& ids, const TensorView& counts, int rank,
                                Stream stream) {
  const char* op = "expert load (global ids)";
  check_dtype(ids, op, "ids", {DType::kI32});
  check_shape(ids, op, "ids", {-1, -1, -1});
  check_dtype(counts, op, "counts", {DType::kI32});
  check_shape(counts, op, "counts", {ids.shape[0]});
  check_device(counts, op, "counts", ids.device);
  if (ids.device.type == DeviceType::kCuda) {
    cuda_expert_load_add_global_ids(ids, counts, rank, device_counter(ids.device, stream, op),
                                    stream);
    return;
  }
  const int L = num_local_experts_;
  const int64_t R = ids.shape[0], M = ids.shape[1], K = ids.shape[2];
  std::vector<int32_t> local(static_cast<size_t>(K));
  for (int64_t src = 0; src < R; ++src) {
    const int64_t rows = std::min<int64_t>(counts.ptr<int32_t>()[src * counts.strides[0]], M);
    for (int64_t j = 0; j < rows; ++j) {
      const int32_t* row = ids.ptr<int32_t>() + src * ids.strides[0] + j * ids.strides[1];
      for (int64_t k = 0; k < K; ++k) {
        const int32_t id = row[k * ids.strides[2]];
        local[k] = (id >= 0 && id / L == rank) ? id % L : -1;
      }
      count_row(local.data(), 1, K, L, host_.data());
    }
  }
}

void ExpertLoad::add_counts(const TensorView& counts, Stream stream) {
  const char* op = "expert load (counts)";
  check_dtype(counts, op, "counts", {DType::kI32});
  check_shape(counts, op, "counts", {num_local_experts_});
  if (counts.device.type == DeviceType::kCuda) {
    cuda_expert_load_add_counts(counts, device_counter(counts.device, stream, op), stream);
    return;
  }
  for (int l = 0; l < num_local_experts_; ++l)
    host_[l] += counts.ptr<int32_t>()[l * counts.strides[0]];
}

std::vector<int64_t> ExpertLoad::read(Stream stream) const {
  std::vector<int64_t> load = host_;
  if (device_.defined()) {
    const std::vector<int64_t> d = cuda_expert_load_read(device_, stream);
    for (size_t l = 0; l < load.size(); ++l) load[l] += d[l];
  }
  return load;
}

void ExpertLoad::reset(Stream stream) {
  std::fill(host_.begin(), host_.end(), 0);
  if (device_.defined()) cuda_expert_load_zero(device_, stream);
}

}  // namespace epx::detail

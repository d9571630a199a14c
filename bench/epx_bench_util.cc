// bench/epx_bench_util.cc — host/device copies, timing and result rows for the mode runners.
//
// Timing: cpu — for each of `iters` calls (after `warmup` untimed ones) every rank meets at a
// barrier, then this rank's wall clock brackets the call; the cpu ops end with a barrier of
// their own, so rank 0's time covers the whole collective. cuda — bench::time_on_device (CUDA
// events around each call on the bench's stream).
// Device copies use the CUDA runtime only in a cuda build (EPX_BENCH_CUDA); otherwise a cuda
// device is reported as Unsupported.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>

#include "bench/epx_bench.h"
#include "core/check.h"
#include "core/numeric.h"
#include "support/routing.h"

#if defined(EPX_BENCH_CUDA)
#include <cuda_runtime.h>
#endif

namespace epx::bench {

namespace {

#if defined(EPX_BENCH_CUDA)
void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    detail::throw_error(ErrorCode::kCuda,
                        detail::cat("epx-bench: ", what, ": ", cudaGetErrorString(e)));
}
#else
[[noreturn]] void no_cuda(const char* what) {
  detail::throw_error(ErrorCode::kUnsupported,
                      detail::cat("epx-bench: ", what, ": built without CUDA"));
}
#endif

void copy_bytes(void* dst, Device dst_dev, const void* src, Device src_dev, size_t n) {
  if (n == 0) return;
  if (dst_dev.type == DeviceType::kCpu && src_dev.type == DeviceType::kCpu) {
    std::memcpy(dst, src, n);
    return;
  }
#if defined(EPX_BENCH_CUDA)
  cuda_ok(cudaMemcpy(dst, src, n, cudaMemcpyDefault), "cudaMemcpy");
#else
  no_cuda("copy to or from a cuda device");
#endif
}

Timing summarize(std::vector<double> us) {
  Timing t;
  if (us.empty()) return t;
  std::sort(us.begin(), us.end());
  t.min_us = us.front();
  t.max_us = us.back();
  const size_t n = us.size();
  t.median_us = n % 2 ? us[n / 2] : 0.5 * (us[n / 2 - 1] + us[n / 2]);
  return t;
}

double now_us() {
  return std::chrono::duration<double, std::micro>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

std::vector<int64_t> default_tokens(const std::string& mode, Backend backend) {
  const bool cpu = backend == Backend::kCpu;
  if (mode == "ht") return {cpu ? 256 : 4096};
  if (mode == "ll") return {cpu ? 8 : 128};
  return {cpu ? 64 : 128};  // a2a
}

std::mt19937_64 rank_rng(uint64_t seed, int rank, uint64_t salt) {
  std::seed_seq seq{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32),
                    static_cast<uint32_t>(rank), static_cast<uint32_t>(salt)};
  return std::mt19937_64(seq);
}

RankData make_rank_data(const Options& opt, int rank, int num_ranks, int64_t num_tokens,
                        uint64_t salt, bool with_data) {
  std::mt19937_64 rng = rank_rng(opt.seed, rank, salt);
  RankData d;
  d.topk_idx = testing::make_topk_idx(testing::routing_from_name(opt.routing), num_tokens,
                                      opt.top_k, opt.num_experts, num_ranks, rng);
  if (with_data) {
    d.topk_weights = testing::make_topk_weights(d.topk_idx, rng);
    d.x = testing::make_bf16(num_tokens, opt.hidden, rng);
  }
  return d;
}

void fill_hash_bf16(uint16_t* dst, int64_t n, uint64_t key) {
  for (int64_t i = 0; i < n; ++i) {
    uint64_t z = key * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(i) + 0x632BE59BD9B4E019ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    // Uniform in (-1, 1) times 2^(0..3): finite, exactly representable sums stay rare.
    const float u = static_cast<float>(static_cast<int64_t>(z >> 40) - (1 << 23)) / (1 << 23);
    dst[i] = detail::f32_to_bf16(u * static_cast<float>(1 << (z & 3)));
  }
}

std::vector<int> ranks_of(const int64_t* row, int top_k, int num_local_experts) {
  std::vector<int> ranks;
  for (int k = 0; k < top_k; ++k) {
    if (row[k] < 0) continue;
    const int d = static_cast<int>(row[k] / num_local_experts);
    if (std::find(ranks.begin(), ranks.end(), d) == ranks.end()) ranks.push_back(d);
  }
  std::sort(ranks.begin(), ranks.end());
  return ranks;
}

Allocator make_caching_allocator() {
  struct Block {
    std::shared_ptr<void> storage;  // the base allocator's ownership
    void* data;
  };
  struct Pool {
    std::mutex mu;
    std::multimap<std::pair<int, size_t>, Block> free;  // (device, bytes) -> block
  };
  auto pool = std::make_shared<Pool>();
  const Allocator base = default_allocator();
  return [pool, base](DType dtype, const std::vector<int64_t>& shape, Device device) {
    int64_t numel = 1;
    for (int64_t d : shape) numel *= d;
    const size_t bytes = std::max<size_t>(256, (numel * dtype_size(dtype) + 255) / 256 * 256);
    const std::pair<int, size_t> key{device.type == DeviceType::kCpu ? -1 : device.index, bytes};
    Block block{nullptr, nullptr};
    {
      std::lock_guard<std::mutex> lock(pool->mu);
      auto it = pool->free.find(key);
      if (it != pool->free.end()) {
        block = std::move(it->second);
        pool->free.erase(it);
      }
    }
    if (!block.data) {
      Tensor t = base(DType::kU8, {static_cast<int64_t>(bytes)}, device);
      block = Block{t.storage, t.data};
    }
    Tensor out;
    static_cast<TensorView&>(out) = TensorView::contiguous(block.data, dtype, shape, device);
    out.storage = std::shared_ptr<void>(block.data, [pool, key, block](void*) {
      std::lock_guard<std::mutex> lock(pool->mu);
      pool->free.emplace(key, block);
    });
    return out;
  };
}

Tensor upload(const void* bytes, DType dtype, const std::vector<int64_t>& shape, Device device) {
  Tensor t = default_allocator()(dtype, shape, device);
  copy_bytes(t.data, device, bytes, Device::cpu(), t.nbytes());
  return t;
}

void copy_into(const TensorView& dst, const void* bytes, size_t num_bytes) {
  EPX_CHECK(dst.is_contiguous() && num_bytes <= dst.nbytes(), ErrorCode::kInternal,
            "epx-bench copy_into: destination ", dst.describe(), " cannot take ", num_bytes,
            " contiguous bytes");
  copy_bytes(dst.data, dst.device, bytes, Device::cpu(), num_bytes);
}

// Elements from the view's base pointer to its last element, inclusive (0 when empty).
static int64_t span_elems(const TensorView& t) {
  if (t.numel() == 0) return 0;
  int64_t span = 1;
  for (int d = 0; d < t.ndim; ++d) {
    EPX_CHECK(t.strides[d] >= 0, ErrorCode::kInternal, "epx-bench: negative stride in ",
              t.describe());
    span += (t.shape[d] - 1) * t.strides[d];
  }
  return span;
}

Tensor host_copy(const TensorView& t) {
  Tensor h;
  static_cast<TensorView&>(h) = t;
  h.device = Device::cpu();
  if (!t.defined()) return h;
  const size_t n = static_cast<size_t>(span_elems(t)) * dtype_size(t.dtype);
  std::shared_ptr<uint8_t[]> mem(new uint8_t[n > 0 ? n : 1]);
  copy_bytes(mem.get(), Device::cpu(), t.data, t.device, n);
  h.data = mem.get();
  h.storage = std::shared_ptr<void>(mem, mem.get());
  return h;
}

std::vector<uint8_t> download(const TensorView& t) {
  const size_t esize = dtype_size(t.dtype);
  const int64_t n = t.numel();
  std::vector<uint8_t> out(static_cast<size_t>(n) * esize);
  if (n == 0) return out;
  // Copy the whole span the view covers, then gather in logical order.
  std::vector<uint8_t> raw(static_cast<size_t>(span_elems(t)) * esize);
  copy_bytes(raw.data(), Device::cpu(), t.data, t.device, raw.size());
  if (t.is_contiguous()) return raw;
  std::vector<int64_t> idx(t.ndim, 0);
  for (int64_t i = 0; i < n; ++i) {
    int64_t off = 0;
    for (int d = 0; d < t.ndim; ++d) off += idx[d] * t.strides[d];
    std::memcpy(out.data() + i * esize, raw.data() + off * esize, esize);
    for (int d = t.ndim - 1; d >= 0; --d) {
      if (++idx[d] < t.shape[d]) break;
      idx[d] = 0;
    }
  }
  return out;
}

std::string compare_tensor(const char* name, const TensorView& got, const void* want,
                           size_t want_bytes) {
  const size_t esize = dtype_size(got.dtype);
  if (!got.defined() && want_bytes == 0) return "";
  if (got.nbytes() != want_bytes)
    return detail::cat(name, ": is ", got.describe(), " (", got.nbytes(), " bytes), expected ",
                       want_bytes, " bytes");
  const std::vector<uint8_t> b = download(got);
  const auto* w = static_cast<const uint8_t*>(want);
  int64_t num_bad = 0, first = -1;
  for (size_t i = 0; i < b.size(); i += esize) {
    if (std::memcmp(b.data() + i, w + i, esize) != 0) {
      if (first < 0) first = static_cast<int64_t>(i / esize);
      ++num_bad;
    }
  }
  if (num_bad == 0) return "";
  // Multi-index of the first mismatch, and the two values' bits.
  std::string at;
  int64_t rest = first;
  for (int d = got.ndim - 1; d >= 0; --d) {
    at = std::to_string(rest % std::max<int64_t>(got.shape[d], 1)) + (at.empty() ? "" : ", ") + at;
    rest /= std::max<int64_t>(got.shape[d], 1);
  }
  auto bits = [&](const uint8_t* p) {
    uint64_t v = 0;
    std::memcpy(&v, p, std::min<size_t>(esize, 8));
    char buf[32];
    std::snprintf(buf, sizeof(buf), "0x%0*llx", static_cast<int>(2 * esize),
                  static_cast<unsigned long long>(v));
    return std::string(buf);
  };
  return detail::cat(name, "[", at, "] is ", bits(b.data() + first * esize), ", expected ",
                     bits(w + first * esize), " (", num_bad, " of ", b.size() / esize,
                     " elements differ)");
}

void device_synchronize(Device device) {
  if (device.type == DeviceType::kCpu) return;
#if defined(EPX_BENCH_CUDA)
  cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
#else
  no_cuda("device_synchronize");
#endif
}

void stream_synchronize(Device device, Stream stream) {
  if (device.type == DeviceType::kCpu) return;
#if defined(EPX_BENCH_CUDA)
  cuda_ok(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), "cudaStreamSynchronize");
#else
  (void)stream;
  no_cuda("stream_synchronize");
#endif
}

Stream make_stream(Device device) {
  if (device.type == DeviceType::kCpu) return nullptr;
#if defined(EPX_BENCH_CUDA)
  cudaStream_t s = nullptr;
  cuda_ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  return s;  // lives until the process ends
#else
  no_cuda("make_stream");
#endif
}

TimeMethod time_method(const Ctx& ctx) {
  return ctx.opt.pipelined ? TimeMethod::kPipelined : TimeMethod::kBarrier;
}

Timing time_op(Ctx& ctx, const std::function<void()>& step) {
  if (ctx.is_cuda())
    return time_on_device(ctx.group, ctx.stream, ctx.warmup, ctx.iters, step, time_method(ctx));
  return time_sequence(ctx, {step}).front();
}

std::vector<Timing> time_sequence(Ctx& ctx, const std::vector<std::function<void()>>& steps,
                                  const std::vector<bool>& in_total) {
  EPX_CHECK(!ctx.is_cuda(), ErrorCode::kInternal, "time_sequence is the cpu timer");
  std::vector<std::vector<double>> us(steps.size() + 1);
  for (int i = 0; i < ctx.warmup + ctx.iters; ++i) {
    double total = 0;
    for (size_t s = 0; s < steps.size(); ++s) {
      ctx.group.barrier();
      const double t0 = now_us();
      steps[s]();
      const double t1 = now_us();
      if (i >= ctx.warmup) us[s].push_back(t1 - t0);
      if (in_total.empty() || in_total[s]) total += t1 - t0;
    }
    if (i >= ctx.warmup) us.back().push_back(total);
  }
  std::vector<Timing> out;
  for (auto& v : us) out.push_back(summarize(std::move(v)));
  return out;
}

void add_result(Ctx& ctx, const std::string& op, int64_t num_tokens, const Timing& t,
                double cross_bytes, double recv_bytes, int64_t sym_bytes, const Check& check,
                double row_bytes) {
  RankReport& rep = ctx.report;
  EPX_CHECK(rep.num_ops < kMaxOps, ErrorCode::kInternal, "epx-bench: more than ", kMaxOps,
            " result rows");
  OpResult& r = rep.ops[rep.num_ops++];
  std::memset(static_cast<void*>(&r), 0, sizeof(r));
  std::snprintf(r.op, sizeof(r.op), "%s", op.c_str());
  r.num_tokens = num_tokens;
  r.time = t;
  r.cross_bytes = cross_bytes;
  r.recv_bytes = recv_bytes;
  r.row_bytes = row_bytes;
  r.num_sms = ctx.opt.num_sms;
  r.sym_bytes = sym_bytes;
  r.check = !check.run ? CheckState::kNotRun : check.ok() ? CheckState::kPass : CheckState::kFail;
  std::snprintf(r.check_detail, sizeof(r.check_detail), "%s", check.failure.c_str());
  if (check.run && !check.ok()) rep.failed = 1;
  const int R = ctx.num_ranks();
  if (ctx.is_cuda() && R > 1 && cross_bytes > 0) {
    // Same bytes to every peer, rounded up to 16-byte stores; identical on every rank because
    // cross_bytes is the group mean computed from the (regenerable) routing of every rank.
    size_t per_peer = static_cast<size_t>(cross_bytes / (R - 1));
    per_peer = (per_peer + 15) / 16 * 16;
    r.ceiling_sms = ctx.opt.num_sms > 0 ? ctx.opt.num_sms : 16;
    r.nccl = nccl_all_to_all(ctx.group, per_peer, ctx.warmup, ctx.iters, time_method(ctx));
    r.ceiling = nvlink_copy_ceiling(ctx.group, per_peer, r.ceiling_sms, ctx.warmup, ctx.iters,
                                    time_method(ctx));
    r.has_baselines = true;
  }
}

void progress(const Ctx& ctx, const std::string& line) {
  if (ctx.rank() != 0) return;
  std::fprintf(stderr, "[epx-bench] %s\n", line.c_str());
  std::fflush(stderr);
}

}  // namespace epx::bench

// src/core/capacity.cc — the size check of Buffer and A2a shapes before anything is allocated
// (docs/semantics.md §4): the symmetric bytes a shape needs per rank must not exceed
// kMaxSymmetricBytes (transport/transport.h, 1 TiB), else OutOfCapacity naming the shape fields
// and the bytes. The backends' layouts compute their sizes in size_t without overflow checks, so
// this runs first: an upper bound of every backend's layout, computed in saturating 128-bit
// arithmetic, lets a shape through at once when it is below the limit; above it, the exact size
// (when the bound shows the layout cannot overflow 64 bits) or a lower bound (when it might) goes
// into the message.
#include <limits>
#include <string>

#include "core/check.h"
#include "core/validate.h"
#include "transport/transport.h"

namespace epx::detail {
namespace {

using u128 = unsigned __int128;
constexpr u128 kSat = ~u128{0};

u128 mul(u128 a, u128 b) {
  return a != 0 && b > kSat / a ? kSat : a * b;
}
u128 add(u128 a, u128 b) {
  return a > kSat - b ? kSat : a + b;
}
template <typename... T>
u128 mul(u128 a, u128 b, T... rest) {
  return mul(mul(a, b), rest...);
}
u128 u(int64_t v) {
  return static_cast<u128>(v < 0 ? 0 : v);
}

std::string str(u128 v) {
  if (v == 0) return "0";
  std::string s;
  for (; v; v /= 10) s.insert(s.begin(), static_cast<char>('0' + static_cast<int>(v % 10)));
  return s;
}

constexpr u128 kLayoutSafe = u128{1} << 62;  // below this, size_t layout arithmetic is exact

struct Bounds {
  u128 lower = 0;  // <= the bytes of every backend's layout
  u128 upper = 0;  // >= the bytes, and every intermediate sum, of every backend's layout
};

// Across N > 1 nodes, the cpu backend's rail chunks: at most `chunks` chunks of Tm rows of at most
// `row` bytes each, with headers (src/cpu/ht_region.h, src/cpu/ll_region.h, the rail's staging).
u128 rail_bound(int num_nodes, u128 chunks, u128 Tm, u128 row, int R) {
  if (num_nodes <= 1) return 0;
  return mul(mul(num_nodes - 1, chunks), add(mul(Tm, row), add(mul(1024, R + 1), u128{1} << 16)));
}

// ht: dispatch rows and combine rows of R * Tm tokens (cpu src/cpu/ht_region.h ht_region, cuda
// src/cuda/kernels/ht/ht_region.cuh HtRegion::make); across nodes a received dispatch chunk and
// a rail slot per other node (a slot holds a dispatch chunk or a combine partial of 4H + 4K
// bytes a row).
Bounds ht_bounds(const MoeShape& s, int R, int num_nodes) {
  const u128 Tm = u(s.max_tokens_per_rank), H = u(s.hidden), K = u(s.top_k);
  const u128 G = add(H, 127) / 128, E = u(s.num_experts);
  const u128 row = add(add(mul(2, H), mul(4, G)), add(mul(32, K), 128));
  Bounds b;
  b.lower = mul(R, Tm, 2, H);
  b.upper = add(add(mul(R + 1, Tm, row), mul(256, R, add(R, E))), u128{1} << 20);
  b.upper = add(b.upper, rail_bound(num_nodes, 2, Tm, add(row, add(mul(4, H), mul(4, K))), R));
  // cuda across nodes: this node's partial and ids (src/cuda/ht_nodes.cu).
  if (num_nodes > 1) b.upper = add(b.upper, mul(Tm, add(mul(4, H), mul(8, K))));
  return b;
}

// ll: two dispatch slots of R sources' T_max messages and two combine slots of L experts x R *
// T_max rows and their LogFMT meta words (cpu src/cpu/ll_region.h LlLayout, cuda
// src/cuda/kernels/ll/ll_layout.cuh LlLayout::make); across nodes two received dispatch chunks
// (one per slot) and a rail slot per other node (a dispatch chunk, a forward chunk or a partial
// of 4H bytes a row).
Bounds ll_bounds(const MoeShape& s, int R, int num_nodes) {
  const u128 Tm = u(s.max_tokens_per_rank), H = u(s.hidden), K = u(s.top_k);
  const u128 G = add(H, 127) / 128, E = u(s.num_experts);
  const u128 msg = add(add(mul(2, H), mul(4, G)), add(mul(4, K), 64));
  Bounds b;
  b.lower = mul(4, E, Tm, H);
  b.upper = add(add(mul(2 * (R + 1), Tm, msg), add(mul(4, E, Tm, H), mul(8, E, Tm, G))),
                add(mul(64, E), add(mul(1024, R + 1), u128{1} << 20)));
  b.upper = add(b.upper, rail_bound(num_nodes, 3, Tm, add(msg, add(mul(4, H), mul(8, K))), R));
  return b;
}

// a2a: send and receive rows of every payload and the combine rows (cpu src/cpu/a2a.cc
// CpuA2aLayout, cuda src/cuda/kernels/a2a/a2a_layout.cuh A2aLayout::make).
Bounds a2a_bounds(const A2aShape& s, int R) {
  const u128 M = u(s.max_tokens_per_rank);
  u128 D = 0;
  for (size_t v : s.payload_bytes_per_token) D = add(D, v);
  const u128 C = s.combine_bytes_per_token;
  Bounds b;
  b.lower = mul(R, M, add(D, C));
  b.upper = add(mul(R + 1, M, add(add(D, C), 16)), add(mul(512, R + 20), u128{1} << 20));
  return b;
}

// Throws when the shape's bytes exceed kMaxSymmetricBytes. `exact` computes the backend's bytes
// (called only when the layout arithmetic cannot overflow).
template <typename Exact>
void check_bounds(const Bounds& b, Exact exact, const char* op, const std::string& fields,
                  const std::string& what, const std::string& fix) {
  const u128 limit = kMaxSymmetricBytes;
  if (b.upper <= limit) return;
  std::string need;
  if (b.upper < kLayoutSafe) {
    const size_t bytes = exact();
    if (bytes <= kMaxSymmetricBytes) return;
    need = cat(bytes, " bytes");
  } else if (b.lower >= u128{1} << 64) {
    need = "more than 2^64 bytes (the byte count overflows 64 bits)";
  } else {
    need = cat("at least ", str(b.lower > limit ? b.lower : limit + 1), " bytes");
  }
  throw_error(ErrorCode::kOutOfCapacity,
              cat(op, ": ", fields, " need ", need, " of symmetric memory per rank for ", what,
                  ", more than the ", kMaxSymmetricBytes,
                  " bytes (1 TiB) one allocation may take (every rank maps every rank's); "
                  "expected a smaller ",
                  fix));
}

std::string on_ranks(int num_ranks, Backend backend) {
  return cat(" on ", num_ranks, num_ranks == 1 ? " rank (" : " ranks (", backend_name(backend),
             " backend)");
}

}  // namespace

void check_buffer_capacity(const MoeShape& s, int num_ranks, Mode mode, Backend backend,
                           const char* op, int num_nodes) {
  const bool cpu = backend == Backend::kCpu;
  const std::string where = on_ranks(num_ranks, backend);
  if (mode == Mode::kHt) {
    check_bounds(
        ht_bounds(s, num_ranks, num_nodes),
        [&] {
          return cpu ? cpu_ht_bytes(s, num_ranks, num_nodes)
                     : cuda_ht_bytes(s, num_ranks, num_nodes);
        },
        op,
        cat("shape.max_tokens_per_rank = ", s.max_tokens_per_rank, " and shape.hidden = ", s.hidden,
            " (top_k ", s.top_k, ")"),
        cat("ht", where), "shape.max_tokens_per_rank or shape.hidden");
  } else {
    check_bounds(
        ll_bounds(s, num_ranks, num_nodes),
        [&] { return cpu ? cpu_ll_bytes(s, num_ranks, num_nodes) : cuda_ll_bytes(s, num_ranks, num_nodes); },
        op,
        cat("shape.max_tokens_per_rank = ", s.max_tokens_per_rank, ", shape.hidden = ", s.hidden,
            " and shape.num_experts = ", s.num_experts),
        cat("ll", where), "shape.max_tokens_per_rank (T_max), shape.hidden or shape.num_experts");
  }
}

void check_a2a_capacity(const A2aShape& s, int num_ranks, Backend backend, const char* op) {
  const bool cpu = backend == Backend::kCpu;
  std::string payloads;
  for (size_t i = 0; i < s.payload_bytes_per_token.size(); ++i)
    payloads += cat(i ? ", " : "", s.payload_bytes_per_token[i]);
  check_bounds(
      a2a_bounds(s, num_ranks),
      [&] { return cpu ? cpu_a2a_bytes(s, num_ranks) : cuda_a2a_bytes(s, num_ranks); }, op,
      cat("shape.max_tokens_per_rank = ", s.max_tokens_per_rank,
          ", shape.payload_bytes_per_token = [", payloads,
          "] and shape.combine_bytes_per_token = ", s.combine_bytes_per_token),
      cat("a2a", on_ranks(num_ranks, backend)), "shape.max_tokens_per_rank or smaller payloads");
}

}  // namespace epx::detail

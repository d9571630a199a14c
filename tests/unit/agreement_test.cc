// Agreement across ranks (docs/semantics.md §4): geometry and options that differ across ranks
// at construction (Buffer ht / ll, A2a, Dispatcher, Group::agree) and per-call values that must
// agree (ht dispatch / combine, ll dispatch) raise InvalidArgument on EVERY rank, naming the
// field and each rank's value — never wrong rows, a crash or a hang. The group stays usable
// afterwards. cpu backend, threads (R = 2 and 3) and processes (R = 2, 3; the sizes that once
// crashed a rank with SIGBUS).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "core/agree.h"
#include "epx/epx.h"
#include "support/harness.h"

namespace epx {
namespace {

GroupOptions quick() {
  GroupOptions o;
  o.timeout = std::chrono::milliseconds(5000);  // a hang would fail the case, not the suite
  return o;
}

// What each rank of a run saw: its error code and message ("" and -1: no error).
struct Seen {
  int code = -1;
  std::string what;
};

// `needle` in `m`; a needle "has V" also matches "have V" (several ranks with the value V).
bool mentions(const std::string& m, const std::string& needle) {
  if (m.find(needle) != std::string::npos) return true;
  return needle.rfind("has ", 0) == 0 && m.find("have " + needle.substr(4)) != std::string::npos;
}

// Runs body on R thread ranks; every rank must raise `code` with every needle in its message.
void expect_all_ranks(int R, const std::function<void(const Group&)>& body,
                      const std::vector<std::string>& needles, const std::string& label,
                      ErrorCode code = ErrorCode::kInvalidArgument,
                      const std::function<void(const Group&)>& after = nullptr) {
  std::vector<Seen> seen(R);
  testing::run_threads(
      R,
      [&](const Group& g) {
        try {
          body(g);
        } catch (const Error& e) {
          seen[g.rank()] = {static_cast<int>(e.code()), e.what()};
        }
        if (after) after(g);
      },
      quick());
  for (int r = 0; r < R; ++r) {
    EXPECT_EQ(seen[r].code, static_cast<int>(code))
        << label << ": rank " << r << " of " << R << " got '" << seen[r].what << "'";
    for (const std::string& n : needles)
      EXPECT_TRUE(mentions(seen[r].what, n))
          << label << ": rank " << r << " of " << R << ": '" << seen[r].what
          << "' does not mention '" << n << "'";
  }
}

// ---- the message format ----------------------------------------------------------------------

TEST(AgreementFormat, PerRankValues) {
  using detail::per_rank_values;
  EXPECT_EQ(per_rank_values({256, 512}), "rank 0 has 256, rank 1 has 512");
  EXPECT_EQ(per_rank_values({256, 512, 256}), "ranks 0, 2 have 256, rank 1 has 512");
  EXPECT_EQ(per_rank_values({1, 1, 1, 1, 0, 1, 1, 1}), "ranks 0-3, 5-7 have 1, rank 4 has 0");
  EXPECT_EQ(per_rank_values({0, 1, 1}, detail::show_bool), "rank 0 has false, ranks 1, 2 have true");
  EXPECT_EQ(detail::differs_message("Buffer", "shape.hidden", {256, 512}),
            "Buffer: shape.hidden differs across ranks: rank 0 has 256, rank 1 has 512; expected "
            "the same on every rank");
  EXPECT_EQ(detail::show_dtype(static_cast<int64_t>(DType::kF8E4M3)), "fp8_e4m3");
  EXPECT_EQ(detail::show_dtype(-1), "none");
}

// ---- Buffer construction ---------------------------------------------------------------------

struct BufferCase {
  const char* label;
  MoeShape shape;  // rank 0's (and every rank's but the last)
  BufferConfig config;
  void (*edit)(MoeShape&, BufferConfig&);  // applied on the last rank
  std::vector<std::string> needles;        // besides the values
};

BufferConfig ht_only() { return BufferConfig{true, false}; }
BufferConfig ll_only() { return BufferConfig{false, true}; }
BufferConfig both() { return BufferConfig{true, true}; }

std::vector<BufferCase> buffer_cases() {
  const MoeShape s{256, 2, 6, 8};  // E = 6: a multiple of 2 and 3
  return {
      {"ht hidden", s, ht_only(), [](MoeShape& m, BufferConfig&) { m.hidden = 512; },
       {"Buffer: shape.hidden differs across ranks", "has 256", "has 512"}},
      {"ll hidden", s, ll_only(), [](MoeShape& m, BufferConfig&) { m.hidden = 512; },
       {"shape.hidden differs", "has 256", "has 512"}},
      {"ll+ht top_k", s, both(), [](MoeShape& m, BufferConfig&) { m.top_k = 3; },
       {"shape.top_k differs", "has 2", "has 3"}},
      {"ht num_experts", s, ht_only(), [](MoeShape& m, BufferConfig&) { m.num_experts = 12; },
       {"shape.num_experts differs", "has 6", "has 12"}},
      {"ll T_max", s, ll_only(), [](MoeShape& m, BufferConfig&) { m.max_tokens_per_rank = 16; },
       {"shape.max_tokens_per_rank differs", "has 8", "has 16"}},
      {"ht max_tokens", s, ht_only(), [](MoeShape& m, BufferConfig&) { m.max_tokens_per_rank = 4; },
       {"shape.max_tokens_per_rank differs", "has 8", "has 4"}},
      {"enable_ll", s, ht_only(), [](MoeShape&, BufferConfig& c) { c.enable_ll = true; },
       {"config.enable_ll differs", "has false", "has true"}},
      {"enable_ht", s, both(), [](MoeShape&, BufferConfig& c) { c.enable_ht = false; },
       {"config.enable_ht differs", "has true", "has false"}},
      // Invalid on one rank only (hidden not a multiple of 128 with ll): the difference, on every
      // rank, not a local error on one rank and a timeout on the others.
      {"invalid on one rank", s, ll_only(), [](MoeShape& m, BufferConfig&) { m.hidden = 100; },
       {"shape.hidden differs", "has 100"}},
      // Several fields at once: every one named.
      {"two fields", s, both(),
       [](MoeShape& m, BufferConfig&) {
         m.hidden = 128;
         m.num_experts = 12;
       },
       {"shape.hidden differs", "shape.num_experts differs", "expected the same on every rank"}},
  };
}

TEST(AgreementBuffer, ConstructionDiffersRaisesOnEveryRank) {
  for (int R : {2, 3}) {
    for (const BufferCase& c : buffer_cases()) {
      const std::string label = std::string(c.label) + " R=" + std::to_string(R);
      std::vector<std::string> needles = c.needles;
      needles.push_back(R == 2 ? "rank 0 has" : "ranks 0, 1 have");
      needles.push_back("rank " + std::to_string(R - 1) + " has");
      expect_all_ranks(
          R,
          [&](const Group& g) {
            MoeShape s = c.shape;
            BufferConfig cfg = c.config;
            if (g.rank() == R - 1) c.edit(s, cfg);
            Buffer buf(g, s, cfg);
          },
          needles, label, ErrorCode::kInvalidArgument,
          // The group is usable afterwards: the same shape everywhere constructs.
          [&](const Group& g) {
            Buffer ok(g, c.shape, c.config);
            EXPECT_EQ(ok.shape().hidden, c.shape.hidden) << label;
          });
    }
  }
}

// Values equal on every rank but invalid: the same local verdict on every rank (after the
// exchange), not a timeout on some.
TEST(AgreementBuffer, EqualButInvalidRaisesTheSameEverywhere) {
  expect_all_ranks(3, [](const Group& g) { Buffer b(g, MoeShape{100, 2, 6, 8}, ll_only()); },
                   {"shape.hidden is 100", "multiple of 128"}, "hidden 100 with ll");
  expect_all_ranks(2, [](const Group& g) { Buffer b(g, MoeShape{128, 2, 5, 8}); },
                   {"shape.num_experts is 5"}, "E not a multiple of R");
}

// The sizes that crashed the larger rank with SIGBUS (processes map each other's segments):
// hidden 128 vs 65536, ll enabled, R = 2 and 3. Every rank must raise InvalidArgument.
TEST(AgreementBuffer, ProcessesHiddenVastlyDifferent) {
  for (int R : {2, 3}) {
    const int rc = testing::run_processes(
        R,
        [R](const Group& g) {
          MoeShape s{128, 2, 6, 8};
          if (g.rank() == R - 1) s.hidden = 65536;
          try {
            Buffer buf(g, s, both());
            std::fprintf(stderr, "rank %d: no error\n", g.rank());
            return 1;
          } catch (const Error& e) {
            const std::string w = e.what();
            const bool ok = e.code() == ErrorCode::kInvalidArgument &&
                            w.find("shape.hidden differs across ranks") != std::string::npos &&
                            mentions(w, "has 65536") && mentions(w, "has 128");
            if (!ok) std::fprintf(stderr, "rank %d: %s\n", g.rank(), e.what());
            if (!ok) return 2;
          }
          // Still usable: an equal Buffer, and an ll round trip on it.
          Buffer buf(g, MoeShape{128, 2, 6, 8}, both());
          return buf.shape().hidden == 128 ? 0 : 3;
        },
        quick());
    EXPECT_EQ(rc, 0) << "R = " << R;
  }
}

TEST(AgreementBuffer, ProcessesTmaxAndExperts) {
  const int rc = testing::run_processes(
      3,
      [](const Group& g) {
        MoeShape s{256, 2, 6, 8};
        if (g.rank() == 1) s.max_tokens_per_rank = 16;
        if (g.rank() == 2) s.num_experts = 12;
        try {
          Buffer buf(g, s, ll_only());
          return 1;
        } catch (const Error& e) {
          const std::string w = e.what();
          const bool ok =
              e.code() == ErrorCode::kInvalidArgument &&
              w.find("shape.max_tokens_per_rank differs across ranks: ranks 0, 2 have 8, rank 1 "
                     "has 16") != std::string::npos &&
              w.find("shape.num_experts differs across ranks: ranks 0, 1 have 6, rank 2 has 12") !=
                  std::string::npos;
          if (!ok) std::fprintf(stderr, "rank %d: %s\n", g.rank(), e.what());
          return ok ? 0 : 2;
        }
      },
      quick());
  EXPECT_EQ(rc, 0);
}

// Ranks constructing different objects at the same point: named, on every rank.
TEST(AgreementBuffer, DifferentObjectsAtTheSamePoint) {
  expect_all_ranks(
      2,
      [](const Group& g) {
        if (g.rank() == 0) {
          Buffer b(g, MoeShape{128, 2, 4, 8});
        } else {
          A2aShape s;
          s.max_tokens_per_rank = 8;
          s.top_k = 2;
          s.num_experts = 4;
          s.payload_bytes_per_token = {256};
          s.combine_bytes_per_token = 256;
          A2a a(g, s);
        }
      },
      {"different agreements", "rank 0 at Buffer", "rank 1 at A2a"}, "Buffer vs A2a");
}

// ---- A2a construction ------------------------------------------------------------------------

TEST(AgreementA2a, ConstructionDiffersRaisesOnEveryRank) {
  struct Case {
    const char* label;
    void (*edit)(A2aShape&);
    std::vector<std::string> needles;
  };
  const std::vector<Case> cases = {
      {"max_tokens", [](A2aShape& s) { s.max_tokens_per_rank = 16; },
       {"A2a: shape.max_tokens_per_rank differs across ranks", "has 8", "has 16"}},
      {"top_k", [](A2aShape& s) { s.top_k = 3; }, {"shape.top_k differs", "has 2", "has 3"}},
      {"num_experts", [](A2aShape& s) { s.num_experts = 12; }, {"shape.num_experts differs"}},
      {"combine bytes", [](A2aShape& s) { s.combine_bytes_per_token = 128; },
       {"shape.combine_bytes_per_token differs", "has 64", "has 128"}},
      {"payload count", [](A2aShape& s) { s.payload_bytes_per_token.push_back(16); },
       {"the number of payloads", "has 2", "has 3", "payload_bytes_per_token[2] differs"}},
      {"payload bytes", [](A2aShape& s) { s.payload_bytes_per_token[0] = 64; },
       {"shape.payload_bytes_per_token[0] differs", "has 32", "has 64"}},
  };
  for (int R : {2, 3}) {
    for (const Case& c : cases) {
      expect_all_ranks(
          R,
          [&](const Group& g) {
            A2aShape s;
            s.max_tokens_per_rank = 8;
            s.top_k = 2;
            s.num_experts = 6;
            s.payload_bytes_per_token = {32, 8};
            s.combine_bytes_per_token = 64;
            if (g.rank() == R - 1) c.edit(s);
            A2a a(g, s);
          },
          c.needles, std::string(c.label) + " R=" + std::to_string(R));
    }
  }
}

TEST(AgreementA2a, ProcessesMaxTokensVastlyDifferent) {
  const int rc = testing::run_processes(
      2,
      [](const Group& g) {
        A2aShape s;
        s.max_tokens_per_rank = g.rank() == 0 ? 8 : 65536;
        s.top_k = 2;
        s.num_experts = 4;
        s.payload_bytes_per_token = {4096};
        s.combine_bytes_per_token = 4096;
        try {
          A2a a(g, s);
          return 1;
        } catch (const Error& e) {
          const bool ok = e.code() == ErrorCode::kInvalidArgument &&
                          std::string(e.what()).find("rank 1 has 65536") != std::string::npos;
          if (!ok) std::fprintf(stderr, "rank %d: %s\n", g.rank(), e.what());
          return ok ? 0 : 2;
        }
      },
      quick());
  EXPECT_EQ(rc, 0);
}

// ---- Dispatcher construction -----------------------------------------------------------------

TEST(AgreementDispatcher, ConfigDiffersRaisesOnEveryRank) {
  struct Case {
    const char* label;
    void (*edit)(DispatcherConfig&);
    std::vector<std::string> needles;
  };
  const std::vector<Case> cases = {
      {"num_experts", [](DispatcherConfig& c) { c.num_experts = 12; },
       {"Dispatcher: config.num_experts differs across ranks", "has 6", "has 12"}},
      {"hidden", [](DispatcherConfig& c) { c.hidden = 256; },
       {"config.hidden differs", "has 128", "has 256"}},
      {"top_k", [](DispatcherConfig& c) { c.top_k = 3; }, {"config.top_k differs"}},
      {"max_tokens", [](DispatcherConfig& c) { c.max_tokens_per_rank = 64; },
       {"config.max_tokens_per_rank differs", "has 32", "has 64"}},
      {"backend", [](DispatcherConfig& c) { c.backend = DispatcherBackend::kA2a; },
       {"config.backend differs", "has deepep", "has a2a"}},
      {"mode", [](DispatcherConfig& c) { c.mode = DispatchMode::kLowLatency; },
       {"config.mode differs", "has auto", "has low_latency"}},
      {"quant", [](DispatcherConfig& c) { c.quant = DispatchQuant::kFp8; },
       {"config.quant differs", "has bf16", "has fp8"}},
      {"num_worst_tokens", [](DispatcherConfig& c) { c.num_worst_tokens = 64; },
       {"config.num_worst_tokens differs", "has 0", "has 64"}},
      {"return_recv_hook", [](DispatcherConfig& c) { c.return_recv_hook = false; },
       {"config.return_recv_hook differs", "has true", "has false"}},
      {"ht_zero_copy", [](DispatcherConfig& c) { c.ht_zero_copy = true; },
       {"config.ht_zero_copy differs"}},
  };
  for (int R : {2, 3}) {
    for (const Case& c : cases) {
      expect_all_ranks(
          R,
          [&](const Group& g) {
            DispatcherConfig cfg;
            cfg.num_experts = 6;
            cfg.hidden = 128;
            cfg.top_k = 2;
            cfg.max_tokens_per_rank = 32;
            if (g.rank() == R - 1) c.edit(cfg);
            Dispatcher d(g, cfg);
          },
          c.needles, std::string(c.label) + " R=" + std::to_string(R));
    }
  }
}

// ---- Group::agree (what the Python drop-ins use) ---------------------------------------------

TEST(AgreementGroup, AgreeReturnsExtraAndNamesDifferences) {
  testing::run_threads(
      3,
      [](const Group& g) {
        const auto all = g.agree("op", {{"argument 'hidden'", 256}, {"flag", 1, true}},
                                 {g.rank() * 10, 7});
        ASSERT_EQ(all.size(), 3u);
        for (int p = 0; p < 3; ++p) EXPECT_EQ(all[p], (std::vector<int64_t>{p * 10, 7}));
        try {
          g.agree("low_latency_dispatch",
                  {{"argument 'num_max_dispatch_tokens_per_rank'", g.rank() == 1 ? 16 : 8},
                   {"flag", g.rank() == 2, true}});
          ADD_FAILURE() << "rank " << g.rank() << ": no error";
        } catch (const Error& e) {
          EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
          EXPECT_NE(std::string(e.what()).find(
                        "low_latency_dispatch: argument 'num_max_dispatch_tokens_per_rank' "
                        "differs across ranks: ranks 0, 2 have 8, rank 1 has 16; flag differs "
                        "across ranks: ranks 0, 1 have false, rank 2 has true; expected the same "
                        "on every rank"),
                    std::string::npos)
              << e.what();
        }
        // R = 1 and a consistent call afterwards: no error.
        g.agree("op", {{"x", 1}});
      },
      quick());
  Group one = Group::cpu_threads(0, 1, testing::unique_group_name("agree1"));
  EXPECT_EQ(one.agree("op", {{"x", 5}}, {3}), (std::vector<std::vector<int64_t>>{{3}}));
}

// ---- per-call values: ht ---------------------------------------------------------------------

struct HtCall {
  static constexpr int64_t kT = 6, kH = 128;
  std::vector<uint16_t> x = std::vector<uint16_t>(kT * kH, 0x3F80);
  std::vector<uint8_t> x8 = std::vector<uint8_t>(kT * kH, 0x38);
  std::vector<float> scales = std::vector<float>(kT, 1.0f);
  std::vector<int64_t> topk;
  explicit HtCall(int R) {
    for (int64_t t = 0; t < kT; ++t) topk.insert(topk.end(), {t % (2 * R), (t + 1) % (2 * R)});
  }
  HtDispatchArgs args() {
    HtDispatchArgs a;
    a.x = TensorView::contiguous(x.data(), DType::kBF16, {kT, kH});
    a.topk_idx = TensorView::contiguous(topk.data(), DType::kI64, {kT, 2});
    return a;
  }
  void fp8(HtDispatchArgs& a) {
    a.x = TensorView::contiguous(x8.data(), DType::kF8E4M3, {kT, kH});
    a.x_scales = TensorView::contiguous(scales.data(), DType::kF32, {kT, 1});
  }
};

TEST(AgreementHt, PerCallValuesDifferRaiseOnEveryRank) {
  struct Case {
    const char* label;
    void (*edit)(HtCall&, HtDispatchArgs&);
    std::vector<std::string> needles;
  };
  const std::vector<Case> cases = {
      {"fp8 vs bf16", [](HtCall& c, HtDispatchArgs& a) { c.fp8(a); },
       {"the dtype of argument 'x' differs across ranks", "has bf16", "has fp8_e4m3",
        "the dtype of argument 'x_scales' differs", "has none", "has f32"}},
      {"num_worst_tokens", [](HtCall&, HtDispatchArgs& a) { a.num_worst_tokens = 32; },
       {"argument 'num_worst_tokens' differs across ranks", "has 0", "has 32"}},
      {"worst sizes", [](HtCall&, HtDispatchArgs& a) { a.num_worst_tokens = 48; },
       {"argument 'num_worst_tokens' differs", "has 32", "has 48"}},
      {"expert_alignment", [](HtCall&, HtDispatchArgs& a) { a.expert_alignment = 4; },
       {"argument 'expert_alignment' differs across ranks", "has 1", "has 4"}},
      {"zero_copy", [](HtCall&, HtDispatchArgs& a) { a.zero_copy = true; },
       {"argument 'zero_copy' differs across ranks", "has false", "has true"}},
  };
  for (int R : {2, 3}) {
    for (const Case& c : cases) {
      const std::string label = std::string(c.label) + " R=" + std::to_string(R);
      std::vector<std::string> seen(R);
      testing::run_threads(
          R,
          [&](const Group& g) {
            Buffer buf(g, MoeShape{128, 2, 2 * R, 8});
            HtCall call(R);
            HtDispatchArgs a = call.args();
            if (std::string(c.label) == "worst sizes") a.num_worst_tokens = 32;
            if (g.rank() == R - 1) c.edit(call, a);
            try {
              buf.ht_dispatch(a);
            } catch (const Error& e) {
              if (e.code() == ErrorCode::kInvalidArgument) seen[g.rank()] = e.what();
            }
            // Usable afterwards: a consistent round trip.
            HtDispatchResult d = buf.ht_dispatch(call.args());
            HtCombineArgs ca;
            ca.y = d.recv_x;
            ca.handle = &d.handle;
            EXPECT_EQ(buf.ht_combine(ca).out.shape[0], HtCall::kT) << label;
          },
          quick());
      for (int r = 0; r < R; ++r)
        for (const std::string& n : c.needles)
          EXPECT_TRUE(mentions(seen[r], n))
              << label << ": rank " << r << ": '" << seen[r] << "' does not mention '" << n << "'";
    }
  }
}

TEST(AgreementHt, CachedAndCombineValuesDiffer) {
  for (int R : {2, 3}) {
    std::vector<std::string> cached(R), combine(R);
    testing::run_threads(
        R,
        [&](const Group& g) {
          Buffer buf(g, MoeShape{128, 2, 2 * R, 8});
          HtCall call(R);
          HtDispatchResult d = buf.ht_dispatch(call.args());
          HtDispatchArgs c;  // cached: fp8 on the last rank only
          c.x = call.args().x;
          c.handle = &d.handle;
          if (g.rank() == R - 1) call.fp8(c);
          try {
            buf.ht_dispatch(c);
          } catch (const Error& e) {
            cached[g.rank()] = e.what();
          }
          HtCombineArgs ca;  // zero_copy on rank 0 only (its y in place)
          ca.handle = &d.handle;
          if (g.rank() == 0) {
            TensorView place = buf.ht_combine_buffer(d.handle);
            std::memcpy(place.data, d.recv_x.data, d.recv_x.nbytes());
            ca.y = place;
            ca.zero_copy = true;
          } else {
            ca.y = d.recv_x;
          }
          try {
            buf.ht_combine(ca);
          } catch (const Error& e) {
            combine[g.rank()] = e.what();
          }
          ca.zero_copy = false;
          ca.y = d.recv_x;
          EXPECT_EQ(buf.ht_combine(ca).out.shape[0], HtCall::kT);
        },
        quick());
    for (int r = 0; r < R; ++r) {
      EXPECT_NE(cached[r].find("ht_dispatch (cached): the dtype of argument 'x' differs across "
                               "ranks"),
                std::string::npos)
          << "R=" << R << " rank " << r << ": " << cached[r];
      EXPECT_NE(combine[r].find("ht_combine: argument 'zero_copy' differs across ranks: rank 0 "
                                "has true"),
                std::string::npos)
          << "R=" << R << " rank " << r << ": " << combine[r];
    }
  }
}

// ---- per-call values: ll ---------------------------------------------------------------------

TEST(AgreementLl, QuantisationOptionsDiffer) {
  for (int R : {2, 3}) {
    std::vector<std::string> seen(R);
    testing::run_threads(
        R,
        [&](const Group& g) {
          Buffer buf(g, MoeShape{128, 2, 2 * R, 8}, ll_only());
          std::vector<uint16_t> x(4 * 128, 0x3F80);
          std::vector<int64_t> topk(4 * 2, 0);
          LlDispatchArgs a;
          a.x = TensorView::contiguous(x.data(), DType::kBF16, {4, 128});
          a.topk_idx = TensorView::contiguous(topk.data(), DType::kI64, {4, 2});
          a.use_fp8 = true;
          a.round_scale = g.rank() == R - 1;
          try {
            buf.ll_dispatch(a);
          } catch (const Error& e) {
            seen[g.rank()] = e.what();
          }
          buf.ll_clean();
          a.round_scale = false;
          EXPECT_EQ(buf.ll_dispatch(a).recv_count.shape[0], 2);
        },
        quick());
    const std::string want =
        R == 2 ? "ll_dispatch: argument 'round_scale' differs across ranks: rank 0 has false, "
                 "rank 1 has true; expected the same on every rank"
               : "ll_dispatch: argument 'round_scale' differs across ranks: ranks 0, 1 have "
                 "false, rank 2 has true; expected the same on every rank";
    for (int r = 0; r < R; ++r)
      EXPECT_NE(seen[r].find(want), std::string::npos) << "rank " << r << ": " << seen[r];
  }
}

}  // namespace
}  // namespace epx

// Agreement across ranks (core/agree.h). Words of one rank's allgather contribution:
//   [0, kTagWords)   the op's name, 8 characters a word (its first 8 * kTagWords characters)
//   kTagWords        number of fields F
//   next             number of extra values X
//   next F           the fields' values, then the X extra values
#include "core/agree.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "core/check.h"
#include "transport/transport.h"

namespace epx::detail {

namespace {

constexpr int kTagWords = 4;  // 32 characters of the op name

std::vector<int64_t> encode_tag(const std::string& op) {
  std::vector<int64_t> w(kTagWords, 0);
  const size_t n = std::min(op.size(), sizeof(int64_t) * kTagWords);
  std::memcpy(w.data(), op.data(), n);
  return w;
}

std::string decode_tag(const std::vector<int64_t>& words) {
  char s[sizeof(int64_t) * kTagWords + 1] = {};
  const size_t n = std::min<size_t>(words.size(), kTagWords);
  std::memcpy(s, words.data(), n * sizeof(int64_t));
  return std::string(s, strnlen(s, sizeof(s) - 1));
}

// "0, 2-5, 7" of the ranks in `ranks` (ascending).
std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    s += cat(i ? ", " : "", ranks[i]);
    if (j >= i + 2) {
      s += cat("-", ranks[j]);
    } else if (j == i + 1) {
      s += cat(", ", ranks[j]);
    }
    i = j + 1;
  }
  return s;
}

}  // namespace

std::string show_int(int64_t v) { return std::to_string(v); }
std::string show_bool(int64_t v) { return v ? "true" : "false"; }
std::string show_f32_bits(int64_t v) {
  const uint32_t bits = static_cast<uint32_t>(v);
  float f;
  std::memcpy(&f, &bits, 4);
  char text[32];
  std::snprintf(text, sizeof(text), "%.9g", static_cast<double>(f));
  return text;
}
std::string show_dtype(int64_t v) {
  if (v < 0 || v > static_cast<int64_t>(DType::kBool)) return v == -1 ? "none" : cat("dtype #", v);
  return dtype_name(static_cast<DType>(v));
}

bool all_equal(const std::vector<int64_t>& values) {
  return std::all_of(values.begin(), values.end(),
                     [&](int64_t v) { return v == values.front(); });
}

std::string per_rank_values(const std::vector<int64_t>& values, ShowValue show) {
  std::vector<int64_t> distinct;
  for (int64_t v : values)
    if (std::find(distinct.begin(), distinct.end(), v) == distinct.end()) distinct.push_back(v);
  std::string s;
  for (int64_t v : distinct) {
    std::vector<int> ranks;
    for (size_t p = 0; p < values.size(); ++p)
      if (values[p] == v) ranks.push_back(static_cast<int>(p));
    s += cat(s.empty() ? "" : ", ", ranks.size() == 1 ? "rank " : "ranks ", rank_list(ranks),
             ranks.size() == 1 ? " has " : " have ", show(v));
  }
  return s;
}

std::string differs_message(const std::string& op, const std::string& what,
                            const std::vector<int64_t>& values, ShowValue show) {
  return cat(op, ": ", what, " differs across ranks: ", per_rank_values(values, show),
             "; expected the same on every rank");
}

std::vector<std::vector<int64_t>> agree(const Group& group, const std::string& op,
                                        const std::vector<AgreeField>& fields,
                                        const std::vector<int64_t>& extra) {
  const int R = group.size();
  EPX_CHECK(fields.size() + extra.size() <= static_cast<size_t>(kMaxAgreeValues),
            ErrorCode::kInternal, op, ": agreement of ", fields.size() + extra.size(),
            " values, at most ", kMaxAgreeValues);
  if (R == 1) return {extra};
  std::vector<int64_t> mine = encode_tag(op);
  mine.push_back(static_cast<int64_t>(fields.size()));
  mine.push_back(static_cast<int64_t>(extra.size()));
  for (const AgreeField& f : fields) mine.push_back(f.value);
  mine.insert(mine.end(), extra.begin(), extra.end());
  const std::string what = cat(op, " (agreement across ranks)");
  const std::vector<std::vector<int64_t>> all = group.transport()->allgather(what.c_str(), mine);

  // Another op, or another number of values (another object at the same point): name it.
  auto header = [&](const std::vector<int64_t>& w) {
    return std::vector<int64_t>(w.begin(), w.begin() + std::min<size_t>(w.size(), kTagWords + 2));
  };
  for (int p = 1; p < R; ++p) {
    if (header(all[p]) == header(all[0])) continue;
    auto at = [&](int q) {
      const std::vector<int64_t> h = header(all[q]);
      return cat(decode_tag(h), h.size() == kTagWords + 2
                                    ? cat(" (", h[kTagWords], " + ", h[kTagWords + 1], " values)")
                                    : std::string());
    };
    throw_error(ErrorCode::kInvalidArgument,
                cat(op, ": the ranks are at different agreements: rank 0 at ", at(0), ", rank ", p,
                    " at ", at(p),
                    "; every rank must create the same epx objects in the same order"));
  }
  std::string message;
  for (size_t f = 0; f < fields.size(); ++f) {
    std::vector<int64_t> values(R);
    for (int p = 0; p < R; ++p) values[p] = all[p][kTagWords + 2 + f];
    if (all_equal(values)) continue;
    message += cat(message.empty() ? "" : "; ", fields[f].name, " differs across ranks: ",
                   per_rank_values(values, fields[f].show ? fields[f].show : show_int));
  }
  if (!message.empty())
    throw_error(ErrorCode::kInvalidArgument,
                cat(op, ": ", message, "; expected the same on every rank"));
  std::vector<std::vector<int64_t>> out(R);
  for (int p = 0; p < R; ++p)
    out[p].assign(all[p].begin() + kTagWords + 2 + fields.size(), all[p].end());
  return out;
}

}  // namespace epx::detail

// Public headers: no CUDA, NCCL or torch header may leak into include/epx/ (STYLE: framework
// headers never enter the public API), and epx/epx.h includes every public header. That each
// header compiles on its own is checked at build time by tests/headers/CMakeLists.txt.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;

fs::path source_dir() {
#ifdef EPX_SOURCE_DIR
  return fs::path(EPX_SOURCE_DIR);
#else
  return fs::path(__FILE__).parent_path().parent_path().parent_path();  // tests/unit/x.cc
#endif
}

std::vector<fs::path> public_headers() {
  std::vector<fs::path> out;
  const fs::path dir = source_dir() / "include" / "epx";
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file() && (e.path().extension() == ".h" || e.path().extension() == ".hpp"))
      out.push_back(e.path());
  std::sort(out.begin(), out.end());
  return out;
}

// The targets of the #include lines of `text`.
std::vector<std::string> includes_of(const std::string& text) {
  static const std::regex re(R"(^\s*#\s*include\s*[<"]([^>"]+)[>"])");
  std::vector<std::string> out;
  std::istringstream in(text);
  std::string line;
  std::smatch m;
  while (std::getline(in, line))
    if (std::regex_search(line, m, re)) out.push_back(m[1]);
  return out;
}

// Why `target` is a forbidden include, or "" if it is allowed.
std::string forbidden(const std::string& target) {
  std::string t = target;
  std::transform(t.begin(), t.end(), t.begin(), [](unsigned char c) { return std::tolower(c); });
  const std::string base =
      t.substr(t.find_last_of('/') == std::string::npos ? 0 : t.find_last_of('/') + 1);
  static const std::vector<std::string> prefixes = {
      "cuda",   "cub/",  "thrust/", "cute/",     "cutlass/",  "nccl", "nvshmem",
      "torch/", "aten/", "c10/",    "pybind11/", "nanobind/", "crt/"};
  for (const std::string& p : prefixes)
    if (t.rfind(p, 0) == 0) return "starts with '" + p + "'";
  for (const std::string& b : {std::string("cuda"), std::string("nccl"), std::string("torch")})
    if (base.rfind(b, 0) == 0) return "file name starts with '" + b + "'";
  if (base == "cuda_runtime.h" || base == "cuda_bf16.h" || base == "cuda_fp8.h")
    return "CUDA header";
  return "";
}

std::string read(const fs::path& p) {
  std::ifstream f(p);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

TEST(Headers, DetectorFlagsFrameworkIncludes) {
  // The check below is only meaningful if the detector works.
  const auto inc = includes_of(
      "#include <cuda_runtime.h>\n  #  include \"nccl.h\"\n#include <torch/extension.h>\n"
      "#include <ATen/ATen.h>\n#include <nccl_device/core.h>\n#include <cuda/atomic>\n"
      "#include <vector>\n#include \"epx/tensor.h\"\n// #include <cuda.h> is a comment\n");
  ASSERT_EQ(inc.size(), 8u);
  for (size_t i = 0; i < 6; ++i) EXPECT_NE(forbidden(inc[i]), "") << inc[i];
  EXPECT_EQ(forbidden("vector"), "");
  EXPECT_EQ(forbidden("epx/tensor.h"), "");
  EXPECT_EQ(forbidden("cstdint"), "");
}

TEST(Headers, NoCudaNcclOrTorchInPublicHeaders) {
  const auto headers = public_headers();
  ASSERT_GE(headers.size(), 9u) << "expected the public headers under "
                                << (source_dir() / "include" / "epx");
  for (const fs::path& h : headers) {
    for (const std::string& target : includes_of(read(h))) {
      const std::string why = forbidden(target);
      EXPECT_EQ(why, "") << h.filename() << " includes <" << target << "> (" << why
                         << "): public headers must not include CUDA, NCCL or torch headers";
    }
  }
}

TEST(Headers, UmbrellaIncludesEveryPublicHeader) {
  const fs::path dir = source_dir() / "include" / "epx";
  const auto inc = includes_of(read(dir / "epx.h"));
  for (const auto& e : fs::directory_iterator(dir)) {
    if (!e.is_regular_file() || e.path().extension() != ".h" || e.path().filename() == "epx.h")
      continue;
    const std::string name = "epx/" + e.path().filename().string();
    EXPECT_NE(std::find(inc.begin(), inc.end(), name), inc.end())
        << "epx/epx.h does not include " << name;
  }
}

}  // namespace

// CPU tier: the source tree's layers. Each folder is a layer and includes point only downward:
// tools -> engine -> {model, comm} -> kernels (model and comm know nothing of each other). No
// two units (a header and its source) include each other, directly or through others.
#include <doctest/doctest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace {
namespace fs = std::filesystem;

// Each layer and the layers its files may include (its own among them).
const std::map<std::string, std::set<std::string>> kMayInclude = {
    {"kernels", {"kernels"}},
    {"model", {"model", "kernels"}},
    {"comm", {"comm", "kernels"}},
    {"engine", {"engine", "model", "comm", "kernels"}},
    {"tools", {"tools", "engine", "model", "comm", "kernels"}},
};

bool is_source(const fs::path& p) {
  const std::string e = p.extension().string();
  return e == ".h" || e == ".cuh" || e == ".cpp" || e == ".cu";
}

// The quoted includes of a file, as written.
std::vector<std::string> quoted_includes(const fs::path& file) {
  std::vector<std::string> out;
  std::ifstream in(file);
  for (std::string line; std::getline(in, line);) {
    const size_t at = line.find_first_not_of(" \t");
    if (at == std::string::npos || line.compare(at, 8, "#include") != 0) continue;
    const size_t open = line.find('"', at), close = open == std::string::npos ? open : line.find('"', open + 1);
    if (close != std::string::npos) out.push_back(line.substr(open + 1, close - open - 1));
  }
  return out;
}

struct Tree {
  std::map<std::string, std::vector<std::string>> includes;  // file (relative to the root) -> its quoted includes
};

Tree read_tree(const fs::path& root) {
  Tree t;
  for (const auto& layer : kMayInclude)
    for (const auto& e : fs::recursive_directory_iterator(root / layer.first))
      if (e.is_regular_file() && is_source(e.path()))
        t.includes[fs::relative(e.path(), root).generic_string()] = quoted_includes(e.path());
  return t;
}

std::string layer_of(const std::string& path) { return path.substr(0, path.find('/')); }
// A header and its source are one unit: kernels/gemm.h and kernels/gemm.cpp are kernels/gemm.
std::string unit_of(const std::string& path) { return path.substr(0, path.rfind('.')); }

// Includes that name no folder of the tree, point up a layer or sideways between model and comm.
std::vector<std::string> layering_violations(const Tree& t) {
  std::vector<std::string> out;
  for (const auto& [file, includes] : t.includes)
    for (const std::string& inc : includes) {
      const std::string from = layer_of(file), to = layer_of(inc);
      if (inc.find('/') == std::string::npos || t.includes.count(inc) == 0)
        out.push_back(file + " includes \"" + inc + "\": not a file of kernels/, model/, comm/, engine/ or tools/ named from the root");
      else if (kMayInclude.at(from).count(to) == 0)
        out.push_back(file + " (" + from + ") includes " + inc + " (" + to + "): " + from + " may include only " +
                      [&] {
                        std::string s;
                        for (const std::string& l : kMayInclude.at(from)) s += (s.empty() ? "" : ", ") + l;
                        return s;
                      }());
    }
  return out;
}

// Every cycle between units, as "a -> b -> ... -> a" (one per strongly connected group found).
std::vector<std::string> unit_cycles(const Tree& t) {
  std::map<std::string, std::set<std::string>> edges;
  for (const auto& [file, includes] : t.includes)
    for (const std::string& inc : includes)
      if (unit_of(inc) != unit_of(file)) edges[unit_of(file)].insert(unit_of(inc));
  std::map<std::string, int> state;  // 0 unseen, 1 on the path, 2 done
  std::vector<std::string> path, cycles;
  std::function<void(const std::string&)> visit = [&](const std::string& u) {
    state[u] = 1;
    path.push_back(u);
    for (const std::string& v : edges[u]) {
      if (state[v] == 1) {
        std::string c;
        for (auto it = std::find(path.begin(), path.end(), v); it != path.end(); ++it) c += *it + " -> ";
        cycles.push_back(c + v);
      } else if (state[v] == 0) {
        visit(v);
      }
    }
    path.pop_back();
    state[u] = 2;
  };
  for (const auto& [u, _] : edges)
    if (state[u] == 0) visit(u);
  return cycles;
}
}  // namespace

TEST_CASE("layers: includes point down the layers, and no two units include each other") {
  const fs::path root = fs::current_path();
  REQUIRE_MESSAGE(fs::is_directory(root / "kernels"), "run the tests from the repository's root");
  const Tree tree = read_tree(root);
  REQUIRE(tree.includes.size() > 50);
  for (const std::string& v : layering_violations(tree)) FAIL_CHECK(v);
  for (const std::string& c : unit_cycles(tree)) FAIL_CHECK((std::string("units include each other: ") + c));
}

TEST_CASE("layers: the checks find an upward include, a sideways one and a cycle") {
  Tree t;
  t.includes["kernels/a.h"] = {};
  t.includes["kernels/a.cu"] = {"kernels/a.h"};
  t.includes["model/m.h"] = {"kernels/a.h"};
  t.includes["comm/c.h"] = {"kernels/a.h"};
  t.includes["engine/e.h"] = {"model/m.h", "comm/c.h"};
  CHECK(layering_violations(t).empty());
  CHECK(unit_cycles(t).empty());
  t.includes["kernels/a.cu"].push_back("engine/e.h");  // upward
  t.includes["model/m.h"].push_back("comm/c.h");       // sideways
  t.includes["engine/e.h"].push_back("e.h");           // no folder
  const std::vector<std::string> v = layering_violations(t);
  REQUIRE(v.size() == 3);
  CHECK(v[0].find("comm") != std::string::npos);  // (sorted by file) engine/e.h's, kernels/a.cu's, model/m.h's
  CHECK(v[1].find("kernels/a.cu (kernels) includes engine/e.h (engine)") != std::string::npos);
  CHECK(v[2].find("model/m.h (model) includes comm/c.h (comm)") != std::string::npos);
  // kernels/a -> engine/e -> model/m -> kernels/a
  const std::vector<std::string> c = unit_cycles(t);
  REQUIRE(c.size() >= 1);
  CHECK(c[0].find("kernels/a") != std::string::npos);
}

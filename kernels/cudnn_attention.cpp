#include "kernels/cudnn_attention.h"

#include "kernels/check.h"

#if __has_include(<cudnn_graph.h>) && !defined(VIT_WITHOUT_CUDNN)
#include <cudnn_graph.h>
#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <limits>
#include <mutex>
#include <type_traits>
#include <vector>

namespace {

// The cuDNN entry points this file calls (member, cuDNN's name), resolved from libcudnn.so.9 at
// run time, typed by the header's own declarations (a mismatch does not compile); listed once.
#define CUDNN_ENTRY_POINTS(X)                          \
  X(get_version, cudnnGetVersion)                      \
  X(error_string, cudnnGetErrorString)                 \
  X(last_error, cudnnGetLastErrorString)               \
  X(create, cudnnCreate)                               \
  X(destroy, cudnnDestroy)                             \
  X(set_stream, cudnnSetStream)                        \
  X(create_descriptor, cudnnBackendCreateDescriptor)   \
  X(destroy_descriptor, cudnnBackendDestroyDescriptor) \
  X(set_attribute, cudnnBackendSetAttribute)           \
  X(get_attribute, cudnnBackendGetAttribute)           \
  X(finalize, cudnnBackendFinalize)                    \
  X(execute, cudnnBackendExecute)
struct CudnnApi {
#define CUDNN_MEMBER(member, name) decltype(&name) member = nullptr;
  CUDNN_ENTRY_POINTS(CUDNN_MEMBER)
#undef CUDNN_MEMBER
  std::string unavailable;  // why cuDNN's fused attention cannot run here; empty where it can
};

std::string lib_path(void* lib) {  // where the loaded library lives, for messages
  char path[4096] = "";
  return dlinfo(lib, RTLD_DI_ORIGIN, path) == 0 ? std::string(path) + "/libcudnn.so.9" : "libcudnn.so.9";
}

const CudnnApi& api() {
  static CudnnApi a;
  static std::once_flag once;
  std::call_once(once, [] {
    void* lib = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_LOCAL);  // kept for the process's life
    if (!lib) {
      const char* e = dlerror();
      a.unavailable = std::string("cuDNN 9 is not found (") + (e ? e : "dlopen failed") +
                      "); install it or put the directory holding libcudnn.so.9 on LD_LIBRARY_PATH";
      return;
    }
    bool missing = false;
    const auto resolve = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      if (!fn && !missing) a.unavailable = std::string("libcudnn.so.9 lacks ") + name, missing = true;
    };
#define CUDNN_RESOLVE(member, name) resolve(a.member, #name);
    CUDNN_ENTRY_POINTS(CUDNN_RESOLVE)
#undef CUDNN_RESOLVE
#undef CUDNN_ENTRY_POINTS
    if (missing) return;
    // The fused forward is one operation (CUDNN_BACKEND_OPERATION_SDPA_FWD_DESCRIPTOR), which
    // older libraries do not know (9.14 and 9.19, the versions this ran on, have it).
    cudnnBackendDescriptor_t probe = nullptr;
    if (a.create_descriptor(CUDNN_BACKEND_OPERATION_SDPA_FWD_DESCRIPTOR, &probe) != CUDNN_STATUS_SUCCESS) {
      const size_t v = a.get_version();
      a.unavailable = "cuDNN " + std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + " (" + lib_path(lib) +
                      ") has no fused SDPA forward operation; a newer cuDNN 9 is needed (9.14 has it)";
    } else {
      a.destroy_descriptor(probe);
    }
  });
  return a;
}

[[noreturn]] void throw_cudnn_error(cudnnStatus_t s, const char* call, int line) {
  char detail[512] = "";
  api().last_error(detail, sizeof detail);
  throw RuntimeError(std::string("cuDNN error ") + api().error_string(s) + " in " + call + " at " __FILE__ ":" +
                     std::to_string(line) + (detail[0] ? std::string(": ") + detail : std::string()));
}
#define CUDNN_CHECK(call)                                                   \
  do {                                                                      \
    const cudnnStatus_t s_ = (call);                                        \
    if (s_ != CUDNN_STATUS_SUCCESS) throw_cudnn_error(s_, #call, __LINE__); \
  } while (0)

// The user tensors' unique ids (the variant pack binds pointers to them); virtual tensors take
// ids from kFirstVirtual on.
enum Uid : int64_t {
  kQ = 1, kK, kV, kO, kStats, kScale, kOne, kDO, kDQ, kDK, kDV, kRowDot, kSeqLenQ, kSeqLenKV, kMaskFill, kDqSum,
  kFirstVirtual
};

struct MatmulLengths {  // a product's m, n and k, per image ([B] int32 tensors; null: the tensors' own)
  cudnnBackendDescriptor_t m = nullptr, n = nullptr, k = nullptr;
};

}  // namespace

// One finalized execution plan, every descriptor built for it (destroyed with it, last first),
// and the device buffers its graph reads or writes beside the caller's tensors.
struct CudnnAttention::Plan {
  std::vector<cudnnBackendDescriptor_t> owned;
  cudnnBackendDescriptor_t plan = nullptr;
  int64_t workspace = 0, next_uid = kFirstVirtual;
  bool deterministic = true;
  // by-value scalars (their host addresses go in the variant pack); mask_fill: a masked score,
  // whose exponential is 0 (the frontend's choice before cuDNN 9.10, and right for every version)
  float scale = 0, one = 1, mask_fill = std::numeric_limits<float>::lowest();
  float* row_dot = nullptr;    // backward: rowsum(dO * O), [B, H, T]
  int32_t* seq_len = nullptr;  // backward: every image's length, T, as the padding mask's [B] query and key lengths
  float* dq_sum = nullptr;     // backward, the accumulating graph: dQ in fp32, [B, H, T, hd]
  size_t buffer_bytes = 0;     // of the three

  ~Plan() {
    for (auto d = owned.rbegin(); d != owned.rend(); ++d) api().destroy_descriptor(*d);
    cudaFree(row_dot);
    cudaFree(seq_len);
    cudaFree(dq_sum);
  }
  cudnnBackendDescriptor_t make(cudnnBackendDescriptorType_t type) {
    cudnnBackendDescriptor_t d = nullptr;
    CUDNN_CHECK(api().create_descriptor(type, &d));
    owned.push_back(d);
    return d;
  }
  static void set(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type,
                  int64_t count, const void* values) {
    CUDNN_CHECK(api().set_attribute(d, name, type, count, values));
  }
  static void link(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name, cudnnBackendDescriptor_t value) {
    set(d, name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &value);
  }
  // A descriptor of type with these descriptors linked to it (null ones left unset), not yet
  // finalized.
  using Links = std::initializer_list<std::pair<cudnnBackendAttributeName_t, cudnnBackendDescriptor_t>>;
  cudnnBackendDescriptor_t linked(cudnnBackendDescriptorType_t type, Links links) {
    const cudnnBackendDescriptor_t d = make(type);
    for (const auto& [name, value] : links)
      if (value) link(d, name, value);
    return d;
  }
  // A 4-dim tensor: a user one (uid), or with uid 0 a virtual one (an intermediate of the graph).
  cudnnBackendDescriptor_t tensor(int64_t uid, cudnnDataType_t type, const std::array<int64_t, 4>& dims,
                                  const std::array<int64_t, 4>& strides) {
    const cudnnBackendDescriptor_t d = make(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    const bool is_virtual = uid == 0, by_value = uid == kScale || uid == kOne || uid == kMaskFill;
    const int64_t id = is_virtual ? next_uid++ : uid, alignment = 16;
    set(d, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &id);
    set(d, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type);
    set(d, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims.data());
    set(d, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides.data());
    set(d, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment);
    set(d, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &is_virtual);
    set(d, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value);
    CUDNN_CHECK(api().finalize(d));
    return d;
  }
  cudnnBackendDescriptor_t scalar(Uid uid) { return tensor(uid, CUDNN_DATA_FLOAT, {1, 1, 1, 1}, {1, 1, 1, 1}); }
  cudnnBackendDescriptor_t finalized(cudnnBackendDescriptor_t d) {
    CUDNN_CHECK(api().finalize(d));
    return d;
  }
  // y = mode(x), mode(x, b) or, with t, mode(x, b, t), computed in precision (fp32 unless said);
  // axis: GEN_INDEX's.
  cudnnBackendDescriptor_t pointwise(cudnnPointwiseMode_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t b,
                                     cudnnBackendDescriptor_t y, cudnnDataType_t precision = CUDNN_DATA_FLOAT,
                                     cudnnBackendDescriptor_t t = nullptr, int64_t axis = -1) {
    const cudnnBackendDescriptor_t desc = make(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    set(desc, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode);
    set(desc, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &precision);
    if (axis >= 0) set(desc, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis);
    finalized(desc);
    const cudnnBackendDescriptor_t op = linked(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR,
                                               {{CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, desc},
                                                {CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x},
                                                {CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b},
                                                {CUDNN_ATTR_OPERATION_POINTWISE_TDESC, t},
                                                {CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y}});
    if (precision == CUDNN_DATA_FLOAT) {
      const float alpha = 1.0f;
      set(op, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, 1, &alpha);
      set(op, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT, 1, &alpha);
    }
    return finalized(op);
  }
  // c = a b (batched over the first two dims), fp32 accumulation; lengths: the per-image lengths
  // that override the product's dims m, n, k (the padding mask's), where given.
  cudnnBackendDescriptor_t matmul(cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t c,
                                  MatmulLengths lengths = {}) {
    const cudnnBackendDescriptor_t desc = make(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
    const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
    const double padding = 0.0;
    set(desc, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &f32);
    set(desc, CUDNN_ATTR_MATMUL_PADDING_VALUE, CUDNN_TYPE_DOUBLE, 1, &padding);
    finalized(desc);
    return finalized(linked(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR,
                            {{CUDNN_ATTR_OPERATION_MATMUL_ADESC, a},
                             {CUDNN_ATTR_OPERATION_MATMUL_BDESC, b},
                             {CUDNN_ATTR_OPERATION_MATMUL_CDESC, c},
                             {CUDNN_ATTR_OPERATION_MATMUL_DESC, desc},
                             {CUDNN_ATTR_OPERATION_MATMUL_GEMM_M_OVERRIDE_DESC, lengths.m},
                             {CUDNN_ATTR_OPERATION_MATMUL_GEMM_N_OVERRIDE_DESC, lengths.n},
                             {CUDNN_ATTR_OPERATION_MATMUL_GEMM_K_OVERRIDE_DESC, lengths.k}}));
  }
  // y = the sum of x over its last dim.
  cudnnBackendDescriptor_t row_sum(cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    const cudnnBackendDescriptor_t desc = make(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
    const cudnnReduceTensorOp_t add = CUDNN_REDUCE_TENSOR_ADD;
    const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
    const bool deterministic = false;  // a row sum of T values
    set(desc, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &add);
    set(desc, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &f32);
    set(desc, CUDNN_ATTR_REDUCTION_IS_DETERMINISTIC, CUDNN_TYPE_BOOLEAN, 1, &deterministic);
    finalized(desc);
    return finalized(linked(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR,
                            {{CUDNN_ATTR_OPERATION_REDUCTION_DESC, desc},
                             {CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x},
                             {CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y}}));
  }
  // y = x seen through y's dims and strides (a transpose, given swapped strides).
  cudnnBackendDescriptor_t reshape(cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    return finalized(linked(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR,
                            {{CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x}, {CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y}}));
  }
  // The graph of ops, and the first execution plan cuDNN's heuristics (mode A) offer that
  // finalizes; false, with the reasons in why, where none does.
  bool build(void* handle_ptr, const std::vector<cudnnBackendDescriptor_t>& ops, std::string* why) {
    cudnnHandle_t handle = static_cast<cudnnHandle_t>(handle_ptr);
    const cudnnBackendDescriptor_t graph = make(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
    set(graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, int64_t(ops.size()), ops.data());
    set(graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
    finalized(graph);
    const cudnnBackendDescriptor_t heuristics = make(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
    const cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
    link(heuristics, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph);
    set(heuristics, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode);
    finalized(heuristics);
    int64_t count = 0;
    CUDNN_CHECK(api().get_attribute(heuristics, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count,
                                    nullptr));
    std::vector<cudnnBackendDescriptor_t> configs(size_t(std::max<int64_t>(count, 0)));
    for (auto& c : configs) c = make(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR);
    if (count > 0)
      CUDNN_CHECK(api().get_attribute(heuristics, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, count,
                                      &count, configs.data()));
    std::string failures;
    for (int64_t i = 0; i < count && !plan; ++i) {
      const cudnnBackendDescriptor_t candidate = make(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
      link(candidate, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, configs[size_t(i)]);
      set(candidate, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
      const cudnnStatus_t s = api().finalize(candidate);
      if (s == CUDNN_STATUS_SUCCESS) {
        plan = candidate;
        deterministic = deterministic && !nondeterministic_note(configs[size_t(i)]);
      } else if (failures.size() < 300) {
        failures += std::string(failures.empty() ? "" : "; ") + api().error_string(s);
      }
    }
    if (!plan) {
      *why = std::to_string(count) + " engine configurations" + (failures.empty() ? "" : " (" + failures + ")");
      return false;
    }
    int64_t n = 0;
    CUDNN_CHECK(api().get_attribute(plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &n, &workspace));
    return true;
  }
  // Whether the engine of config says its results may differ from run to run.
  bool nondeterministic_note(cudnnBackendDescriptor_t config) {
    cudnnBackendDescriptor_t engine = make(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
    int64_t n = 0;
    CUDNN_CHECK(api().get_attribute(config, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n, &engine));
    cudnnBackendNumericalNote_t notes[CUDNN_NUMERICAL_NOTE_TYPE_COUNT];
    CUDNN_CHECK(api().get_attribute(engine, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, CUDNN_TYPE_NUMERICAL_NOTE,
                                    CUDNN_NUMERICAL_NOTE_TYPE_COUNT, &n, notes));
    return std::find(notes, notes + n, CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC) != notes + n;
  }
};

std::string cudnn_attention_unavailable_reason() { return api().unavailable; }

int CudnnAttention::version() { return api().unavailable.empty() ? int(api().get_version()) : 0; }

std::string CudnnAttention::version_string() {
  const int v = version();
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100);
}

CudnnAttention::CudnnAttention(bool deterministic_backward) : deterministic_backward_(deterministic_backward) {
  if (!api().unavailable.empty()) throw RuntimeError("cuDNN's fused attention: " + api().unavailable);
  cudnnHandle_t h = nullptr;
  CUDNN_CHECK(api().create(&h));
  handle_ = h;
}

CudnnAttention::~CudnnAttention() {
  forward_plans_.clear();
  backward_plans_.clear();
  if (workspace_) cudaFree(workspace_);
  if (handle_) api().destroy(static_cast<cudnnHandle_t>(handle_));
}

void CudnnAttention::prepare(int B, int T, int H, int hd) {
  for (const bool backward : {false, true}) try {
      plan(backward, B, T, H, hd);
    } catch (const RuntimeError& e) {
      throw RuntimeError(std::string("cuDNN attention, ") + (backward ? "backward" : "forward") + " at B " +
                         std::to_string(B) + ", T " + std::to_string(T) + ", H " + std::to_string(H) + ", hd " +
                         std::to_string(hd) + ": " + e.what());
    }
}

namespace {
// The graphs. Tensors are 4-dim (image, head, rows, columns); qkv's Q, K, V and out's rows are
// strided views of the engine's [B*T, 3D] and [B*T, D] (K and V: qkv's pointer moved by D and
// 2D, bound at execution).
struct Layout {
  int64_t b, h, t, d, D;
  std::array<int64_t, 4> rows() const { return {b, h, t, d}; }
  std::array<int64_t, 4> qkv_strides() const { return {t * 3 * D, d, 3 * D, 1}; }
  std::array<int64_t, 4> out_strides() const { return {t * D, d, D, 1}; }
  std::array<int64_t, 4> stats() const { return {b, h, t, 1}; }
  std::array<int64_t, 4> stats_strides() const { return {h * t, t, 1, 1}; }
  std::array<int64_t, 4> scores() const { return {b, h, t, t}; }
  std::array<int64_t, 4> scores_strides() const { return {h * t * t, t * t, t, 1}; }
  std::array<int64_t, 4> transposed_scores_strides() const { return {h * t * t, t * t, 1, t}; }
  // A qkv part transposed: (image, head, column, token).
  std::array<int64_t, 4> columns() const { return {b, h, d, t}; }
  std::array<int64_t, 4> qkv_transposed_strides() const { return {t * 3 * D, d, 1, 3 * D}; }
};
constexpr cudnnDataType_t kBf16 = CUDNN_DATA_BFLOAT16, kF32 = CUDNN_DATA_FLOAT;

// The forward: cuDNN's fused SDPA operation (one node), out and the statistics.
void forward_graph(CudnnAttention::Plan& p, const Layout& L, std::vector<cudnnBackendDescriptor_t>* ops) {
  ops->push_back(p.finalized(
      p.linked(CUDNN_BACKEND_OPERATION_SDPA_FWD_DESCRIPTOR,
               {{CUDNN_ATTR_OPERATION_SDPA_FWD_QDESC, p.tensor(kQ, kBf16, L.rows(), L.qkv_strides())},
                {CUDNN_ATTR_OPERATION_SDPA_FWD_KDESC, p.tensor(kK, kBf16, L.rows(), L.qkv_strides())},
                {CUDNN_ATTR_OPERATION_SDPA_FWD_VDESC, p.tensor(kV, kBf16, L.rows(), L.qkv_strides())},
                {CUDNN_ATTR_OPERATION_SDPA_FWD_ODESC, p.tensor(kO, kBf16, L.rows(), L.out_strides())},
                {CUDNN_ATTR_OPERATION_SDPA_FWD_STATSDESC, p.tensor(kStats, kF32, L.stats(), L.stats_strides())},
                {CUDNN_ATTR_OPERATION_SDPA_FWD_SCALEDESC, p.scalar(kScale)}})));
}

// The backward as the graph of products and pointwise steps cuDNN's fused flash-attention
// backward engines recognise (the one cuDNN's frontend builds; 9.14 lacks the one-node SDPA
// backward, and 9.19 fails to finalize a graph of it):
//   row_dot = rowsum(dO * O) * 1; S = Q K^T * scale; P = exp(mask(S - stats)); dV = P^T dO;
//   dS = P (dO V^T - row_dot) * scale; dK = dS^T Q; dQ = dS K.
// deterministic: dQ straight to bf16; else through an fp32 sum (dq_sum), which cuDNN's engines
// may accumulate with atomics.
void backward_graph(CudnnAttention::Plan& p, const Layout& L, bool deterministic,
                    std::vector<cudnnBackendDescriptor_t>* ops) {
  const auto q = p.tensor(kQ, kBf16, L.rows(), L.qkv_strides());
  const auto kt = p.tensor(kK, kBf16, L.columns(), L.qkv_transposed_strides());
  const auto vt = p.tensor(kV, kBf16, L.columns(), L.qkv_transposed_strides());
  const auto o = p.tensor(kO, kBf16, L.rows(), L.out_strides());
  const auto dout = p.tensor(kDO, kBf16, L.rows(), L.out_strides());
  const auto stats = p.tensor(kStats, kF32, L.stats(), L.stats_strides());
  const auto scale = p.scalar(kScale), one = p.scalar(kOne);
  const auto scores = [&] { return p.tensor(0, kF32, L.scores(), L.scores_strides()); };
  // dO * O: the strides cuDNN's frontend gives this intermediate
  const auto dout_o = p.tensor(0, kF32, L.rows(), {L.h * L.t * L.d, L.t * L.d, L.h * L.d, 1});
  const auto row_sum = p.tensor(0, kF32, L.stats(), L.stats_strides());
  const auto row_dot = p.tensor(kRowDot, kF32, L.stats(), L.stats_strides());
  ops->push_back(p.pointwise(CUDNN_POINTWISE_MUL, dout, o, dout_o));
  ops->push_back(p.row_sum(dout_o, row_sum));
  ops->push_back(p.pointwise(CUDNN_POINTWISE_MUL, row_sum, one, row_dot));  // the pattern expects MUL, then SUB
  // mask: the padding mask cuDNN's frontend builds (its newest form), with every length T, so it
  // masks no real score. Without it an engine scores the padded part of its last key tile 0, and
  // exp(0 - lse) overflows where a query's log-sum-exp is below -88.7: the NaN reported of these
  // engines, 9.26's included (cuDNN frontend issues 160, 628 and 1072; its maintainers give this
  // mask as the remedy, and the frontend adds it itself up to 9.15). The same lengths override the
  // products' dims, as the frontend's do.
  const auto seq_q = p.tensor(kSeqLenQ, CUDNN_DATA_INT32, {L.b, 1, 1, 1}, {1, 1, 1, 1});
  const auto seq_kv = p.tensor(kSeqLenKV, CUDNN_DATA_INT32, {L.b, 1, 1, 1}, {1, 1, 1, 1});
  const MatmulLengths queries_by_keys{seq_q, seq_kv, nullptr}, keys_by_queries{seq_kv, nullptr, seq_q},
      queries_over_keys{seq_q, nullptr, seq_kv};
  const auto masked = [&](cudnnBackendDescriptor_t score) {
    const auto index = [&] { return p.tensor(0, CUDNN_DATA_INT32, L.scores(), L.scores_strides()); };
    const auto flags = [&] { return p.tensor(0, CUDNN_DATA_BOOLEAN, L.scores(), L.scores_strides()); };
    const auto row = index(), column = index(), row_in = flags(), column_in = flags(), in = flags(), y = scores();
    ops->push_back(p.pointwise(CUDNN_POINTWISE_GEN_INDEX, score, nullptr, row, CUDNN_DATA_INT32, nullptr, 2));
    ops->push_back(p.pointwise(CUDNN_POINTWISE_GEN_INDEX, score, nullptr, column, CUDNN_DATA_INT32, nullptr, 3));
    ops->push_back(p.pointwise(CUDNN_POINTWISE_CMP_LT, row, seq_q, row_in, CUDNN_DATA_BOOLEAN));
    ops->push_back(p.pointwise(CUDNN_POINTWISE_CMP_LT, column, seq_kv, column_in, CUDNN_DATA_BOOLEAN));
    ops->push_back(p.pointwise(CUDNN_POINTWISE_LOGICAL_AND, row_in, column_in, in, CUDNN_DATA_BOOLEAN));
    ops->push_back(p.pointwise(CUDNN_POINTWISE_BINARY_SELECT, score, p.scalar(kMaskFill), y, CUDNN_DATA_FLOAT, in));
    return y;
  };
  const auto s = scores(), s_scaled = scores(), s_shifted = scores(), prob = scores();
  ops->push_back(p.matmul(q, kt, s, queries_by_keys));
  ops->push_back(p.pointwise(CUDNN_POINTWISE_MUL, s, scale, s_scaled));
  ops->push_back(p.pointwise(CUDNN_POINTWISE_SUB, s_scaled, stats, s_shifted));
  ops->push_back(p.pointwise(CUDNN_POINTWISE_EXP, masked(s_shifted), nullptr, prob));
  const auto prob_t = p.tensor(0, kBf16, {L.b, L.h, L.t, L.t}, L.transposed_scores_strides());
  ops->push_back(p.reshape(prob, prob_t));
  ops->push_back(p.matmul(prob_t, dout, p.tensor(kDV, kBf16, L.rows(), L.qkv_strides()), keys_by_queries));
  const auto dp = scores(), dp_shifted = scores(), ds_unscaled = scores(), ds = scores();
  ops->push_back(p.matmul(dout, vt, dp, queries_by_keys));
  ops->push_back(p.pointwise(CUDNN_POINTWISE_SUB, dp, row_dot, dp_shifted));
  ops->push_back(p.pointwise(CUDNN_POINTWISE_MUL, dp_shifted, prob, ds_unscaled));
  ops->push_back(p.pointwise(CUDNN_POINTWISE_MUL, ds_unscaled, scale, ds));
  const auto ds_t = p.tensor(0, kBf16, {L.b, L.h, L.t, L.t}, L.transposed_scores_strides());
  ops->push_back(p.reshape(ds, ds_t));
  ops->push_back(p.matmul(ds_t, q, p.tensor(kDK, kBf16, L.rows(), L.qkv_strides()), keys_by_queries));
  const auto k = p.tensor(0, kF32, L.rows(), L.qkv_strides());
  ops->push_back(p.reshape(kt, k));
  const auto dq = p.tensor(kDQ, kBf16, L.rows(), L.qkv_strides());
  if (deterministic) {
    ops->push_back(p.matmul(ds, k, dq, queries_over_keys));
  } else {
    const auto dq_sum = p.tensor(kDqSum, kF32, L.rows(), {L.h * L.t * L.d, L.t * L.d, L.d, 1});
    ops->push_back(p.matmul(ds, k, dq_sum, queries_over_keys));
    ops->push_back(p.pointwise(CUDNN_POINTWISE_IDENTITY, dq_sum, nullptr, dq));
  }
}
}  // namespace

CudnnAttention::Plan& CudnnAttention::plan(bool backward, int B, int T, int H, int hd) {
  auto& plans = backward ? backward_plans_ : forward_plans_;
  const Shape key{B, T, H, hd};
  if (const auto it = plans.find(key); it != plans.end()) return *it->second;

  ENSURE(B > 0 && T > 1 && H > 0 && hd > 0 && hd % 8 == 0 && hd <= 128,
         "cuDNN attention: B " + std::to_string(B) + ", T " + std::to_string(T) + ", H " + std::to_string(H) +
             ", hd " + std::to_string(hd) + " (T at least 2, hd a multiple of 8 up to 128)");
  const Layout L{B, H, T, hd, int64_t(H) * hd};
  std::unique_ptr<Plan> p;
  std::string why;
  // The backward: the graph asked for first, the other where no engine takes it.
  const std::vector<bool> graphs = !backward ? std::vector<bool>{true}
                                   : deterministic_backward_ ? std::vector<bool>{true, false}
                                                             : std::vector<bool>{false, true};
  for (const bool deterministic : graphs) {
    p = std::make_unique<Plan>();
    p->scale = 1.0f / std::sqrt(float(hd));
    p->deterministic = deterministic;
    std::vector<cudnnBackendDescriptor_t> ops;
    if (backward) backward_graph(*p, L, deterministic, &ops);
    else forward_graph(*p, L, &ops);
    std::string failure;
    if (p->build(handle_, ops, &failure)) break;
    why += std::string(why.empty() ? "" : "; ") + (backward ? deterministic ? "deterministic: " : "accumulating: " : "") +
           failure;
    p.reset();
  }
  if (!p) throw RuntimeError("cuDNN " + version_string() + " has no plan: " + why);
  // Outside the step (prepare runs before it): the plan's buffers, and the shared workspace.
  CUDA_CHECK(cudaDeviceSynchronize());
  if (backward) {
    const size_t row_dot_bytes = size_t(B) * H * T * sizeof(float), seq_len_bytes = size_t(B) * sizeof(int32_t);
    p->buffer_bytes = row_dot_bytes + seq_len_bytes;
    CUDA_CHECK(cudaMalloc(&p->row_dot, row_dot_bytes));
    CUDA_CHECK(cudaMalloc(&p->seq_len, seq_len_bytes));
    const std::vector<int32_t> lengths(size_t(B), T);
    CUDA_CHECK(cudaMemcpy(p->seq_len, lengths.data(), seq_len_bytes, cudaMemcpyHostToDevice));
    if (!p->deterministic) {
      CUDA_CHECK(cudaMalloc(&p->dq_sum, size_t(B) * H * T * hd * sizeof(float)));
      p->buffer_bytes += size_t(B) * H * T * hd * sizeof(float);
    }
  }
  if (size_t(p->workspace) > workspace_bytes_) {  // the new one first: a failure leaves the old in place
    void* grown = nullptr;
    CUDA_CHECK(cudaMalloc(&grown, size_t(p->workspace)));
    if (workspace_) cudaFree(workspace_);
    workspace_ = grown, workspace_bytes_ = size_t(p->workspace);
  }
  return *(plans[key] = std::move(p));
}

namespace {
// The user tensors' ids in the order forward() and backward() bind their pointers (the
// backward's last, dq_sum, only in the accumulating graph).
constexpr int64_t kForwardUids[] = {kQ, kK, kV, kO, kStats, kScale};
constexpr int64_t kBackwardUids[] = {kQ,  kK,  kV,  kO,      kStats,   kScale,    kOne,      kDO,
                                     kDQ, kDK, kDV, kRowDot, kSeqLenQ, kSeqLenKV, kMaskFill, kDqSum};

// Binds n pointers to the plan's user tensors uids and runs it on stream.
void execute(void* handle, const CudnnAttention::Plan& plan, const int64_t* uids, void* const* pointers, int64_t n,
             void* workspace, cudaStream_t stream) {
  const cudnnHandle_t h = static_cast<cudnnHandle_t>(handle);
  CUDNN_CHECK(api().set_stream(h, stream));
  cudnnBackendDescriptor_t pack = nullptr;
  CUDNN_CHECK(api().create_descriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &pack));
  struct Release {  // the pack is built per call (the pointers change); freed on every path
    cudnnBackendDescriptor_t d;
    ~Release() { api().destroy_descriptor(d); }
  } release{pack};
  CUDNN_CHECK(api().set_attribute(pack, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, n, uids));
  CUDNN_CHECK(api().set_attribute(pack, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, n, pointers));
  CUDNN_CHECK(api().set_attribute(pack, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace));
  CUDNN_CHECK(api().finalize(pack));
  CUDNN_CHECK(api().execute(h, plan.plan, pack));
}
}  // namespace

void CudnnAttention::forward(const __nv_bfloat16* qkv, __nv_bfloat16* out, float* lse, int B, int T, int H, int hd,
                             cudaStream_t stream) {
  Plan& p = plan(false, B, T, H, hd);
  const size_t D = size_t(H) * hd;
  __nv_bfloat16* q = const_cast<__nv_bfloat16*>(qkv);
  void* const pointers[] = {q, q + D, q + 2 * D, out, lse, &p.scale};
  static_assert(std::size(pointers) == std::size(kForwardUids));
  execute(handle_, p, kForwardUids, pointers, std::size(kForwardUids), workspace_, stream);
}

void CudnnAttention::backward(const __nv_bfloat16* qkv, const __nv_bfloat16* out, const __nv_bfloat16* dout,
                              const float* lse, __nv_bfloat16* dqkv, int B, int T, int H, int hd, cudaStream_t stream) {
  Plan& p = plan(true, B, T, H, hd);
  const size_t D = size_t(H) * hd;
  __nv_bfloat16* q = const_cast<__nv_bfloat16*>(qkv);
  void* const pointers[] = {q, q + D, q + 2 * D, const_cast<__nv_bfloat16*>(out), const_cast<float*>(lse),
                            &p.scale, &p.one, const_cast<__nv_bfloat16*>(dout), dqkv, dqkv + D, dqkv + 2 * D,
                            p.row_dot, p.seq_len, p.seq_len, &p.mask_fill, p.dq_sum};
  static_assert(std::size(pointers) == std::size(kBackwardUids));
  execute(handle_, p, kBackwardUids, pointers, std::size(kBackwardUids) - (p.dq_sum ? 0 : 1), workspace_, stream);
}

size_t CudnnAttention::device_bytes() const {
  size_t bytes = workspace_bytes_;
  for (const auto* plans : {&forward_plans_, &backward_plans_})
    for (const auto& [shape, p] : *plans) bytes += p->buffer_bytes;
  return bytes;
}

bool CudnnAttention::backward_deterministic(int B, int T, int H, int hd) const {
  const auto it = backward_plans_.find(Shape{B, T, H, hd});
  ENSURE(it != backward_plans_.end(), "CudnnAttention::backward_deterministic before prepare");
  return it->second->deterministic;
}

#else  // built without cuDNN's headers: the class exists, and every use says why it cannot run

struct CudnnAttention::Plan {};
std::string cudnn_attention_unavailable_reason() { return "this build has no cuDNN headers (cudnn_graph.h)"; }
int CudnnAttention::version() { return 0; }
std::string CudnnAttention::version_string() { return "none"; }
CudnnAttention::CudnnAttention(bool) : deterministic_backward_(true) {
  throw RuntimeError("cuDNN's fused attention: " + cudnn_attention_unavailable_reason());
}
CudnnAttention::~CudnnAttention() = default;
void CudnnAttention::prepare(int, int, int, int) {}
void CudnnAttention::forward(const __nv_bfloat16*, __nv_bfloat16*, float*, int, int, int, int, cudaStream_t) {}
void CudnnAttention::backward(const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*, const float*,
                              __nv_bfloat16*, int, int, int, int, cudaStream_t) {}
bool CudnnAttention::backward_deterministic(int, int, int, int) const { return true; }
size_t CudnnAttention::device_bytes() const { return 0; }
CudnnAttention::Plan& CudnnAttention::plan(bool, int, int, int, int) {
  throw RuntimeError("cuDNN's fused attention: " + cudnn_attention_unavailable_reason());
}

#endif

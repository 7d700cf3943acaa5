#include "process_group_ccl.hpp"

#include "errors.hpp"
#include "dtypes.hpp"
#include "reduce_ops.hpp"
#include "shm.hpp"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <numeric>

namespace oneccl_bind_pt {

namespace {

using c10d::OpType;

constexpr OpInfo kBroadcast{OpType::BROADCAST, "broadcast", "pg::broadcast", "ccl:broadcast"};
constexpr OpInfo kAllreduce{OpType::ALLREDUCE, "allreduce", "pg::allreduce", "ccl:all_reduce"};
constexpr OpInfo kAllreduceCoalesced{
    OpType::ALLREDUCE_COALESCED, "allreduce_coalesced", "pg::allreduce_coalesced", "ccl:all_reduce"};
// The first step of a sparse all_reduce (see allreduce_sparse).
constexpr OpInfo kSparseCounts{
    OpType::ALLGATHER, "allreduce (sparse: non-zero counts)", "pg::allreduce_sparse_counts",
    "ccl:allgather_sparse_counts"};
constexpr OpInfo kReduce{OpType::REDUCE, "reduce", "pg::reduce", "ccl:reduce"};
constexpr OpInfo kAllgather{OpType::ALLGATHER, "allgather", "pg::allgather", "ccl:all_gather"};
constexpr OpInfo kAllgatherBase{
    OpType::_ALLGATHER_BASE, "all_gather_single", "pg::all_gather_single", "ccl:all_gather_into_tensor"};
constexpr OpInfo kAllgatherCoalesced{
    OpType::ALLGATHER_COALESCED, "allgather_coalesced", "pg::allgather_coalesced", "ccl:all_gather"};
constexpr OpInfo kAllgatherIntoTensorCoalesced{
    compat::kAllgatherIntoTensorCoalesced, "all_gather_into_tensor_coalesced",
    "pg::all_gather_into_tensor_coalesced", "ccl:all_gather_into_tensor_coalesced"};
constexpr OpInfo kGather{OpType::GATHER, "gather", "pg::gather", "ccl:gather"};
constexpr OpInfo kGatherSingle{OpType::GATHER, "gather_single", "pg::gather_single", "ccl:gather"};
constexpr OpInfo kScatter{OpType::SCATTER, "scatter", "pg::scatter", "ccl:scatter"};
constexpr OpInfo kReduceScatter{OpType::REDUCE_SCATTER, "reduce_scatter", "pg::reduce_scatter", "ccl:reduce_scatter"};
constexpr OpInfo kReduceScatterBase{
    OpType::_REDUCE_SCATTER_BASE, "reduce_scatter_single", "pg::reduce_scatter_single", "ccl:reduce_scatter_tensor"};
constexpr OpInfo kReduceScatterTensorCoalesced{
    OpType::REDUCE_SCATTER_TENSOR_COALESCED, "reduce_scatter_tensor_coalesced",
    "pg::reduce_scatter_tensor_coalesced", "ccl:reduce_scatter_tensor_coalesced"};
constexpr OpInfo kAlltoallBase{OpType::ALLTOALL_BASE, "all_to_all_single", "pg::all_to_all_single", "ccl:all_to_all"};
constexpr OpInfo kAlltoall{OpType::ALLTOALL, "alltoall", "pg::alltoall", "ccl:all_to_all"};
constexpr OpInfo kSend{OpType::SEND, "send", "pg::send", "ccl:send"};
constexpr OpInfo kRecv{OpType::RECV, "recv", "pg::recv", "ccl:recv"};
constexpr OpInfo kRecvAnysource{OpType::RECVANYSOURCE, "recv", "pg::recv", "ccl:recvAnySource"};
constexpr OpInfo kBarrier{OpType::BARRIER, "barrier", "pg::barrier", "ccl:barrier"};
constexpr OpInfo kCoalesced{OpType::COALESCED, "coalesced", "pg::coalesced", "ccl:coalesced"};

// oneCCL rejects null buffers even for zero counts; empty tensors may have one.
void* ptr(const at::Tensor& t) {
  static char dummy;
  void* p = t.numel() > 0 ? t.data_ptr() : nullptr;
  return p ? p : &dummy;
}

size_t nbytes(const at::Tensor& t) {
  return t.numel() * t.element_size();
}

// Views any contiguous tensor as a flat byte tensor sharing its memory.
at::Tensor as_bytes(const at::Tensor& t) {
  return t.reshape({-1}).view(at::kByte);
}

// `dense_ok`: element-wise ops accept any non-overlapping dense layout, as
// every rank holds the same layout; ops that slice need row-major order.
void check_tensor(const char* op, const at::Tensor& t, const std::string& what, bool dense_ok = false) {
  CCL_CHECK_ARG(t.defined(), "ccl ", op, ": ", what, " is undefined");
  CCL_CHECK_ARG(
      t.device().is_cpu(), "ccl ", op, ": ", what, " is on device '", t.device(),
      "'; the ccl backend works on CPU tensors (move it with .cpu())");
  CCL_CHECK_ARG(
      t.layout() == at::kStrided, "ccl ", op, ": ", what, " has layout ", t.layout(),
      "; expected a dense (strided) tensor");
  const bool ok = dense_ok ? t.is_non_overlapping_and_dense() : t.is_contiguous();
  CCL_CHECK_ARG(
      ok, "ccl ", op, ": ", what, " is not contiguous (sizes ", t.sizes(), ", strides ",
      t.strides(), "); pass tensor.contiguous()");
}

const at::Tensor& single(const char* op, const std::vector<at::Tensor>& tensors, bool dense_ok = false) {
  CCL_CHECK_ARG(
      tensors.size() == 1, "ccl ", op, ": expected exactly one tensor, got ", tensors.size(),
      " (one process drives one CPU device)");
  check_tensor(op, tensors[0], "tensor", dense_ok);
  return tensors[0];
}

void check_rank(const char* op, const char* what, int64_t r, int size) {
  CCL_CHECK_ARG(
      r >= 0 && r < size, "ccl ", op, ": invalid ", what, ": ", r,
      " is out of range for a process group of size ", size, " (expected 0..", size - 1,
      "; unexpected rank)");
}

void check_same_dtype(const char* op, const at::Tensor& t, const at::Tensor& ref, const std::string& what) {
  CCL_CHECK_TYPE(
      // "Tensors are not equal in data type": torch-ccl's wording, which its users match on.
      t.scalar_type() == ref.scalar_type(), "ccl ", op, ": Tensors are not equal in data type: ", what, " has dtype ",
      dtype_name(t.scalar_type()), " but the input has ", dtype_name(ref.scalar_type()),
      "; all tensors of one call must share a dtype");
}

void check_list(
    const char* op,
    const std::vector<at::Tensor>& list,
    const at::Tensor& ref,
    int size,
    const char* what) {
  CCL_CHECK_ARG(
      static_cast<int>(list.size()) == size, "ccl ", op, ": ", what, " has ", list.size(),
      " tensors; expected one per rank (", size, ")");
  for (size_t i = 0; i < list.size(); ++i) {
    const auto name = std::string(what) + "[" + std::to_string(i) + "]";
    check_tensor(op, list[i], name);
    check_same_dtype(op, list[i], ref, name);
  }
}

// The tensor-pair ops (all_gather_into_tensor, reduce_scatter_tensor and their
// coalesced forms): lists pair up, and the larger tensor of every pair holds
// one share per rank. Returns the op's name for a single pair or for many.
const OpInfo& check_pairs(
    const OpInfo& one,
    const OpInfo& many,
    const std::vector<at::Tensor>& outputs,
    const std::vector<at::Tensor>& inputs,
    int size,
    bool output_is_larger) {
  const OpInfo& info = inputs.size() == 1 ? one : many;
  const char* op = info.name;
  CCL_CHECK_ARG(
      !inputs.empty() && outputs.size() == inputs.size(), "ccl ", op, ": got ", outputs.size(),
      " outputs and ", inputs.size(), " inputs; expected the same non-zero number");
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_tensor(op, inputs[i], "input");
    check_tensor(op, outputs[i], "output");
    check_same_dtype(op, outputs[i], inputs[i], "output");
    const auto& small = output_is_larger ? inputs[i] : outputs[i];
    const auto& large = output_is_larger ? outputs[i] : inputs[i];
    // The clause after ';' is gloo's wording for the same mistake.
    CCL_CHECK_ARG(
        large.numel() == small.numel() * size, "ccl ", op, ": output has ", outputs[i].numel(),
        " elements and input ", inputs[i].numel(), "; expected the ",
        output_is_larger ? "output" : "input", " to hold group size (", size, ") x ",
        output_is_larger ? "input" : "output", " = ", small.numel() * size, " elements (",
        output_is_larger ? "output tensor size must be equal to world_size times input tensor size"
                         : "input tensor must be the same size as output size times world size",
        ")");
  }
  return info;
}

std::chrono::milliseconds pick_timeout(std::chrono::milliseconds requested, std::chrono::milliseconds group) {
  return requested == c10d::kUnsetTimeout ? group : requested;
}

// A flat copy of `tensors`, one after the other.
at::Tensor flatten_copy(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> flat;
  flat.reserve(tensors.size());
  for (const auto& t : tensors) {
    flat.push_back(t.reshape({-1}));
  }
  return at::cat(flat);
}

// Copies consecutive slices of `flat` back into `tensors`.
void unflatten_into(const at::Tensor& flat, std::vector<at::Tensor>& tensors) {
  int64_t offset = 0;
  for (auto& t : tensors) {
    const auto n = t.numel();
    t.view({-1}).copy_(flat.narrow(0, offset, n));
    offset += n;
  }
}

size_t total(const std::vector<size_t>& counts) {
  return std::accumulate(counts.begin(), counts.end(), size_t{0});
}

// The bytes of `tensors`, one after the other, in a new flat buffer.
at::Tensor pack_bytes(const std::vector<at::Tensor>& tensors, const at::TensorOptions& like) {
  std::vector<at::Tensor> bytes;
  for (const auto& t : tensors) {
    bytes.push_back(as_bytes(t));
  }
  return bytes.empty() ? at::empty({0}, like.dtype(at::kByte)) : at::cat(bytes);
}

// Copies consecutive byte ranges of `flat` back into `tensors`.
void unpack_bytes(const at::Tensor& flat, std::vector<at::Tensor>& tensors) {
  int64_t offset = 0;
  for (auto& t : tensors) {
    const auto n = static_cast<int64_t>(nbytes(t));
    as_bytes(t).copy_(flat.narrow(0, offset, n));
    offset += n;
  }
}

// gather's gather_list / scatter's scatter_list: checked on the root (one
// tensor per rank, its own slot the size of `own`), absent everywhere else.
std::vector<at::Tensor> root_list(
    const char* op,
    const std::vector<std::vector<at::Tensor>>& lists,
    const at::Tensor& own,
    int root,
    int rank,
    int size,
    const char* what) {
  if (rank != root) {
    CCL_CHECK_ARG(
        lists.empty() || (lists.size() == 1 && lists[0].empty()), "ccl ", op,
        ": only the root (rank ", root, ") passes a ", what);
    return {};
  }
  CCL_CHECK_ARG(
      lists.size() == 1, "ccl ", op, ": the root expects one ", what, ", got ", lists.size());
  check_list(op, lists[0], own, size, what);
  CCL_CHECK_ARG(
      lists[0][root].numel() == own.numel(), "ccl ", op, ": ", what, "[", root, "] has ",
      lists[0][root].numel(), " elements but this rank's tensor has ", own.numel());
  return lists[0];
}

std::vector<size_t> byte_counts(const std::vector<at::Tensor>& tensors) {
  std::vector<size_t> counts;
  counts.reserve(tensors.size());
  for (const auto& t : tensors) {
    counts.push_back(nbytes(t));
  }
  return counts;
}

using K = Prim::Kind;

// A data-movement Prim that counts bytes.
Prim bytes(K kind, const void* src, void* dst, size_t count, int peer = -1, int tag = 0) {
  Prim p{kind};
  p.src = src;
  p.dst = dst;
  p.count = count;
  p.peer = peer;
  p.tag = tag;
  return p;
}

// A reduction Prim over `count` elements of red's type.
Prim reduction(K kind, const void* src, void* dst, const std::shared_ptr<const Reduction>& red, size_t count, int root = -1) {
  Prim p = bytes(kind, src, dst, count, root);
  p.red = red;
  return p;
}

Prim alltoallv(const void* src, std::vector<size_t> send, void* dst, std::vector<size_t> recv) {
  Prim p{K::Alltoallv};
  p.src = src;
  p.dst = dst;
  p.send_counts = std::move(send);
  p.recv_counts = std::move(recv);
  return p;
}

} // namespace

struct ProcessGroupCCL::Call {
  const OpInfo& op;
  std::chrono::milliseconds timeout;
  std::vector<at::Tensor> inputs; // shown to the profiler
  std::vector<at::Tensor> outputs; // Work::result() and the Future's value
  std::vector<at::Tensor> buffers = {}; // scratch memory the transport uses
  std::function<void()> on_success = nullptr;
  std::vector<std::vector<at::Tensor>> nested_outputs = {}; // see WorkCCL::nested_outputs
  std::vector<Prim> prims = {}; // the communication, for the transport
};

ProcessGroupCCL::ProcessGroupCCL(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    std::chrono::milliseconds timeout)
    : c10d::Backend(rank, size),
      comm_(std::make_shared<Communicator>(store, rank, size, timeout)),
      timeout_(timeout) {}

ProcessGroupCCL::~ProcessGroupCCL() = default;

c10::intrusive_ptr<c10d::Backend::Options> ProcessGroupCCL::getBackendOptions() {
  return c10::make_intrusive<Options>("ccl", timeout_);
}

std::string ProcessGroupCCL::path(const std::string& kind, size_t nbytes) const {
  static const std::pair<const char*, K> kinds[] = {
      {"allreduce", K::Allreduce}, {"reduce", K::Reduce}, {"broadcast", K::Broadcast},
      {"allgather", K::Allgatherv}, {"alltoall", K::Alltoallv}, {"reduce_scatter", K::ReduceScatter},
      {"send", K::Send}, {"recv", K::Recv}, {"barrier", K::Barrier}};
  for (const auto& [name, k] : kinds) {
    if (kind == name) {
      if (!comm_->shm()) {
        return "oneccl";
      }
      return k == K::Send || k == K::Recv || k == K::Barrier ? "shm" : comm_->shm()->path(k, nbytes);
    }
  }
  CCL_CHECK_ARG(false, "ccl: unknown collective '", kind, "'; expected allreduce, reduce, broadcast, "
                "allgather, alltoall, reduce_scatter, send, recv or barrier");
  return {};
}

// The one path every op takes: a Work, its Prims started on the group's
// transport, and, when they finish at once (small ops on shared memory
// often do), completion without a trip through the progress engine.
c10::intrusive_ptr<c10d::Work> ProcessGroupCCL::run(Call&& call) {
  TORCH_CHECK(
      !comm_->broken(), "ccl ", call.op.name,
      ": this process group is unusable after an earlier failure: ", comm_->broken_reason());
  auto work = c10::make_intrusive<WorkCCL>(
      call.op, comm_, call.inputs, std::move(call.outputs), call.timeout);
  seq_.fetch_add(1, std::memory_order_relaxed);
  work->buffers = std::move(call.buffers);
  work->buffers.insert(work->buffers.end(), call.inputs.begin(), call.inputs.end());
  work->on_success = std::move(call.on_success);
  work->nested_outputs = std::move(call.nested_outputs);
  auto& progress = Progress::get();
  bool finished = false;
  {
    std::lock_guard<std::mutex> lock(progress.ccl_mutex());
    work->pending = comm_->start(call.op.name, std::move(call.prims));
    finished = work->poll_locked(Clock::now());
    if (!finished) {
      progress.track(work);
    }
  }
  if (finished) {
    work->complete();
  }
  if (coalescing_) {
    coalesced_.push_back(work);
  }
  return work;
}

void ProcessGroupCCL::startCoalescing() {
  TORCH_CHECK(!coalescing_, "ccl: startCoalescing called twice without endCoalescing");
  coalescing_ = true;
  coalesced_.clear();
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCCL::endCoalescing() {
  TORCH_CHECK(coalescing_, "ccl: endCoalescing called without startCoalescing");
  coalescing_ = false;
  auto parts = std::move(coalesced_);
  coalesced_.clear();
  std::vector<at::Tensor> outputs;
  for (const auto& part : parts) {
    auto r = part->result();
    outputs.insert(outputs.end(), r.begin(), r.end());
  }
  auto work = c10::make_intrusive<WorkCCL>(kCoalesced, comm_, std::vector<at::Tensor>{}, outputs, timeout_);
  work->parts = std::move(parts);
  std::lock_guard<std::mutex> lock(Progress::get().ccl_mutex());
  Progress::get().track(work);
  return work;
}

// ---- reductions ------------------------------------------------------------

c10::intrusive_ptr<c10d::Work> ProcessGroupCCL::allreduce(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceOptions& opts) {
  const char* op = kAllreduce.name;
  if (tensors.size() == 1 && tensors[0].defined() && tensors[0].is_sparse()) {
    return allreduce_sparse(tensors[0], opts);
  }
  at::Tensor t = single(op, tensors, /*dense_ok=*/true);
  auto red = resolve_reduction(op, opts.reduceOp, t.scalar_type());
  red->scale_inplace(t);
  const int size = getSize();
  Call call{kAllreduce, pick_timeout(opts.timeout, timeout_), {t}, {t}};
  if (red->needs_finish()) {
    call.on_success = [red, t, size]() mutable { red->finish(t, size); };
  }
  call.prims.push_back(reduction(K::Allreduce, ptr(t), ptr(t), red, red->count(t)));
  return run(std::move(call));
}

// Sparse COO tensors, SUM only, as gloo does them: gather every rank's
// indices and values, then add them up locally. The receive sizes are only
// known once every rank's number of non-zeros is, so that is gathered first
// (and waited for here); the Work returned is the gather of the entries.
c10::intrusive_ptr<c10d::Work> ProcessGroupCCL::allreduce_sparse(
    at::Tensor& t,
    const c10d::AllreduceOptions& opts) {
  const char* op = kAllreduce.name;
  CCL_CHECK_ARG(
      t.device().is_cpu(), "ccl ", op, ": tensor is on device '", t.device(),
      "'; the ccl backend works on CPU tensors (move it with .cpu())");
  CCL_CHECK_ARG(
      opts.reduceOp == c10d::ReduceOp::SUM, "ccl ", op, ": sparse tensors reduce with SUM only, got ",
      reduce_op_name(opts.reduceOp.op_));
  const auto timeout = pick_timeout(opts.timeout, timeout_);
  const int size = getSize();
  const at::Tensor input = t.coalesce();
  const at::Tensor indices = input._indices().contiguous(); // [sparse dims, nnz]
  const at::Tensor values = input._values().contiguous();   // [nnz, dense sizes...]
  const int64_t sparse_dims = input.sparse_dim();

  at::Tensor mine = at::full({1}, input._nnz(), at::kLong);
  at::Tensor all_nnz = at::empty({size}, at::kLong);
  Call counts{kSparseCounts, timeout, {mine}, {all_nnz}};
  Prim count_prim = bytes(K::Allgatherv, ptr(mine), ptr(all_nnz), nbytes(mine));
  count_prim.recv_counts.assign(size, nbytes(mine));
  counts.prims.push_back(std::move(count_prim));
  run(std::move(counts))->wait();

  std::vector<int64_t> nnz(all_nnz.data_ptr<int64_t>(), all_nnz.data_ptr<int64_t>() + size);
  const int64_t total_nnz = std::accumulate(nnz.begin(), nnz.end(), int64_t{0});
  std::vector<int64_t> value_shape = values.sizes().vec();
  value_shape[0] = total_nnz;
  const size_t value_bytes = values.element_size() * c10::multiply_integers(value_shape.begin() + 1, value_shape.end());
  at::Tensor all_indices = at::empty({sparse_dims * total_nnz}, at::kLong);
  at::Tensor all_values = at::empty(value_shape, values.options());
  Prim idx = bytes(K::Allgatherv, ptr(indices), ptr(all_indices), nbytes(indices));
  Prim val = bytes(K::Allgatherv, ptr(values), ptr(all_values), nbytes(values));
  for (int r = 0; r < size; ++r) {
    idx.recv_counts.push_back(sizeof(int64_t) * sparse_dims * nnz[r]);
    val.recv_counts.push_back(value_bytes * nnz[r]);
  }
  Call call{kAllreduce, timeout, {t}, {t}, {indices, values, all_indices, all_values}};
  call.on_success = [t, nnz, sparse_dims, all_indices, all_values]() mutable {
    // Rank r's indices arrive as one [sparse dims, nnz_r] block: side by side.
    std::vector<at::Tensor> blocks;
    int64_t offset = 0;
    for (const int64_t n : nnz) {
      blocks.push_back(all_indices.narrow(0, offset, sparse_dims * n).view({sparse_dims, n}));
      offset += sparse_dims * n;
    }
    auto sum = at::sparse_coo_tensor(at::cat(blocks, 1), all_values, t.sizes()).coalesce();
    t.copy_(sum);
  };
  call.prims.push_back(std::move(idx));
  call.prims.push_back(std::move(val));
  return run(std::move(call));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCCL::allreduce_coalesced(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceCoalescedOptions& opts) {
  const char* op = kAllreduceCoalesced.name;
  CCL_CHECK_ARG(!tensors.empty(), "ccl ", op, ": got no tensors");
  for (size_t i = 0; i < tensors.size(); ++i) {
    check_tensor(op, tensors[i], "tensors[" + std::to_string(i) + "]");
    check_same_dtype(op, tensors[i], tensors[0], "tensors[" + std::to_string(i) + "]");
  }
  auto red = resolve_reduction(op, opts.reduceOp, tensors[0].scalar_type());
  // One call on a flat copy: one latency instead of one per tensor.
  at::Tensor flat = flatten_copy(tensors);
  red->scale_inplace(flat);
  const int size = getSize();
  Call call{kAllreduceCoalesced, pick_timeout(opts.timeout, timeout_), tensors, tensors, {flat}};
  call.on_success = [red, flat, outs = tensors, size]() mutable {
    red->finish(flat, size);
    unflatten_into(flat, outs);
  };
  call.prims.push_back(reduction(K::Allreduce, ptr(flat), ptr(flat), red, red->count(flat)));
  return run(std::move(call));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCCL::reduce(
    std::vector<at::Tensor>& tensors,
    const c10d::ReduceOptions& opts) {
  const char* op = kReduce.name;
  at::Tensor t = single(op, tensors, /*dense_ok=*/true);
  check_rank(op, "root rank", opts.rootRank, getSize());
  auto red = resolve_reduction(op, opts.reduceOp, t.scalar_type());
  const int root = static_cast<int>(opts.rootRank);
  const bool is_root = getRank() == root;
  const int size = getSize();
  // Non-roots keep their input intact: oneCCL writes partial sums into the
  // receive buffer of every rank, so they reduce from and into scratch.
  at::Tensor src = t;
  if (!is_root && (red->premul || red->allreduce_only())) {
    src = t.clone();
  }
  red->scale_inplace(src);
  at::Tensor dst = is_root ? t : (red->allreduce_only() ? src : at::empty_like(t));
  Call call{kReduce, pick_timeout(opts.timeout, timeout_), {t}, {t}, {src, dst}};
  if (is_root && red->needs_finish()) {
    call.on_success = [red, t, size]() mutable { red->finish(t, size); };
  }
  call.prims.push_back(
      red->allreduce_only() ? reduction(K::Allreduce, ptr(dst), ptr(dst), red, red->count(dst))
                            : reduction(K::Reduce, ptr(src), ptr(dst), red, red->count(t), root));
  return run(std::move(call));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCCL::_reduce_scatter_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::ReduceScatterOptions& opts) {
  std::vector<at::Tensor> outputs{output}, inputs{input};
  return reduce_scatter_tensor_coalesced(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCCL::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  const int size = getSize();
  const int rank = getRank();
  const OpInfo& info = check_pairs(
      kReduceScatterBase, kReduceScatterTensorCoalesced, outputs, inputs, size,
      /*output_is_larger=*/false);
  const char* op = info.name;
  std::vector<std::shared_ptr<const Reduction>> reds;
  std::vector<at::Tensor> sends;
  for (const auto& in : inputs) {
    auto red = resolve_reduction(op, opts.reduceOp, in.scalar_type());
    at::Tensor send = in;
    if (red->premul || red->allreduce_only()) {
      send = in.clone(); // the caller's input stays untouched
      red->scale_inplace(send);
    }
    sends.push_back(send);
    reds.push_back(std::move(red));
  }
  Call call{info, pick_timeout(opts.timeout, timeout_), inputs, outputs, sends};
  for (size_t i = 0; i < outputs.size(); ++i) {
    call.prims.push_back(
        reds[i]->allreduce_only()
            ? reduction(K::Allreduce, ptr(sends[i]), ptr(sends[i]), reds[i], reds[i]->count(sends[i]))
            : reduction(K::ReduceScatter, ptr(sends[i]), ptr(outputs[i]), reds[i], reds[i]->count(outputs[i])));
  }
  call.on_success = [reds, sends, outs = outputs, size, rank]() mutable {
    for (size_t i = 0; i < outs.size(); ++i) {
      if (reds[i]->allreduce_only()) {
        const auto n = outs[i].numel();
        outs[i].view({-1}).copy_(sends[i].reshape({-1}).narrow(0, rank * n, n));
      }
      reds[i]->finish(outs[i], size);
    }
  };
  return run(std::move(call));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCCL::reduce_scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  const char* op = kReduceScatter.name;
  at::Tensor out = single(op, outputs);
  CCL_CHECK_ARG(
      inputs.size() == 1, "ccl ", op, ": expected one input list, got ", inputs.size());
  check_list(op, inputs[0], out, getSize(), "input_list");
  const int size = getSize();
  const int rank = getRank();
  auto red = resolve_reduction(op, opts.reduceOp, out.scalar_type());
  bool even = true;
  for (const auto& t : inputs[0]) {
    even = even && t.numel() == inputs[0][0].numel();
  }
  CCL_CHECK_ARG(
      inputs[0][rank].numel() == out.numel(), "ccl ", op, ": output has ", out.numel(),
      " elements but input_list[", rank, "] (this rank's share) has ", inputs[0][rank].numel());
  at::Tensor flat = flatten_copy(inputs[0]);
  red->scale_inplace(flat);
  // Uneven shares have no oneCCL primitive: reduce everything, keep ours.
  const bool via_allreduce = red->allreduce_only() || !even;
  int64_t offset = 0;
  for (int r = 0; r < rank; ++r) {
    offset += inputs[0][r].numel();
  }
  Call call{kReduceScatter, pick_timeout(opts.timeout, timeout_), inputs[0], {out}, {flat}};
  call.on_success = [red, flat, out, size, offset, via_allreduce]() mutable {
    if (via_allreduce) {
      out.view({-1}).copy_(flat.narrow(0, offset, out.numel()));
    }
    red->finish(out, size);
  };
  call.prims.push_back(
      via_allreduce ? reduction(K::Allreduce, ptr(flat), ptr(flat), red, red->count(flat))
                    : reduction(K::ReduceScatter, ptr(flat), ptr(out), red, red->count(out)));
  return run(std::move(call));
}

// ---- data movement (bytes, so every dtype works) ----------------------------

c10::intrusive_ptr<c10d::Work> ProcessGroupCCL::broadcast(
    std::vector<at::Tensor>& tensors,
    const c10d::BroadcastOptions& opts) {
  const char* op = kBroadcast.name;
  at::Tensor t = single(op, tensors, /*dense_ok=*/true);
  check_rank(op, "root rank", opts.rootRank, getSize());
  const int root = static_cast<int>(opts.rootRank);
  Call call{kBroadcast, pick_timeout(opts.timeout, timeout_), {t}, {t}};
  call.prims.push_back(bytes(K::Broadcast, ptr(t), ptr(t), nbytes(t), root));
  return run(std::move(call));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCCL::allgather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const char* op = kAllgather.name;
  const at::Tensor& in = single(op, inputs);
  CCL_CHECK_ARG(
      outputs.size() == 1, "ccl ", op, ": expected one output list, got ", outputs.size());
  const int rank = getRank();
  check_list(op, outputs[0], in, getSize(), "output_tensor_list");
  CCL_CHECK_ARG(
      outputs[0][rank].numel() == in.numel(), "ccl ", op, ": output_tensor_list[", rank,
      "] (this rank's slot) has ", outputs[0][rank].numel(), " elements but the input has ",
      in.numel(), " (invalid tensor size)");
  Call call{kAllgather, pick_timeout(opts.timeout, timeout_), inputs, outputs[0]};
  // Per-rank counts: uneven sizes gather straight into each output.
  Prim p = bytes(K::Allgatherv, ptr(in), nullptr, nbytes(in));
  p.recv_counts = byte_counts(outputs[0]);
  for (const auto& t : outputs[0]) {
    p.dst_list.push_back(ptr(t));
  }
  call.prims.push_back(std::move(p));
  return run(std::move(call));
}

// output_lists[r][i] receives rank r's inputs[i] (PyTorch's layout, as gloo).
c10::intrusive_ptr<c10d::Work> ProcessGroupCCL::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& output_lists,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const char* op = kAllgatherCoalesced.name;
  const int size = getSize();
  CCL_CHECK_ARG(!inputs.empty(), "ccl ", op, ": requires non-empty input tensor list");
  CCL_CHECK_ARG(
      static_cast<int>(output_lists.size()) == size, "ccl ", op, ": got ", output_lists.size(),
      " output lists; output lists should be equal to world size (", size,
      "), one per rank, each with one tensor per input");
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_tensor(op, inputs[i], "input_tensor_list[" + std::to_string(i) + "]");
  }
  std::vector<at::Tensor> flat_outputs;
  for (int r = 0; r < size; ++r) {
    const auto& list = output_lists[r];
    CCL_CHECK_ARG(
        list.size() == inputs.size(), "ccl ", op, ": output_tensor_lists[", r, "] has ",
        list.size(), " tensors; invalid output size: (expected length ", inputs.size(),
        ", got ", list.size(), ")");
    for (size_t i = 0; i < inputs.size(); ++i) {
      const auto name = "output_tensor_lists[" + std::to_string(r) + "][" + std::to_string(i) + "]";
      check_tensor(op, list[i], name);
      check_same_dtype(op, list[i], inputs[i], name);
      CCL_CHECK_ARG(
          list[i].sizes() == inputs[i].sizes(), "ccl ", op, ": ", name, " has shape ",
          list[i].sizes(), " but input_tensor_list[", i, "] has ", inputs[i].sizes(),
          " (invalid tensor size)");
    }
    flat_outputs.insert(flat_outputs.end(), list.begin(), list.end());
  }
  // One call for all inputs: pack them, gather, unpack per rank.
  at::Tensor send = pack_bytes(inputs, inputs[0].options());
  at::Tensor recv = at::empty({send.numel() * size}, send.options());
  Call call{kAllgatherCoalesced, pick_timeout(opts.timeout, timeout_), inputs, flat_outputs, {send, recv}};
  call.on_success = [recv, outs = flat_outputs]() mutable { unpack_bytes(recv, outs); };
  call.nested_outputs = output_lists;
  Prim p = bytes(K::Allgatherv, ptr(send), ptr(recv), nbytes(send));
  p.recv_counts.assign(size, nbytes(send));
  call.prims.push_back(std::move(p));
  return run(std::move(call));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCCL::_allgather_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::AllgatherOptions& opts) {
  std::vector<at::Tensor> outputs{output}, inputs{input};
  return allgather_into_tensor_coalesced(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCCL::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const int size = getSize();
  const OpInfo& info = check_pairs(
      kAllgatherBase, kAllgatherIntoTensorCoalesced, outputs, inputs, size,
      /*output_is_larger=*/true);
  Call call{info, pick_timeout(opts.timeout, timeout_), inputs, outputs};
  for (size_t i = 0; i < inputs.size(); ++i) {
    Prim p = bytes(K::Allgatherv, ptr(inputs[i]), ptr(outputs[i]), nbytes(inputs[i]));
    p.recv_counts.assign(size, nbytes(inputs[i]));
    call.prims.push_back(std::move(p));
  }
  return run(std::move(call));
}

// gather, scatter and the list alltoall all run as one alltoallv: a
// collective, so they never match a user's pending send/recv by mistake.
c10::intrusive_ptr<c10d::Work> ProcessGroupCCL::gather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  const char* op = kGather.name;
  const at::Tensor& in = single(op, inputs);
  const int size = getSize();
  check_rank(op, "root rank", opts.rootRank, size);
  const int root = static_cast<int>(opts.rootRank);
  auto outs = root_list(op, outputs, in, root, getRank(), size, "gather_list");
  std::vector<size_t> send_counts(size, 0);
  send_counts[root] = nbytes(in);
  auto recv_counts = outs.empty() ? std::vector<size_t>(size, 0) : byte_counts(outs);
  at::Tensor flat = at::empty({static_cast<int64_t>(total(recv_counts))}, in.options().dtype(at::kByte));
  Call call{kGather, pick_timeout(opts.timeout, timeout_), {in}, outs, {flat}};
  if (!outs.empty()) {
    call.on_success = [flat, outs]() mutable { unpack_bytes(flat, outs); };
  }
  call.prims.push_back(alltoallv(ptr(in), std::move(send_counts), ptr(flat), std::move(recv_counts)));
  return run(std::move(call));
}

#if OBPT_HAS_GATHER_SINGLE
// Into one flat tensor on the root (world size x input); others pass an empty one.
c10::intrusive_ptr<c10d::Work> ProcessGroupCCL::gather_single(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::GatherOptions& opts) {
  const char* op = kGatherSingle.name;
  const int size = getSize();
  check_rank(op, "root rank", opts.rootRank, size);
  const int root = static_cast<int>(opts.rootRank);
  check_tensor(op, input, "input");
  std::vector<size_t> send_counts(size, 0), recv_counts(size, 0);
  send_counts[root] = nbytes(input);
  if (getRank() == root) {
    check_tensor(op, output, "output");
    check_same_dtype(op, output, input, "output");
    CCL_CHECK_ARG(
        output.numel() == input.numel() * size, "ccl ", op, ": output has ", output.numel(),
        " elements; expected world size (", size, ") x input = ", input.numel() * size,
        " (output tensor size must be equal to world_size times input tensor size)");
    recv_counts.assign(size, nbytes(input));
  }
  Call call{kGatherSingle, pick_timeout(opts.timeout, timeout_), {input}, {output}};
  call.prims.push_back(alltoallv(ptr(input), std::move(send_counts), ptr(output), std::move(recv_counts)));
  return run(std::move(call));
}
#endif

#if OBPT_HAS_COMPLETION_HOOKS
void ProcessGroupCCL::registerCompletionHook(int64_t id, c10d::CompletionHook hook) {
  comm_->add_completion_hook(id, [hook = std::move(hook)](uint64_t key) {
    c10d::CompletionHookArgs args;
    args.completionKey = key;
    hook(args);
  });
}
#endif

c10::intrusive_ptr<c10d::Work> ProcessGroupCCL::scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  const char* op = kScatter.name;
  at::Tensor out = single(op, outputs);
  const int size = getSize();
  check_rank(op, "root rank", opts.rootRank, size);
  const int root = static_cast<int>(opts.rootRank);
  auto ins = root_list(op, inputs, out, root, getRank(), size, "scatter_list");
  auto send_counts = ins.empty() ? std::vector<size_t>(size, 0) : byte_counts(ins);
  std::vector<size_t> recv_counts(size, 0);
  recv_counts[root] = nbytes(out);
  at::Tensor flat = pack_bytes(ins, out.options());
  Call call{kScatter, pick_timeout(opts.timeout, timeout_), ins, {out}, {flat}};
  call.prims.push_back(alltoallv(ptr(flat), std::move(send_counts), ptr(out), std::move(recv_counts)));
  return run(std::move(call));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCCL::alltoall_base(
    at::Tensor& output,
    at::Tensor& input,
    std::vector<int64_t>& output_split_sizes,
    std::vector<int64_t>& input_split_sizes,
    const c10d::AllToAllOptions& opts) {
  const char* op = kAlltoallBase.name;
  check_tensor(op, input, "input");
  check_tensor(op, output, "output");
  check_same_dtype(op, output, input, "output");
  const int size = getSize();
  // Splits count rows along dim 0; the transports count bytes.
  auto counts = [&](const at::Tensor& t, const std::vector<int64_t>& splits, const char* what) {
    const int64_t rows = t.dim() > 0 ? t.size(0) : 1;
    const size_t row_bytes = rows > 0 ? nbytes(t) / rows : 0;
    std::vector<size_t> out(size);
    if (splits.empty()) {
      CCL_CHECK_ARG(
          rows % size == 0, "ccl ", op, ": ", what, " has ", rows,
          " rows in dim 0, not divisible by the group size ", size, "; pass split sizes");
      std::fill(out.begin(), out.end(), row_bytes * (rows / size));
      return out;
    }
    CCL_CHECK_ARG(
        static_cast<int>(splits.size()) == size, "ccl ", op, ": ", what, " split sizes have ",
        splits.size(), " entries; expected one per rank (", size, ")");
    int64_t total = 0;
    for (int r = 0; r < size; ++r) {
      CCL_CHECK_ARG(splits[r] >= 0, "ccl ", op, ": ", what, " split size ", splits[r], " is negative");
      total += splits[r];
      out[r] = row_bytes * splits[r];
    }
    CCL_CHECK_ARG(
        total == rows, "ccl ", op, ": ", what, " split sizes add up to ", total, " but dim 0 has ",
        rows, " rows (split sizes doesn't match total dim 0 size)");
    return out;
  };
  auto send_counts = counts(input, input_split_sizes, "input");
  auto recv_counts = counts(output, output_split_sizes, "output");
  Call call{kAlltoallBase, pick_timeout(opts.timeout, timeout_), {input}, {output}};
  call.prims.push_back(alltoallv(ptr(input), std::move(send_counts), ptr(output), std::move(recv_counts)));
  return run(std::move(call));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCCL::alltoall(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllToAllOptions& opts) {
  const char* op = kAlltoall.name;
  const int size = getSize();
  CCL_CHECK_ARG(
      static_cast<int>(inputs.size()) == size, "ccl ", op, ": input_tensor_list has ",
      inputs.size(), " tensors; expected one per rank (", size, ")");
  check_list(op, inputs, inputs[0], size, "input_tensor_list");
  check_list(op, outputs, inputs[0], size, "output_tensor_list");
  auto send_counts = byte_counts(inputs);
  auto recv_counts = byte_counts(outputs);
  at::Tensor send = pack_bytes(inputs, inputs[0].options());
  at::Tensor recv = at::empty({static_cast<int64_t>(total(recv_counts))}, send.options());
  Call call{kAlltoall, pick_timeout(opts.timeout, timeout_), inputs, outputs, {send, recv}};
  call.on_success = [recv, outs = outputs]() mutable { unpack_bytes(recv, outs); };
  call.prims.push_back(alltoallv(ptr(send), std::move(send_counts), ptr(recv), std::move(recv_counts)));
  return run(std::move(call));
}

// ---- point to point and barrier ----------------------------------------------

c10::intrusive_ptr<c10d::Work> ProcessGroupCCL::send(
    std::vector<at::Tensor>& tensors,
    int dst_rank,
    int tag) {
  const char* op = kSend.name;
  check_p2p_usable(op);
  at::Tensor t = single(op, tensors, /*dense_ok=*/true);
  check_rank(op, "destination rank", dst_rank, getSize());
  CCL_CHECK_ARG(dst_rank != getRank(), "ccl send: a rank cannot send to itself (rank ", dst_rank, ")");
  Call call{kSend, timeout_, {t}, {t}};
  // Shared memory honours tags; oneCCL matches messages between two ranks in order.
  call.prims.push_back(bytes(K::Send, ptr(t), nullptr, nbytes(t), dst_rank, tag));
  return run(std::move(call));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCCL::recv(
    std::vector<at::Tensor>& tensors,
    int src_rank,
    int tag) {
  const char* op = kRecv.name;
  check_p2p_usable(op);
  at::Tensor t = single(op, tensors, /*dense_ok=*/true);
  check_rank(op, "source rank", src_rank, getSize());
  CCL_CHECK_ARG(src_rank != getRank(), "ccl recv: a rank cannot receive from itself (rank ", src_rank, ")");
  Call call{kRecv, timeout_, {t}, {t}};
  call.prims.push_back(bytes(K::Recv, nullptr, ptr(t), nbytes(t), src_rank, tag));
  return run(std::move(call));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCCL::recvAnysource(
    std::vector<at::Tensor>& tensors,
    int tag) {
  const char* op = kRecvAnysource.name;
  if (comm_->shm()) {
    check_p2p_usable(op);
    at::Tensor t = single(op, tensors, /*dense_ok=*/true);
    Call call{kRecvAnysource, timeout_, {t}, {t}};
    call.prims.push_back(bytes(K::Recv, nullptr, ptr(t), nbytes(t), /*peer=*/-1, tag));
    return run(std::move(call));
  }
  // Across hosts oneCCL carries p2p, and it has no wildcard receive. The
  // message meant for this recv may already be queued; a later recv from its
  // sender would take it instead of the right one. So p2p stops here.
  p2p_disabled_.store(true, std::memory_order_release);
  CCL_CHECK_ARG(
      false,
      "ccl recv: receiving from any source (src=None) is not supported on a process group whose "
      "data goes through oneCCL (it spans hosts, or ONECCL_BIND_PT_SHM=0): oneCCL has no wildcard receive. Pass the sender's rank as src. Point-to-point "
      "ops on this group now raise, since a message sent for this recv may still be queued; "
      "collectives still work.");
  return {};
}

void ProcessGroupCCL::check_p2p_usable(const char* op) const {
  if (C10_UNLIKELY(p2p_disabled_.load(std::memory_order_acquire))) {
    C10_THROW_ERROR(
        DistBackendError,
        std::string("ccl ") + op +
            ": point-to-point ops are disabled on this process group after a recv from any source "
            "(src=None) was refused: a message sent for it may still be queued and would be "
            "received by the wrong recv. Create a new group for point-to-point traffic.");
  }
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCCL::barrier(const c10d::BarrierOptions& opts) {
  Call call{kBarrier, pick_timeout(opts.timeout, timeout_), {}, {}};
  call.prims.push_back(Prim{K::Barrier});
  return run(std::move(call));
}

} // namespace oneccl_bind_pt

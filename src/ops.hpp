// What the backend's op bodies share (process_group_ccl.cpp, collectives.cpp):
// each op's names (c10d's OpType, ours in messages, its profiler rows), the
// Call every op hands to ProcessGroupCCL::run, and the Prim builders.
#pragma once

#include "compat.hpp"
#include "process_group_ccl.hpp"
#include "reduce_ops.hpp"
#include "transport.hpp"
#include "work.hpp"

#include <chrono>
#include <functional>
#include <memory>
#include <vector>

namespace oneccl_bind_pt {

using c10d::OpType;

inline constexpr OpInfo kBroadcast{OpType::BROADCAST, "broadcast", "pg::broadcast", "ccl:broadcast"};
inline constexpr OpInfo kAllreduce{OpType::ALLREDUCE, "allreduce", "pg::allreduce", "ccl:all_reduce"};
inline constexpr OpInfo kAllreduceCoalesced{
    OpType::ALLREDUCE_COALESCED, "allreduce_coalesced", "pg::allreduce_coalesced", "ccl:all_reduce"};
// The first step of a sparse all_reduce (see allreduce_sparse).
inline constexpr OpInfo kSparseCounts{
    OpType::ALLGATHER, "allreduce (sparse: non-zero counts)", "pg::allreduce_sparse_counts",
    "ccl:allgather_sparse_counts"};
inline constexpr OpInfo kReduce{OpType::REDUCE, "reduce", "pg::reduce", "ccl:reduce"};
inline constexpr OpInfo kAllgather{OpType::ALLGATHER, "allgather", "pg::allgather", "ccl:all_gather"};
inline constexpr OpInfo kAllgatherBase{
    OpType::_ALLGATHER_BASE, "all_gather_single", "pg::all_gather_single", "ccl:all_gather_into_tensor"};
inline constexpr OpInfo kAllgatherCoalesced{
    OpType::ALLGATHER_COALESCED, "allgather_coalesced", "pg::allgather_coalesced", "ccl:all_gather"};
inline constexpr OpInfo kAllgatherIntoTensorCoalesced{
    compat::kAllgatherIntoTensorCoalesced, "all_gather_into_tensor_coalesced",
    "pg::all_gather_into_tensor_coalesced", "ccl:all_gather_into_tensor_coalesced"};
inline constexpr OpInfo kGather{OpType::GATHER, "gather", "pg::gather", "ccl:gather"};
inline constexpr OpInfo kGatherSingle{OpType::GATHER, "gather_single", "pg::gather_single", "ccl:gather"};
inline constexpr OpInfo kScatter{OpType::SCATTER, "scatter", "pg::scatter", "ccl:scatter"};
inline constexpr OpInfo kReduceScatter{OpType::REDUCE_SCATTER, "reduce_scatter", "pg::reduce_scatter", "ccl:reduce_scatter"};
inline constexpr OpInfo kReduceScatterBase{
    OpType::_REDUCE_SCATTER_BASE, "reduce_scatter_single", "pg::reduce_scatter_single", "ccl:reduce_scatter_tensor"};
inline constexpr OpInfo kReduceScatterTensorCoalesced{
    compat::kReduceScatterTensorCoalesced, "reduce_scatter_tensor_coalesced",
    "pg::reduce_scatter_tensor_coalesced", "ccl:reduce_scatter_tensor_coalesced"};
inline constexpr OpInfo kAlltoallBase{OpType::ALLTOALL_BASE, "all_to_all_single", "pg::all_to_all_single", "ccl:all_to_all"};
inline constexpr OpInfo kAlltoall{OpType::ALLTOALL, "alltoall", "pg::alltoall", "ccl:all_to_all"};
inline constexpr OpInfo kSend{OpType::SEND, "send", "pg::send", "ccl:send"};
inline constexpr OpInfo kRecv{OpType::RECV, "recv", "pg::recv", "ccl:recv"};
inline constexpr OpInfo kRecvAnysource{OpType::RECVANYSOURCE, "recv", "pg::recv", "ccl:recvAnySource"};
inline constexpr OpInfo kBarrier{OpType::BARRIER, "barrier", "pg::barrier", "ccl:barrier"};
inline constexpr OpInfo kCoalesced{OpType::COALESCED, "coalesced", "pg::coalesced", "ccl:coalesced"};

inline std::chrono::milliseconds pick_timeout(std::chrono::milliseconds requested, std::chrono::milliseconds group) {
  return requested == c10d::kUnsetTimeout ? group : requested;
}

using K = Prim::Kind;

// A data-movement Prim that counts bytes.
inline Prim bytes(K kind, const void* src, void* dst, size_t count, int peer = -1, int tag = 0) {
  Prim p{kind};
  p.src = src;
  p.dst = dst;
  p.count = count;
  p.peer = peer;
  p.tag = tag;
  return p;
}

// A reduction Prim over `count` elements of red's type.
inline Prim reduction(K kind, const void* src, void* dst, const std::shared_ptr<const Reduction>& red, size_t count, int root = -1) {
  Prim p = bytes(kind, src, dst, count, root);
  p.red = red;
  return p;
}

inline Prim alltoallv(const void* src, std::vector<size_t> send, void* dst, std::vector<size_t> recv) {
  Prim p{K::Alltoallv};
  p.src = src;
  p.dst = dst;
  p.send_counts = std::move(send);
  p.recv_counts = std::move(recv);
  return p;
}

struct ProcessGroupCCL::Call {
  const OpInfo& op;
  std::chrono::milliseconds timeout;
  std::vector<at::Tensor> inputs; // shown to the profiler
  std::vector<at::Tensor> outputs; // Work::result() and the Future's value
  std::vector<at::Tensor> buffers = {}; // scratch memory the transport uses
  // Pre-processing that reads or writes the caller's tensors (packing a list, PREMUL_SUM's
  // scaling): run() runs it once the ops before this one on the same memory completed.
  std::function<void()> prepare = nullptr;
  std::function<void()> on_success = nullptr;
  // Whether the op writes `outputs` (not a send's, a broadcast root's, a reduce's
  // non-root's): what later ops on them wait for (Progress::must_defer_locked).
  bool writes_outputs = true;
  std::vector<std::vector<at::Tensor>> nested_outputs = {}; // see WorkCCL::nested_outputs
  std::vector<Prim> prims = {}; // the communication, for the transport
};

} // namespace oneccl_bind_pt

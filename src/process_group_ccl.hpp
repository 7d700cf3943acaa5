// The c10d Backend. Every collective goes through one path, run(): validate
// and prepare in the caller's thread, issue non-blocking oneCCL calls under
// the progress lock, hand back a WorkCCL (see work.hpp).
#pragma once

#include "communicator.hpp"
#include "compat.hpp"
#include "work.hpp"

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <memory>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

namespace oneccl_bind_pt {

class ProcessGroupCCL : public c10d::Backend {
 public:
  // `numbered`: `store` is already this creation's keys (creation_keys), as Python's
  // construction takes them once for the package's defaults and the group alike.
  ProcessGroupCCL(
      const c10::intrusive_ptr<c10d::Store>& store,
      int rank,
      int size,
      std::chrono::milliseconds timeout,
      bool numbered = false);
  ~ProcessGroupCCL() override;
  // Refuses a bad rank or size, or a bad setting of this rank's own (ONECCL_BIND_PT_KERNELS,
  // _HELPERS, _SHM_CHUNK_BYTES, ...), and tells the other ranks creating the group on `keys`
  // (this creation's): before the package's defaults, whose exchanges with those ranks would
  // otherwise wait for this one.
  static void check_own_settings(const c10::intrusive_ptr<c10d::Store>& keys, int rank, int size);

  const std::string getBackendName() const override { return "ccl"; }
  c10::intrusive_ptr<Options> getBackendOptions() override;
  void setTimeout(std::chrono::milliseconds timeout) override { timeout_ = timeout; }
  bool supportsCoalescing() const override { return true; }
  // TORCH_DISTRIBUTED_DEBUG=DETAIL wraps the backend and compares these across
  // ranks before every collective. Like gloo's, they start at 0 on every rank
  // and count every op issued.
  void setSequenceNumberForGroup() override {}
#if OBPT_HAS_COMPLETION_HOOKS
  bool supportsCompletionHooks() const override { return true; }
  void registerCompletionHook(int64_t id, c10d::CompletionHook hook) override;
  void unregisterCompletionHook(int64_t id) override { comm_->remove_completion_hook(id); }
#endif
  // abort(): every op in flight fails with a DistBackendError that says so,
  // at once; the group is unusable after it. shutdown(): waits for the ops in
  // flight (at most the group's timeout, then aborts them); unusable after it.
  void abort() override;
  void shutdown() override;
#if OBPT_HAS_ABORT_HOOKS
  // Called when an op's timeout or failure breaks the group (Communicator).
  void registerAbortHook(int64_t id, c10d::AbortHook hook) override { comm_->add_abort_hook(id, std::move(hook)); }
  void unregisterAbortHook(int64_t id) override { comm_->remove_abort_hook(id); }
#endif
#if OBPT_HAS_SUPPORTS_ABORT_HOOKS
  bool supportsAbortHooks() const override { return true; }
#endif
#if OBPT_HAS_SHRINK
  // shrink(): a new group of the ranks not excluded, made over the same
  // Store (torch.distributed.shrink_group); SHRINK_ABORT aborts this group's
  // ops first. On one host, excluding a rank whose process still runs raises.
  bool supportsShrinking() const override { return true; }
  c10::intrusive_ptr<c10d::Backend> shrink(
      const std::vector<int64_t>& ranks_to_exclude,
      int shrink_flags = 0,
      const c10::intrusive_ptr<Options>& opts_override = nullptr) override;
#endif
  // split(): torch's ProcessGroup::splitGroup (torch.distributed.split_group)
  // hands each rank the ranks of its new group, in new-rank order, and a
  // store namespaced for that group; a rank outside them gets no backend.
  bool supportsSplitting() const override { return true; }
  c10::intrusive_ptr<c10d::Backend> split(
      const c10::intrusive_ptr<c10d::Store>& store,
      const std::vector<int>& ranks,
      const c10::intrusive_ptr<Options>& opts) override;
  uint64_t getSequenceNumberForGroup() override { return seq_.load(std::memory_order_relaxed); }
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;

  c10::intrusive_ptr<c10d::Work> broadcast(
      std::vector<at::Tensor>& tensors,
      const c10d::BroadcastOptions& opts = c10d::BroadcastOptions()) override;
  c10::intrusive_ptr<c10d::Work> allreduce(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts = c10d::AllreduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts = c10d::AllreduceCoalescedOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce(
      std::vector<at::Tensor>& tensors,
      const c10d::ReduceOptions& opts = c10d::ReduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> gather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::GatherOptions& opts = c10d::GatherOptions()) override;
#if OBPT_HAS_GATHER_SINGLE
  c10::intrusive_ptr<c10d::Work> gather_single(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::GatherOptions& opts = c10d::GatherOptions()) override;
#endif
  c10::intrusive_ptr<c10d::Work> scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ScatterOptions& opts = c10d::ScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(
      at::Tensor& output,
      at::Tensor& input,
      std::vector<int64_t>& output_split_sizes,
      std::vector<int64_t>& input_split_sizes,
      const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;
  c10::intrusive_ptr<c10d::Work> alltoall(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;
  c10::intrusive_ptr<c10d::Work> send(
      std::vector<at::Tensor>& tensors,
      int dst_rank,
      int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(
      std::vector<at::Tensor>& tensors,
      int src_rank,
      int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(
      std::vector<at::Tensor>& tensors,
      int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(
      const c10d::BarrierOptions& opts = c10d::BarrierOptions()) override;

  // For the benchmark's raw-oneCCL baseline (raw.cpp).
  const std::shared_ptr<Communicator>& communicator() const { return comm_; }
  // Which transport ("shm" or "oneccl") a collective of `kind` moving
  // `nbytes` per rank takes on this group (for the doctor and the tests).
  std::string path(const std::string& kind, size_t nbytes) const;
  std::string single_copy_status() const;
  // The chunk a staged step moves per rank on this group, and why ("256 KiB: ...").
  std::string staging_chunk() const;

 private:
  struct Call;
  c10::intrusive_ptr<c10d::Work> run(Call&& call);
  // run()'s start of an op that need not wait: its pre-processing, then its Prims.
  void start_now(const c10::intrusive_ptr<WorkCCL>& work, Call& call);

  c10::intrusive_ptr<c10d::Work> allreduce_sparse(at::Tensor& tensor, const c10d::AllreduceOptions& opts);

  c10::intrusive_ptr<c10d::Store> store_; // the group's, for the groups shrink() makes
  std::shared_ptr<Communicator> comm_;
  std::chrono::milliseconds timeout_;
  int shrinks_ = 0; // every survivor shrinks in the same order: their new groups' keys agree

  std::atomic<uint64_t> seq_{0};
  // Coalescing (batch_isend_irecv, _coalescing_manager) collects the ops of the
  // thread that started it: torch 2.15's _abort_process_group() coalesces its
  // aborts on one thread while another may still be issuing ops (unguarded,
  // the two raced on this list: SIGSEGV or SIGABRT in 4 of 40 abort trials).
  std::mutex coalesce_mutex_;
  struct Block {
    uint64_t id = 0; // WorkCCL::block_ of its ops
    std::vector<c10::intrusive_ptr<WorkCCL>> works;
  };
  std::map<std::thread::id, Block> coalescing_; // under coalesce_mutex_
  std::atomic<size_t> coalescers_{0}; // coalescing_.size(), read without the lock
};

} // namespace oneccl_bind_pt

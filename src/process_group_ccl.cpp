#include "process_group_ccl.hpp"

#include "checks.hpp"
#include "errors.hpp"
#include "dtypes.hpp"
#include "helpers.hpp"
#include "kernels.hpp"
#include "ops.hpp"
#include "reduce_ops.hpp"
#include "rendezvous.hpp"
#include "shm.hpp"
#include "tensor_bytes.hpp"

#include <ATen/ATen.h>
#include <Python.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <thread>

namespace oneccl_bind_pt {

namespace {

// Runs `check`; what it throws is announced to the group's other ranks, then rethrown.
template <class Fn>
void told_if_throws(const c10::intrusive_ptr<c10d::Store>& store, int rank, Fn check) {
  try {
    check();
  } catch (const c10::Error& e) {
    announce_failure(store, rank, e.what_without_backtrace());
    throw;
  } catch (const std::exception& e) {
    announce_failure(store, rank, e.what());
    throw;
  }
}

std::shared_ptr<Communicator> checked_communicator(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    std::chrono::milliseconds timeout) {
  // This rank's own choices first: an unknown ONECCL_BIND_PT_KERNELS/_COPY/_HELPERS, a bad
  // ONECCL_BIND_PT_SHM_CHUNK_BYTES or oneCCL failing to initialize raises here, before the
  // rendezvous, not later inside a collective. The other ranks are told, so that a mistake
  // on one rank fails them all at once rather than after the group's timeout.
  told_if_throws(store, rank, [] {
    kernels();
    helper_plan();
    ShmLimits::from_env();
    ensure_ccl_initialized();
  });
  return std::make_shared<Communicator>(store, rank, size, timeout);
}

} // namespace

ProcessGroupCCL::ProcessGroupCCL(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    std::chrono::milliseconds timeout,
    bool numbered)
    : c10d::Backend(rank, size),
      store_(numbered ? store : creation_keys(store, rank)),
      comm_(checked_communicator(store_, rank, size, timeout)),
      timeout_(timeout) {}

ProcessGroupCCL::~ProcessGroupCCL() = default;

void ProcessGroupCCL::check_own_settings(const c10::intrusive_ptr<c10d::Store>& keys, int rank, int size) {
  // What can be refused before the package's defaults are set: nothing here reads them, nor
  // chooses what depends on them (the helper count, from CCL_LOCAL_SIZE and CCL_WORKER_COUNT).
  told_if_throws(keys, rank, [rank, size] {
    CCL_CHECK_ARG(size > 0 && rank >= 0 && rank < size, "ccl: invalid rank ", rank, " for a process group of size ",
                  size);
    kernels();
    check_helper_settings();
    ShmLimits::asked_chunk_bytes();
  });
}

void ProcessGroupCCL::abort() {
  if (comm_->inherited()) {
    return; // the parent's group: nothing of it to stop here, and its store is the parent's
  }
  const AbortInProgress in_progress; // the interpreter's exit waits for it (settle_aborts)
  // A drain with no time to wait: whether this group has ops in flight.
  // (Not starting ops that waited for earlier ones: they fail with the group.)
  const bool ops_in_flight = !Progress::get().drain(*comm_, Clock::now(), /*start=*/false);
  comm_->abort(ops_in_flight);
  Progress::get().sweep(); // fails the ops nobody is waiting on too
}

void ProcessGroupCCL::shutdown() {
  if (comm_->inherited()) {
    return; // destroy_process_group() in a forked child leaves the parent's group alone
  }
  // A group that already failed (a peer died, an op timed out) is not drained:
  // progressing its other ops would only take this rank back into oneCCL with
  // a dead peer, where (measured, under load) a survivor spun for good or died
  // of SIGABRT. They fail at once instead.
  if (comm_->broken() || !Progress::get().drain(*comm_, Clock::now() + timeout_)) {
    comm_->abort(true);
    Progress::get().sweep();
  }
  comm_->unlink_segments_of_dead_peers(); // before the mark: only a group broken by a failure
  comm_->mark_broken("shutdown() was called on it");
  // An abort hook still running on its own thread (torch 2.15's
  // FlightRecorderHook writing its trace) must not have the group torn down
  // under it. It may need the GIL, which our caller may hold.
  PyThreadState* saved = Py_IsInitialized() && PyGILState_Check() ? PyEval_SaveThread() : nullptr;
  wait_for_abort_hooks(std::chrono::seconds(15));
  // This rank's own threads may hold Works of the group for a moment more: a completion job
  // letting go of a Future's callbacks (a Python closure may refer to Works: it is freed
  // there, with the GIL, which is why it is released here), a sweep letting go of the Works it
  // completed. The last of them would tear the group down on that thread after this returned,
  // with the process free to exit under it (measured: 1 teardown in 7 in a callback test; the
  // cut requests then killed rank 0's key-value store server, see Communicator's tear_down).
  // Given a moment, the group's last reference goes with the caller's. (Works the caller still
  // holds keep it, as they should. Inside a callback, its own job would count.)
  if (!Callbacks::in_job()) {
    const auto until = Clock::now() + std::chrono::seconds(2);
    while (comm_.use_count() > 1 && comm_->internal_holds()->load(std::memory_order_acquire) > 0 &&
           Clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  if (saved) {
    PyEval_RestoreThread(saved);
  }
}

#if OBPT_HAS_SHRINK
c10::intrusive_ptr<c10d::Backend> ProcessGroupCCL::shrink(
    const std::vector<int64_t>& ranks_to_exclude,
    int shrink_flags,
    const c10::intrusive_ptr<Options>& opts_override) {
  constexpr int kShrinkAbort = 0x01; // torch.distributed.SHRINK_ABORT
  std::vector<bool> excluded(size_, false);
  std::string names;
  for (const auto r : ranks_to_exclude) {
    CCL_CHECK_ARG(r >= 0 && r < size_ && r != rank_, "ccl shrink: rank ", r,
                  " cannot be excluded by rank ", rank_, " of a group of ", size_);
    excluded[r] = true;
    names += (names.empty() ? "" : ",") + std::to_string(r);
    if (comm_->shm()) {
      if (const int pid = comm_->shm()->running_peer_pid(static_cast<int>(r))) {
        C10_THROW_ERROR(
            DistBackendError,
            "ccl shrink: rank " + std::to_string(r) + " (pid " + std::to_string(pid) +
                ") is still running; a group sheds ranks that died or are stopped, so end that "
                "process first or keep it in the group");
      }
    }
  }
  if (shrink_flags & kShrinkAbort) {
    abort();
  }
  int new_rank = 0;
  int new_size = 0;
  for (int r = 0; r < size_; ++r) {
    if (!excluded[r]) {
      new_rank += r < rank_;
      ++new_size;
    }
  }
  auto store = c10::make_intrusive<c10d::PrefixStore>(
      "oneccl_bind_pt/shrink/" + std::to_string(shrinks_++) + "/without/" + names, store_);
  return c10::make_intrusive<ProcessGroupCCL>(
      store, new_rank, new_size, opts_override ? opts_override->timeout : timeout_);
}
#endif

c10::intrusive_ptr<c10d::Backend> ProcessGroupCCL::split(
    const c10::intrusive_ptr<c10d::Store>& store,
    const std::vector<int>& ranks,
    const c10::intrusive_ptr<Options>& opts) {
  for (const int r : ranks) {
    CCL_CHECK_ARG(r >= 0 && r < size_, "ccl split: rank ", r, " is not a rank of the group being split (size ",
                  size_, ")");
  }
  const auto me = std::find(ranks.begin(), ranks.end(), rank_);
  if (me == ranks.end()) {
    return nullptr;
  }
  return c10::make_intrusive<ProcessGroupCCL>(
      store, static_cast<int>(me - ranks.begin()), static_cast<int>(ranks.size()), opts ? opts->timeout : timeout_);
}

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
      return comm_->shm() ? comm_->shm()->path(k, nbytes) : route_name(Route::OneCCL);
    }
  }
  CCL_CHECK_ARG(false, "ccl: unknown collective '", kind, "'; expected allreduce, reduce, broadcast, "
                "allgather, alltoall, reduce_scatter, send, recv or barrier");
  return {};
}

std::string ProcessGroupCCL::single_copy_status() const {
  return comm_->shm() ? comm_->shm()->single_copy_status() : "off: no shared memory on this group";
}

std::string ProcessGroupCCL::staging_chunk() const {
  const Shm* shm = comm_->shm();
  if (!shm) {
    return "none: no shared memory on this group";
  }
  // Single copy's reduce windows, where they are not the chunk (a crowded host).
  return shm->chunk_status() +
      (shm->window_bytes() == shm->chunk_bytes() ? "" : "; single copy's reduce windows " + shm->window_status());
}

// The one path every op takes: a Work, its Prims started on the group's
// transport, and, when they finish at once (small ops on shared memory
// often do), completion without a trip through the progress engine.
c10::intrusive_ptr<c10d::Work> ProcessGroupCCL::run(Call&& call) {
  if (comm_->inherited()) {
    C10_THROW_ERROR(DistBackendError, std::string("ccl ") + call.op.name +
                                          ": this process group cannot be used here: " + comm_->broken_reason());
  }
  if (comm_->broken()) {
    // DistBackendError, as for the failure itself: code that catches it to shrink or restart
    // catches the refusals of later ops too.
    C10_THROW_ERROR(DistBackendError, std::string("ccl ") + call.op.name +
                                          ": this process group is unusable after an earlier failure: " +
                                          comm_->broken_reason());
  }
  auto& progress = Progress::get();
  // Ops on the same memory take effect in issue order, as on one CUDA stream: oneCCL runs the
  // ops in flight together, and pre- and post-processing (packing, PREMUL_SUM's scaling,
  // AVG's division) run beside the transport. So an op whose memory an earlier one in flight
  // shares is deferred (Progress starts it once that one completed, and every later op of the
  // group behind it); ops on other memory overlap as before.
  MemoryUse use;
  use.read(call.inputs);
  if (call.writes_outputs) {
    use.write(call.outputs);
  }
  use.p2p = call.op.type == OpType::SEND || call.op.type == OpType::RECV || call.op.type == OpType::RECVANYSOURCE;
  auto work = c10::make_intrusive<WorkCCL>(
      call.op, comm_, call.inputs, std::move(call.outputs), call.timeout);
  seq_.fetch_add(1, std::memory_order_relaxed);
  work->buffers = std::move(call.buffers);
  work->buffers.insert(work->buffers.end(), call.inputs.begin(), call.inputs.end());
  work->on_success = std::move(call.on_success);
  work->nested_outputs = std::move(call.nested_outputs);
  work->memory = std::move(use);
  Block* block = nullptr; // a coalescing block's ops run together (NCCL's group): no waits among them
  if (coalescers_.load(std::memory_order_acquire) > 0) { // every op reads this: no lock when nobody coalesces
    std::lock_guard<std::mutex> lock(coalesce_mutex_);
    if (const auto it = coalescing_.find(std::this_thread::get_id()); it != coalescing_.end()) {
      block = &it->second; // this thread's until its endCoalescing
      work->block_ = block->id;
    }
  }
  bool deferred = false;
  {
    std::lock_guard<std::mutex> lock(progress.ccl_mutex());
    deferred = progress.must_defer_locked(*comm_, work->memory, work->block_);
    if (deferred) {
      work->prepare = std::move(call.prepare);
      work->deferred_prims = std::move(call.prims);
      progress.defer(work);
    }
  }
  if (!deferred) {
    start_now(work, call);
  }
  if (block) {
    std::lock_guard<std::mutex> lock(coalesce_mutex_);
    block->works.push_back(work);
  }
  return work;
}

void ProcessGroupCCL::start_now(const c10::intrusive_ptr<WorkCCL>& work, Call& call) {
  auto& progress = Progress::get();
  if (call.prepare) {
    call.prepare();
  }
  bool finished = false;
  {
    std::lock_guard<std::mutex> lock(progress.ccl_mutex());
    const IssuerScope issued_by(work->issuer_); // this thread, as the Work was made here
    work->pending = comm_->start(call.op.name, std::move(call.prims));
    // Not at once behind an earlier collective of this group and lane: oneCCL can finish a
    // small op before a large one issued earlier, and its Future's callbacks would run first.
    finished = !progress.behind_another_locked(*work) && work->poll_locked(Clock::now());
    if (!finished) {
      progress.track(work);
    } else if (work->expired_) {
      progress.abandon(work); // failed at once (a peer already gone): oneCCL may still hold it
    }
  }
  if (finished) {
    work->complete();
  }
}

void ProcessGroupCCL::startCoalescing() {
  std::lock_guard<std::mutex> lock(coalesce_mutex_);
  // A block an op raised in (a refused tensor in batch_isend_irecv) never reached its
  // endCoalescing: its ops were issued one by one and stand on their own; start afresh.
  static std::atomic<uint64_t> blocks{0};
  coalescing_[std::this_thread::get_id()] = Block{blocks.fetch_add(1, std::memory_order_relaxed) + 1, {}};
  coalescers_.store(coalescing_.size(), std::memory_order_release);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCCL::endCoalescing() {
  std::vector<c10::intrusive_ptr<WorkCCL>> parts;
  {
    std::lock_guard<std::mutex> lock(coalesce_mutex_);
    const auto it = coalescing_.find(std::this_thread::get_id());
    TORCH_CHECK(it != coalescing_.end(), "ccl: endCoalescing called without startCoalescing on this thread");
    parts = std::move(it->second.works);
    coalescing_.erase(it);
    coalescers_.store(coalescing_.size(), std::memory_order_release);
  }
  std::vector<at::Tensor> outputs;
  for (const auto& part : parts) {
    outputs.insert(outputs.end(), part->outputs_.begin(), part->outputs_.end());
  }
  auto work = c10::make_intrusive<WorkCCL>(kCoalesced, comm_, std::vector<at::Tensor>{}, outputs, timeout_);
  work->parts = std::move(parts);
  std::lock_guard<std::mutex> lock(Progress::get().ccl_mutex());
  Progress::get().track(work);
  return work;
}

#if OBPT_HAS_COMPLETION_HOOKS
void ProcessGroupCCL::registerCompletionHook(int64_t id, c10d::CompletionHook hook) {
  comm_->add_completion_hook(id, [hook = std::move(hook)](uint64_t key) {
    c10d::CompletionHookArgs args;
    args.completionKey = key;
    hook(args);
  });
}
#endif

// ---- point to point and barrier ----------------------------------------------

c10::intrusive_ptr<c10d::Work> ProcessGroupCCL::send(
    std::vector<at::Tensor>& tensors,
    int dst_rank,
    int tag) {
  const char* op = kSend.name;
  at::Tensor t = single(op, tensors, /*dense_ok=*/true);
  check_p2p_layout(op, t);
  check_rank(op, "destination rank", dst_rank, getSize());
  CCL_CHECK_ARG(dst_rank != getRank(), "ccl send: a rank cannot send to itself (rank ", dst_rank, ")");
  Call call{kSend, timeout_, {t}, {t}};
  call.writes_outputs = false;
  // Shared memory honours tags; oneCCL has none: it pairs a peer's sends and recvs by order,
  // which its transport keeps by handing them over one at a time per line (P2pTurn).
  call.prims.push_back(bytes(K::Send, ptr(t), nullptr, nbytes(t), dst_rank, tag));
  return run(std::move(call));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCCL::recv(
    std::vector<at::Tensor>& tensors,
    int src_rank,
    int tag) {
  const char* op = kRecv.name;
  at::Tensor t = single(op, tensors, /*dense_ok=*/true);
  check_p2p_layout(op, t);
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
    at::Tensor t = single(op, tensors, /*dense_ok=*/true);
    check_p2p_layout(op, t);
    Call call{kRecvAnysource, timeout_, {t}, {t}};
    call.prims.push_back(bytes(K::Recv, nullptr, ptr(t), nbytes(t), /*peer=*/-1, tag));
    return run(std::move(call));
  }
  // Across hosts oneCCL carries p2p, and it has no wildcard receive. The refusal
  // comes before anything is posted, so the group is as it was: a message sent for
  // this recv stays queued for the next recv from its sender (oneCCL keeps the
  // messages between two ranks in order), which is where a retry with src= finds it.
  CCL_CHECK_ARG(
      false,
      "ccl recv: receiving from any source (src=None) is not supported on a process group whose "
      "data goes through oneCCL (it spans hosts, or ONECCL_BIND_PT_SHM=0): oneCCL has no wildcard "
      "receive. Pass the sender's rank as src; nothing was received, and a message already sent "
      "to this rank waits for the next recv from its sender.");
  return {};
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCCL::barrier(const c10d::BarrierOptions& opts) {
  Call call{kBarrier, pick_timeout(opts.timeout, timeout_), {}, {}};
  call.prims.push_back(Prim{K::Barrier});
  return run(std::move(call));
}

} // namespace oneccl_bind_pt

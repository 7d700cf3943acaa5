// The work object and the progress engine that completes it.
//
// A WorkCCL lives through three phases, as ProcessGroupGloo's AsyncWork does:
//  1. issue: the backend checks and prepares inputs in the caller's thread
//     and starts the op on its group's transport (transport.hpp), which hands
//     back a Pending the Work holds; a small op often completes right there;
//  2. progress: with oneCCL's worker thread off (our default, see
//     oneccl_bind_pt/_env.py) an operation only advances while someone polls
//     its Pending: the thread in wait(), or the background thread of Progress
//     once a Future was handed out;
//  3. complete: post-processing runs (copy-out, averaging), then the Work is
//     marked done, or failed with the error, and its Future's completion is
//     handed to Callbacks (user callbacks never run on a progressing thread).
#pragma once

#include "callbacks.hpp"
#include "communicator.hpp"
#include "compat.hpp"
#include "helpers.hpp"
#include "transport.hpp"

#include <ATen/core/ivalue.h>
#include <oneapi/ccl.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace oneccl_bind_pt {

using Clock = std::chrono::steady_clock;

// Names one kind of collective in messages and in the profiler. An op shows
// up as two profiler rows: our own ("pg::allreduce", which users and our
// tests look for) and the one every c10d backend emits ("ccl:all_reduce",
// spelled as gloo's "gloo:all_reduce" and nccl's "nccl:all_reduce"), which
// PyTorch's tests and tools find by "<backend>:<collective>".
struct OpInfo {
  c10d::OpType type;
  const char* name;          // "allreduce", in error messages
  const char* title;         // "pg::allreduce", the Work's own profiler row
  const char* backend_title; // "ccl:all_reduce", c10d's convention
};

// The memory an op reads and writes: address ranges of its tensors, so that an op issued
// later on the same memory starts after it (Progress::must_defer_locked), as ops on one CUDA
// stream do.
struct MemoryUse {
  struct Span {
    uintptr_t lo, hi; // [lo, hi)
  };
  std::vector<Span> reads, writes;
  bool p2p = false; // a send or recv

  void read(const std::vector<at::Tensor>& tensors) { add(reads, tensors); }
  void write(const std::vector<at::Tensor>& tensors) { add(writes, tensors); }
  // Whether `later` (issued after this) must wait for this: it writes what this reads or
  // writes, or reads what this writes. Sends and recvs among themselves do not wait: they
  // pair with their peers' in their own order (a rank's isend and irecv of one buffer were
  // concurrent before, and a peer doing the same would otherwise wait on it for good).
  bool must_precede(const MemoryUse& later) const;

 private:
  static void add(std::vector<Span>& spans, const std::vector<at::Tensor>& tensors);
};

class WorkCCL : public c10d::Work {
 public:
  WorkCCL(
      const OpInfo& op,
      std::shared_ptr<Communicator> comm,
      const std::vector<at::Tensor>& inputs,
      std::vector<at::Tensor> outputs,
      std::chrono::milliseconds timeout);
  ~WorkCCL() override;

  bool isCompleted() override;
  bool isSuccess() const override;
  int sourceRank() const override { return source_rank_; }
#if OBPT_HAS_WORK_TIMEOUT
  std::chrono::milliseconds getTimeout() const override { return timeout_; }
#endif
#if OBPT_HAS_COMPLETION_HOOKS
  uint64_t getCompletionKey() const override { return key_; }
#endif
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void synchronize() override {}
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  std::vector<at::Tensor> result() override;

  const OpInfo& op() const { return op_; }

  // Filled while the op is issued (phase 1).
  std::unique_ptr<Pending> pending; // what the transport has in flight
  std::vector<at::Tensor> buffers; // memory the transport reads or writes, kept alive until done
  std::function<void()> on_success; // phase 3 post-processing
  std::vector<c10::intrusive_ptr<WorkCCL>> parts; // a coalesced Work completes with its parts
  // When set, the Future carries these lists (List[List[Tensor]]) instead of the
  // flat list, as gloo's does for all_gather_coalesced (whose result() refuses them).
  std::vector<std::vector<at::Tensor>> nested_outputs;
  MemoryUse memory; // the caller's tensors it reads and writes (Progress::must_defer_locked)
  // An op issued behind an earlier one on the same memory: what Progress starts once it may
  // (its pre-processing, then its Prims).
  std::function<void()> prepare;
  std::vector<Prim> deferred_prims;
  uint64_t block_ = 0; // its coalescing block (0: none): the block's ops do not wait for each other

 private:
  friend class Progress;
  friend class ProcessGroupCCL; // completes ops that finish while being issued

  // `profiled`: whether a profiler listens, asked once per op (the question
  // costs about 50 ns, about as much as the rest of issuing a small op's Work).
  WorkCCL(
      const OpInfo& op,
      std::shared_ptr<Communicator> comm,
      const std::vector<at::Tensor>& inputs,
      std::vector<at::Tensor> outputs,
      std::chrono::milliseconds timeout,
      bool profiled);

  // Polls the Pending; true once nothing is in flight any more (done,
  // failed or expired). Called with Progress's lock held.
  bool poll_locked(Clock::time_point now);
  // Phase 3; runs without the lock since Future callbacks may issue new ops.
  void complete();
  std::string describe() const;
  c10::IValue future_value() const;

  const OpInfo op_;
  std::shared_ptr<Communicator> comm_;
  std::vector<at::Tensor> outputs_;
  const int64_t numel_;
  const std::chrono::milliseconds timeout_;
  Clock::time_point deadline_; // from its start: a deferred op's is set when it starts
  int source_rank_ = -1;
  std::exception_ptr error_; // set by poll_locked, consumed by complete
  bool expired_ = false;
  bool broke_group_ = false; // its failure broke the group: the abort hooks run before it completes
  std::string timed_out_;    // its timeout broke the group: the error, which complete() extends
  std::atomic<bool> done_{false};
  // getFuture() was called (Progress's sweep reads it without the future's lock).
  std::atomic<bool> has_future_{false};
  // The "ccl:<collective>" row while a profiler listens: started at issue,
  // ended at completion (maybe on another thread, hence async), like the
  // Work's own row that c10d::Work keeps for `title`.
  std::function<void()> end_backend_event_;
  const Callbacks::Lane lane_; // where the Future's callbacks run
  const uint64_t key_;          // unique per Work: the completion hooks' key
  bool in_completing_ = false; // its key is in Progress::completing_ until complete() posted
  bool in_finishing_ = false;  // in Progress::finishing_ until complete() is done with it
  bool starting_ = false;      // deferred, and being started by some thread
  std::shared_ptr<std::atomic<int>> job_ops_; // issued inside a callback: that job's count of ops in flight
  const pid_t issuer_ = current_issuer(); // the thread that issued it (idle helpers: helpers.hpp)
  void done_in_job();
  // Shared with the completion job, which holds this and not the Work: a job that held the
  // Work could hold its group's last reference, and tear the group down on a callback thread
  // after destroy_process_group() returned, while the process exits under it (measured: the
  // peer's key-value store server died of the reset connection).
  struct FutureSync {
    std::mutex mutex;
    // Under mutex: the Future is completed and its callbacks have run. wait() waits for it,
    // as gloo's does (it completes the Future, running its callbacks, before the Work).
    bool settled = false;
    std::condition_variable cv;
  };
  const std::shared_ptr<FutureSync> sync_ = std::make_shared<FutureSync>();
  c10::intrusive_ptr<c10::ivalue::Future> future_; // made on first getFuture(), under sync_->mutex
  // wait()'s second half: the Future, if one was handed out (bounded by `limit`).
  void wait_for_future(Clock::time_point limit);
};

// Process-wide: one lock around every oneCCL call, the list of in-flight
// Works, and a background thread that keeps them moving while a Future is
// outstanding and nobody is blocked in wait().
class Progress {
 public:
  static Progress& get();
  // In a forked child: the next get() makes a fresh one. The parent's copy is left as it is
  // (never freed): a thread the child does not have may hold its lock, and its Works belong
  // to the parent's groups.
  static void forget_in_child();

  std::mutex& ccl_mutex() { return mutex_; }
  // complete() has posted a finished collective's Future completion: the next collective of
  // its group and lane may complete (sweep()).
  void posted(const Communicator* comm, Callbacks::Lane lane);
  // Caller holds ccl_mutex().
  void track(c10::intrusive_ptr<WorkCCL> work);
  // Caller holds ccl_mutex(). Whether `work`, a collective, must complete after another of its
  // group and lane that is still in flight or completing (sweep()'s issue order).
  bool behind_another_locked(const WorkCCL& work) const;
  // Caller holds ccl_mutex(). Whether an op of `comm` using memory `use` must start later
  // (defer()): an earlier op of the group that must precede it (MemoryUse::must_precede) is in
  // flight or completing (its post-processing, such as averaging or copy-out, included), or
  // an earlier op is deferred already (ops start in issue order, as oneCCL needs on every
  // rank). `block`: its coalescing block (0: none), whose ops run together with it.
  bool must_defer_locked(const Communicator& comm, const MemoryUse& use, uint64_t block) const;
  // Caller holds ccl_mutex(). Keeps `work` (its prepare and deferred_prims set) to start
  // once it may: the next sweep() after the ops it waits for completed.
  void defer(c10::intrusive_ptr<WorkCCL> work);
  // Caller holds ccl_mutex(). A Work that expired (failed, timed out or was
  // aborted) while oneCCL may still use its op: kept for good, with its
  // buffers and its oneCCL events. oneCCL's event destructor waits for its
  // op, which after a peer's death never ends: measured, freeing one spun
  // for good or died of SIGABRT inside that wait.
  void abandon(c10::intrusive_ptr<WorkCCL> work);
  // One pass over every in-flight Work; completes the ones that finished, and starts deferred
  // ones that may start (unless `start` is false). Returns whether anything moved: a Work
  // finished or started, or a transport moved one on (or cannot tell).
  bool sweep(bool start = true);
  // Progresses until no Work of `comm` is in flight or deferred (true), or until
  // `deadline` (false).
  bool drain(const Communicator& comm, Clock::time_point deadline, bool start = true);
  // Starts the thread that completes Futures if it is not running (what getFuture() calls
  // before it makes a Future); where no thread can be started, the reason, else empty.
  std::string need_background();
  // A Future handed out for an unfinished Work: the background thread keeps
  // progressing while any is outstanding (its owner may never call wait()).
  void watch_future();
  void unwatch_future() { watched_.fetch_sub(1); }
  void shutdown();

  // Threads inside WorkCCL::wait(); they drive progress themselves.
  std::atomic<int> waiters{0};
  void waiter_left();

 private:
  Progress() = default;
  void background_loop();

  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<c10::intrusive_ptr<WorkCCL>> inflight_;
  // (group, lane) of collectives taken out of inflight_ whose complete() has not yet posted
  // their Futures' completions: later collectives of the same key wait for it (sweep()).
  std::vector<std::pair<const Communicator*, Callbacks::Lane>> completing_;
  // Works that expired while oneCCL may still use their buffers: never freed.
  std::vector<c10::intrusive_ptr<WorkCCL>> abandoned_;
  // Works taken out of inflight_ whose complete() runs on some thread: a deferred op waits for
  // them too (their post-processing writes the caller's tensors). Each is held by the
  // thread completing it, which takes it out of here (finished()).
  std::vector<WorkCCL*> finishing_;
  friend class WorkCCL;
  void finished(WorkCCL* work);
  // Deferred ops, in issue order; started by start_deferred() (from sweep()).
  std::vector<c10::intrusive_ptr<WorkCCL>> deferred_;
  std::atomic<bool> has_deferred_{false}; // !deferred_.empty(), read without the lock
  bool waits_for_earlier_locked(const WorkCCL& work) const;
  // Puts a deferred Work, started or failed, into inflight_ in its issue-order place.
  void place_locked(c10::intrusive_ptr<WorkCCL> work);
  // Starts the first deferred op of each group that may start; fails those that cannot any
  // more (their group broke, or their timeout passed). Returns whether any started or failed.
  bool start_deferred();
  std::thread background_;
  std::atomic<int> watched_{0};
  // Futures handed out so far (under mutex_): the background thread's pause after a sweep is
  // skipped when one came during the sweep, whose notify found nobody waiting.
  uint64_t futures_seen_ = 0;
  bool stop_ = false;
};

} // namespace oneccl_bind_pt

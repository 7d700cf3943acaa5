#include "work.hpp"

#include <Python.h>

#include <algorithm>

#include "errors.hpp"
#include "made_once.hpp"

#include <ATen/ThreadLocalState.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>

#include <numeric>
#include <system_error>

namespace oneccl_bind_pt {

namespace {

std::exception_ptr backend_error(const std::string& msg) {
  try {
    C10_THROW_ERROR(DistBackendError, msg);
  } catch (...) {
    return std::current_exception();
  }
}

int64_t total_numel(const std::vector<at::Tensor>& tensors) {
  int64_t n = 0;
  for (const auto& t : tensors) {
    n += t.defined() ? t.numel() : 0;
  }
  return n;
}

uint64_t next_key() {
  static std::atomic<uint64_t> last{0};
  return last.fetch_add(1, std::memory_order_relaxed) + 1;
}

// Profiler rows cost allocations per op: only pay them while a profiler listens.
bool profiling() {
  return at::hasCallbacks();
}

// Starts `title` as an async profiler event with the op's inputs (their
// shapes when the profiler records shapes), the way c10d::Work starts its
// own; returns what ends it, or nothing when no profiler is active.
std::function<void()> start_event(const char* title, const std::vector<at::Tensor>& inputs) {
  auto event = std::make_shared<at::RecordFunction>(at::RecordScope::USER_SCOPE);
  if (!event->isActive()) {
    return nullptr;
  }
  event->_setAsync();
  std::vector<c10::IValue> args(inputs.begin(), inputs.end());
  event->before(title, c10::ArrayRef<const c10::IValue>(args.data(), args.size()));
  return at::wrapPropagateTLSState([event]() { event->end(); });
}

// How a thread polls ops that have not finished. After a poll that moved anything, it
// spins briefly (results often come within microseconds), then yields between polls, so
// that ranks outnumbering cores keep running; once 512 polls in a row and 1 ms have passed
// without a move (a peer still computing, or late) it sleeps 100 us between polls, so that
// torch's compute threads keep the cores and a wait of seconds costs a few percent of a
// core, not all of it.
// Both bounds: where ranks outnumber CPUs each yield may hand the core away for a time
// slice, and there a thread woken from a sleep waited milliseconds for its core (4 ranks on
// 2 cores, sleeping after 1 ms without a move: an allreduce of 4 KiB waited on through its
// Future took 7.8 ms, 0.2-0.4 ms without), so the count, reached late there, holds sleeps
// back; on idle cores 512 polls pass in ~0.2 ms, so the time holds back a rank whose peer
// is busy a little longer (a large chunk without helpers, a core shared with compute).
// What moved is the transports' to say (Pending::moved); only a finished op counted before,
// so a large op, or one whose peer came late, went on at one step per sleep once it had
// waited 512 polls (docs/performance.md, "How a waiting rank polls").
class Backoff {
 public:
  // After a poll: how long to sleep before the next; zero where it spun or yielded.
  std::chrono::microseconds pause(bool moved) {
    still_ = moved ? 0 : still_ + 1;
    if (still_ <= kSpins) {
      return std::chrono::microseconds(0);
    }
    const auto now = Clock::now();
    if (still_ == kSpins + 1) {
      yielding_since_ = now;
    }
    if (still_ <= kYields || now - yielding_since_ < kYieldFor) {
      std::this_thread::yield();
      return std::chrono::microseconds(0);
    }
    return std::chrono::microseconds(100);
  }

 private:
  static constexpr unsigned kSpins = 64;
  static constexpr unsigned kYields = 512;
  static constexpr auto kYieldFor = std::chrono::milliseconds(1);
  unsigned still_ = 0; // polls in a row that moved nothing
  Clock::time_point yielding_since_{};
};

// Sleeps `d` (from Backoff::pause), but not past `limit`.
void sleep_within(std::chrono::microseconds d, Clock::time_point limit) {
  if (d.count() > 0) {
    std::this_thread::sleep_until(std::min(Clock::now() + d, limit));
  }
}

} // namespace

WorkCCL::WorkCCL(
    const OpInfo& op,
    std::shared_ptr<Communicator> comm,
    const std::vector<at::Tensor>& inputs,
    std::vector<at::Tensor> outputs,
    std::chrono::milliseconds timeout)
    : WorkCCL(op, std::move(comm), inputs, std::move(outputs), timeout, profiling()) {}

WorkCCL::WorkCCL(
    const OpInfo& op,
    std::shared_ptr<Communicator> comm,
    const std::vector<at::Tensor>& inputs,
    std::vector<at::Tensor> outputs,
    std::chrono::milliseconds timeout,
    bool profiled)
    : c10d::Work(
          comm->rank(),
          op.type,
          profiled ? op.title : nullptr,
          profiled ? std::optional<std::vector<at::Tensor>>(inputs) : std::nullopt),
      op_(op),
      comm_(std::move(comm)),
      outputs_(std::move(outputs)),
      numel_(total_numel(inputs)),
      timeout_(timeout),
      deadline_(Clock::now() + timeout),
      end_backend_event_(profiled ? start_event(op.backend_title, inputs) : nullptr),
      lane_(Callbacks::get().lane_for_new_work()),
      key_(next_key()),
      job_ops_(Callbacks::count_op_in_job()) {}

// The Pending first: it may refer to the group's transport, which the
// Communicator (destroyed with our other members) owns.
WorkCCL::~WorkCCL() {
  pending.reset();
  done_in_job();
}

void WorkCCL::done_in_job() {
  if (job_ops_) {
    job_ops_->fetch_sub(1, std::memory_order_relaxed);
    job_ops_.reset();
  }
}

std::string WorkCCL::describe() const {
  return std::string(op_.name) + " (rank " + std::to_string(comm_->rank()) + " of " +
      std::to_string(comm_->size()) + ", " + std::to_string(numel_) + " elements)";
}

bool WorkCCL::poll_locked(Clock::time_point now) {
  if (!parts.empty()) {
    for (const auto& part : parts) {
      if (!part->done_.load(std::memory_order_acquire)) {
        return false; // each part enforces its own deadline
      }
    }
    for (const auto& part : parts) {
      if (auto e = part->exception()) {
        error_ = e;
        break;
      }
    }
    return true;
  }
  if (!pending) {
    return true;
  }
  if (comm_->aborted()) {
    error_ = backend_error(
        "ccl " + describe() + ": aborted: abort() was called on its process group before it completed. "
        "The process group can no longer be used; destroy it and create a new one.");
    expired_ = true; // the transport may still hold its buffers
    return true;
  }
  try {
    const IssuerScope issued_by(issuer_);
    if (pending->poll()) {
      source_rank_ = pending->source_rank();
      return true;
    }
  } catch (const CollectiveMismatch&) {
    error_ = std::current_exception(); // found before any data moved: the group stays usable
    return true;
  } catch (const std::exception& e) {
    const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
    const auto msg = c10_error ? std::string(c10_error->what_without_backtrace())
                               : "ccl " + describe() + ": oneCCL failed while running it: " + e.what() +
            ". The process group can no longer be used.";
    broke_group_ = comm_->mark_broken(msg);
    error_ = backend_error(msg);
    expired_ = true;
    return true;
  }
  if (now > deadline_) {
    // "Timed out" as gloo says it: code written for gloo matches on it.
    const auto msg = "ccl " + describe() + " did not complete within " +
        std::to_string(timeout_.count()) +
        " ms: Timed out waiting for the other ranks; a peer may have died, hung, or called a "
        "different collective. "
        "The process group can no longer be used; destroy it and create a new one.";
    broke_group_ = comm_->mark_broken(msg);
    error_ = backend_error(msg);
    if (broke_group_) {
      timed_out_ = msg;
    }
    expired_ = true;
    return true;
  }
  return false;
}

// Nothing here may throw: the Work is out of Progress's list, and one left without
// done_ would be waited on for good.
void WorkCCL::complete() {
  if (broke_group_) {
    // Without the GIL (is_completed() holds it when it completes ops): the roll call waits up
    // to 0.5 s for the store, and a Python abort hook needs the GIL to run at all.
    PyThreadState* saved = Py_IsInitialized() && PyGILState_Check() ? PyEval_SaveThread() : nullptr;
    try {
      if (!timed_out_.empty()) {
        // Which peers did not time out with us (the group's store; outside Progress's lock,
        // since it waits for them).
        const std::string roll = comm_->roll_call();
        comm_->explain_break(roll);
        error_ = backend_error(timed_out_ + roll);
      }
      // Outside Progress's lock, before any waiter sees the error: a hook may
      // take the GIL (a Python one) or read the group's state for a dump.
      comm_->run_abort_hooks();
    } catch (...) {
      // (No thread for a hook, a store that cannot answer): the op's own error stands.
    }
    if (saved) {
      PyEval_RestoreThread(saved);
    }
  }
  std::exception_ptr error = error_;
  if (!error && on_success) {
    try {
      on_success();
    } catch (...) {
      error = std::current_exception();
    }
  }
  on_success = nullptr;
  parts.clear();
  if (!expired_ || (pending && !pending->buffers_in_use_after_abort())) {
    // The transport is done with these; an expired oneCCL op keeps them, as it may not be.
    // Under Progress's lock: a shared-memory Pending's destructor edits its transport's
    // queues (sends, posted recvs, the FIFO), which other threads issue to and sweep.
    {
      std::lock_guard<std::mutex> lock(Progress::get().ccl_mutex());
      pending.reset();
    }
    buffers.clear();
  }
  if (end_backend_event_) {
    try {
      end_backend_event_();
    } catch (...) {
      // The profiler's record only.
    }
    end_backend_event_ = nullptr;
  }
  try {
    finish(error);
  } catch (...) {
    // c10d's finish() marks the Work completed, then runs the profiler's end callback: a
    // failure there is the record's only, and the rest below must still run.
  }
  if (!error) {
    comm_->completed(key_);
  }
  c10::intrusive_ptr<c10::ivalue::Future> future;
  {
    std::lock_guard<std::mutex> lock(sync_->mutex);
    done_.store(true, std::memory_order_release);
    future = future_;
  }
  if (in_finishing_) {
    Progress::get().finished(this);
    in_finishing_ = false;
  }
  if (future) {
    // Created before completion, so getFuture() counted it as watched.
    Progress::get().unwatch_future();
    // Its group's count of holds, let go of once the job (and so the Future's callbacks) is freed.
    auto holds = comm_->internal_holds();
    holds->fetch_add(1, std::memory_order_acq_rel);
    std::shared_ptr<void> hold(nullptr, [holds](void*) { holds->fetch_sub(1, std::memory_order_acq_rel); });
    Callbacks::get().post(lane_, [sync = sync_, hold, future, error, value = future_value(),
                                  issuer = issuer_]() mutable {
      // Ops the callbacks issue count as this op's issuer's, not the callback thread's.
      const IssuerScope issued_by(issuer);
      try {
        if (error) {
          future->setError(error);
        } else {
          future->markCompleted(std::move(value));
        }
      } catch (...) {
        // Completed already by its holder (set_result()): nothing more to do to it.
      }
      {
        std::lock_guard<std::mutex> lock(sync->mutex);
        sync->settled = true;
      }
      sync->cv.notify_all();
    });
  }
  if (in_completing_) {
    Progress::get().posted(comm_.get(), lane_);
    in_completing_ = false;
  }
  // (Not after the Future's callbacks: those may wait on a lane-0 Future queued behind the job
  // that issued this op, which must then be handed on. The moment between this and that job's
  // resuming is covered by Callbacks' judging it over kJudgeAfterWait.)
  done_in_job();
}

void WorkCCL::wait_for_future(Clock::time_point limit) {
  if (Callbacks::in_job() || comm_->inherited()) {
    // Inside a callback: the Future's completion may be queued behind this very job. In a
    // forked child: the parent's queued completions are not here to run.
    return;
  }
  std::unique_lock<std::mutex> lock(sync_->mutex);
  if (!future_ || sync_->settled) {
    return;
  }
  const auto started = Clock::now();
  if (!sync_->cv.wait_until(lock, std::min(limit, started + timeout_), [&] { return sync_->settled; })) {
    const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - started);
    C10_THROW_ERROR(DistBackendError,
                    "ccl " + describe() + ": the op completed, but its Future's then() callbacks did not finish "
                    "within " + std::to_string(waited.count()) + " ms of wait()");
  }
}

void MemoryUse::add(std::vector<Span>& spans, const std::vector<at::Tensor>& tensors) {
  for (const auto& t : tensors) {
    if (!t.defined() || t.numel() == 0 || t.is_sparse() || !t.has_storage()) {
      continue;
    }
    // From the first element to past the last one, whatever the strides (none is negative).
    int64_t last = 0;
    for (int64_t d = 0; d < t.dim(); ++d) {
      last += (t.size(d) - 1) * t.stride(d);
    }
    const auto lo = reinterpret_cast<uintptr_t>(t.data_ptr());
    spans.push_back({lo, lo + static_cast<uintptr_t>((last + 1) * t.element_size())});
  }
}

bool MemoryUse::must_precede(const MemoryUse& later) const {
  if (p2p && later.p2p) {
    return false;
  }
  const auto overlap = [](const std::vector<Span>& a, const std::vector<Span>& b) {
    for (const auto& x : a) {
      for (const auto& y : b) {
        if (x.lo < y.hi && y.lo < x.hi) {
          return true;
        }
      }
    }
    return false;
  };
  return overlap(later.writes, writes) || overlap(later.writes, reads) || overlap(later.reads, writes);
}

bool WorkCCL::isCompleted() {
  if (!done_.load(std::memory_order_acquire)) {
    Progress::get().sweep();
  }
  return done_.load(std::memory_order_acquire);
}

bool WorkCCL::isSuccess() const {
  return done_.load(std::memory_order_acquire) && c10d::Work::isSuccess();
}

bool WorkCCL::wait(std::chrono::milliseconds timeout) {
  RECORD_FUNCTION(
      std::string("pg::wait::") + op_.name + "::sz:" + std::to_string(numel_),
      std::vector<c10::IValue>());
  auto& progress = Progress::get();
  const auto limit = timeout == kNoTimeout ? Clock::time_point::max() : Clock::now() + timeout;
  if (!done_.load(std::memory_order_acquire) && comm_->inherited()) {
    // Nothing in this process progresses it: it is the parent's op.
    C10_THROW_ERROR(DistBackendError, "ccl " + describe() + ": cannot be waited for here: its process group " +
                                          comm_->broken_reason());
  }
  if (!done_.load(std::memory_order_acquire)) {
    // Counted while here, however this returns: the background thread leaves Futures to
    // waiters while there are any.
    struct Waiting {
      Progress& p;
      explicit Waiting(Progress& p) : p(p) { p.waiters.fetch_add(1); }
      ~Waiting() { p.waiter_left(); }
    } waiting(progress);
    const Callbacks::InWait in_wait; // a callback here is not blocked on its lane
    Backoff backoff;
    while (!done_.load(std::memory_order_acquire)) {
      const bool moved = progress.sweep();
      if (done_.load(std::memory_order_acquire)) {
        break;
      }
      if (Clock::now() > limit) {
        C10_THROW_ERROR(
            DistBackendError,
            "ccl " + describe() + ": wait() timed out after " +
                std::to_string(timeout.count()) +
                " ms; the operation is still in flight and may complete later");
      }
      sleep_within(backoff.pause(moved), limit);
    }
  }
  wait_for_future(limit);
  if (auto e = exception()) {
    std::rethrow_exception(e);
  }
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> WorkCCL::getFuture() {
  if (!done_.load(std::memory_order_acquire) && !comm_->inherited()) {
    // Before the Future exists, so a refusal changes nothing: a Future nobody drives would
    // never complete (its wait() has no limit).
    const std::string why = Progress::get().need_background();
    TORCH_CHECK(why.empty(), "ccl ", describe(),
                ": get_future() needs a thread to complete the Future and none could be started (", why,
                "; the process is at its thread limit). The op was issued and is in flight on its tensors: where "
                "the call returned a Work, Work.wait() completes it; a later op may ask for a Future again");
  }
  bool created_done = false;
  bool created_pending = false;
  c10::intrusive_ptr<c10::ivalue::Future> future;
  {
    std::lock_guard<std::mutex> lock(sync_->mutex);
    if (!future_) {
      auto list = c10::ListType::create(c10::TensorType::get());
      future_ = c10::make_intrusive<c10::ivalue::Future>(
          nested_outputs.empty() ? list : c10::ListType::create(list));
      created_done = done_.load(std::memory_order_acquire);
      created_pending = !created_done;
    }
    future = future_;
    has_future_.store(true, std::memory_order_release);
  }
  const auto settled = [&] {
    {
      std::lock_guard<std::mutex> lock(sync_->mutex);
      sync_->settled = true;
    }
    sync_->cv.notify_all();
  };
  if (comm_->inherited()) {
    // The parent's op in a forked child: nothing here moves it, nor runs the completion the
    // parent may have queued, so its Future settles now rather than never.
    if (!future->completed()) {
      if (!done_.load(std::memory_order_acquire)) {
        future->setError(backend_error("ccl " + describe() + ": its Future cannot complete here: its process group " +
                                       comm_->broken_reason()));
      } else if (auto e = exception()) {
        future->setError(e);
      } else {
        future->markCompleted(future_value());
      }
    }
    settled();
    return future;
  }
  if (created_done) {
    if (auto e = exception()) {
      future->setError(e);
    } else {
      future->markCompleted(future_value());
    }
    settled();
  } else if (created_pending) {
    Progress::get().watch_future();
  }
  return future;
}

c10::IValue WorkCCL::future_value() const {
  return nested_outputs.empty() ? c10::IValue(outputs_) : c10::IValue(nested_outputs);
}

std::vector<at::Tensor> WorkCCL::result() {
  // As gloo: outputs still being written are no result, and a list of lists has no flat form.
  TORCH_CHECK(done_.load(std::memory_order_acquire), "ccl ", describe(),
              ": result() was called before the op completed; call wait() first");
  TORCH_CHECK(nested_outputs.size() <= 1, "ccl ", describe(),
              ": result() cannot hold its list of lists of outputs; use get_future().value()");
  return outputs_;
}

namespace {
std::atomic<Progress*> g_progress{nullptr};
} // namespace

Progress& Progress::get() {
  return made_once(g_progress, [] { return new Progress(); });
}

void Progress::forget_in_child() {
  g_progress.store(nullptr, std::memory_order_relaxed);
}

void Progress::track(c10::intrusive_ptr<WorkCCL> work) {
  inflight_.push_back(std::move(work));
}

void Progress::abandon(c10::intrusive_ptr<WorkCCL> work) {
  abandoned_.push_back(std::move(work));
}

namespace {
bool is_p2p(c10d::OpType type) {
  return type == c10d::OpType::SEND || type == c10d::OpType::RECV || type == c10d::OpType::RECVANYSOURCE;
}

// Collectives complete in issue order per group and lane; send/recv in any order, by design,
// and so do batch_isend_irecv's blocks of them (a batch waiting for a peer's later recv must not
// hold back a collective issued after it).
bool in_issue_order(const WorkCCL& w) {
  if (is_p2p(w.op().type)) {
    return false;
  }
  return w.parts.empty() || !std::all_of(w.parts.begin(), w.parts.end(), [](const auto& p) { return is_p2p(p->op().type); });
}
} // namespace

bool Progress::behind_another_locked(const WorkCCL& work) const {
  if (!in_issue_order(work)) {
    return false;
  }
  const std::pair<const Communicator*, Callbacks::Lane> key{work.comm_.get(), work.lane_};
  return std::find(completing_.begin(), completing_.end(), key) != completing_.end() ||
      std::any_of(inflight_.begin(), inflight_.end(), [&](const auto& w) {
        return w.get() != &work && in_issue_order(*w) && w->comm_.get() == key.first && w->lane_ == key.second;
      });
}

bool Progress::sweep(bool start) {
  std::vector<c10::intrusive_ptr<WorkCCL>> finished;
  std::vector<std::shared_ptr<std::atomic<int>>> holds; // their groups' internal_holds()
  bool moved = start && has_deferred_.load(std::memory_order_acquire) && start_deferred();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (inflight_.empty()) {
      return moved;
    }
    const auto now = Clock::now();
    // Collectives complete in issue order per group and lane: their Futures' callbacks,
    // which may issue collectives, must run in the same order on every rank, and oneCCL may
    // report a later op done before an earlier one (the shared-memory transport's FIFO
    // cannot). One waits here while an earlier one of its group and lane is in flight (which
    // moves on, or fails, first) or still completing on another thread (complete() posts
    // outside the lock). Not send/recv: those may complete in any order, by design.
    // Kept per thread: sweep() runs on every poll of a waiting thread, and an allocation per
    // poll would show at small sizes.
    thread_local std::vector<std::pair<const Communicator*, Callbacks::Lane>> earlier;
    earlier.assign(completing_.begin(), completing_.end());
    for (size_t i = 0; i < inflight_.size();) {
      WorkCCL& w = *inflight_[i];
      const bool ordered = in_issue_order(w);
      const std::pair<const Communicator*, Callbacks::Lane> key{w.comm_.get(), w.lane_};
      if (ordered && std::find(earlier.begin(), earlier.end(), key) != earlier.end()) {
        ++i;
        continue;
      }
      if (inflight_[i]->poll_locked(now)) {
        if (inflight_[i]->expired_) {
          abandon(inflight_[i]);
        }
        if (ordered) {
          completing_.push_back(key);
          earlier.push_back(key);
          w.in_completing_ = true;
        }
        // Counted before it leaves inflight_ (never unseen by shutdown()), let go of below.
        w.comm_->internal_holds()->fetch_add(1, std::memory_order_acq_rel);
        holds.push_back(w.comm_->internal_holds());
        finishing_.push_back(&w);
        w.in_finishing_ = true;
        finished.push_back(std::move(inflight_[i]));
        inflight_.erase(inflight_.begin() + static_cast<std::ptrdiff_t>(i));
      } else {
        if (ordered) {
          earlier.push_back(key);
        }
        // Asked of every Work (not short-circuited): each keeps what it last saw.
        if (inflight_[i]->pending && inflight_[i]->pending->moved()) {
          moved = true;
        }
        ++i;
      }
    }
  }
  for (auto& work : finished) {
    work->complete();
  }
  const bool any = !finished.empty();
  finished.clear(); // where a group's last reference may go
  for (const auto& held : holds) {
    held->fetch_sub(1, std::memory_order_acq_rel);
  }
  if (start && any && has_deferred_.load(std::memory_order_acquire)) {
    start_deferred(); // what waited for them
  }
  return moved || any;
}

void Progress::finished(WorkCCL* work) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto at = std::find(finishing_.begin(), finishing_.end(), work);
  if (at != finishing_.end()) {
    finishing_.erase(at);
  }
}

bool Progress::waits_for_earlier_locked(const WorkCCL& work) const {
  const auto before = [&](const WorkCCL* w) {
    // (A coalesced Work has no memory of its own: its parts are tracked on their own.)
    return w != &work && w->comm_ == work.comm_ && !w->done_.load(std::memory_order_acquire) &&
        w->memory.must_precede(work.memory) && (work.block_ == 0 || w->block_ != work.block_);
  };
  return std::any_of(inflight_.begin(), inflight_.end(), [&](const auto& w) { return before(w.get()); }) ||
      std::any_of(finishing_.begin(), finishing_.end(), before);
}

bool Progress::must_defer_locked(const Communicator& comm, const MemoryUse& use, uint64_t block) const {
  if (std::any_of(deferred_.begin(), deferred_.end(), [&](const auto& w) { return w->comm_.get() == &comm; })) {
    return true;
  }
  if (use.reads.empty() && use.writes.empty()) {
    return false;
  }
  const auto before = [&](const WorkCCL* w) {
    return w->comm_.get() == &comm && !w->done_.load(std::memory_order_acquire) && w->memory.must_precede(use) &&
        (block == 0 || w->block_ != block);
  };
  return std::any_of(inflight_.begin(), inflight_.end(), [&](const auto& w) { return before(w.get()); }) ||
      std::any_of(finishing_.begin(), finishing_.end(), before);
}

void Progress::defer(c10::intrusive_ptr<WorkCCL> work) {
  deferred_.push_back(std::move(work));
  has_deferred_.store(true, std::memory_order_release);
  cv_.notify_one(); // a background thread asleep for want of ops in flight
}

bool Progress::start_deferred() {
  bool any = false;
  for (;;) {
    c10::intrusive_ptr<WorkCCL> next;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      std::vector<const Communicator*> seen; // groups whose first deferred op stays
      for (size_t i = 0; i < deferred_.size();) {
        WorkCCL& w = *deferred_[i];
        Communicator* comm = w.comm_.get();
        if (std::find(seen.begin(), seen.end(), comm) != seen.end()) {
          ++i;
          continue; // behind an earlier deferred op of its group
        }
        if (!w.starting_ && comm->broken()) {
          // No bound of its own while it waits: the ops it waits for have theirs, and when
          // one fails the group breaks. Completed by sweep() in issue order, behind them
          // (with no Pending, poll_locked finds it done).
          w.error_ = backend_error("ccl " + w.describe() + ": not started: the process group broke while it " +
                                   "waited for earlier ops of the group: " + comm->broken_reason());
          place_locked(std::move(deferred_[i]));
          deferred_.erase(deferred_.begin() + static_cast<std::ptrdiff_t>(i));
          any = true;
          continue; // and so every later one of the group
        }
        seen.push_back(comm);
        if (!next && !w.starting_ && !waits_for_earlier_locked(w)) {
          w.starting_ = true; // only this thread takes it out of deferred_ now
          next = deferred_[i];
        }
        ++i;
      }
      has_deferred_.store(!deferred_.empty(), std::memory_order_release);
    }
    if (!next) {
      return any;
    }
    any = true;
    // Outside the lock: packing and scaling copy the caller's tensors.
    std::string error;
    try {
      if (next->prepare) {
        next->prepare();
      }
    } catch (const c10::Error& e) {
      error = e.what_without_backtrace();
    } catch (const std::exception& e) {
      error = e.what();
    } catch (...) {
      error = "an unknown exception";
    }
    next->prepare = nullptr;
    std::lock_guard<std::mutex> lock(mutex_);
    deferred_.erase(std::find(deferred_.begin(), deferred_.end(), next));
    has_deferred_.store(!deferred_.empty(), std::memory_order_release);
    if (error.empty() && next->comm_->broken()) { // it broke while this prepared it
      next->error_ = backend_error("ccl " + next->describe() + ": not started: the process group broke while it " +
                                   "waited for earlier ops of the group: " + next->comm_->broken_reason());
    } else {
      if (error.empty()) {
        try {
          const IssuerScope issued_by(next->issuer_);
          next->pending = next->comm_->start(next->op_.name, std::move(next->deferred_prims));
          // Its timeout counts from its start, as an op started at once does.
          next->deadline_ = Clock::now() + next->timeout_;
        } catch (const c10::Error& e) {
          error = e.what_without_backtrace();
        } catch (const std::exception& e) {
          error = e.what();
        }
      }
      if (!error.empty()) {
        // The other ranks may have started it: later ops must not start in its place.
        const std::string msg = "ccl " + next->describe() + ": could not be started after earlier ops of the group: " +
            error + ". The process group can no longer be used; destroy it and create a new one.";
        next->broke_group_ = next->comm_->mark_broken(msg);
        next->error_ = backend_error(msg);
      }
    }
    place_locked(next); // polled (or, failed, completed) in issue order, behind the ops before it
  }
}

void Progress::place_locked(c10::intrusive_ptr<WorkCCL> work) {
  // Ahead of its coalescing block's Work, which waits for it and holds back (in sweep()'s
  // issue order) what comes after it; every op issued after it was deferred behind it.
  const auto block = std::find_if(inflight_.begin(), inflight_.end(), [&](const auto& w) {
    return std::find(w->parts.begin(), w->parts.end(), work) != w->parts.end();
  });
  inflight_.insert(block, std::move(work));
}

void Progress::posted(const Communicator* comm, Callbacks::Lane lane) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto at = std::find(completing_.begin(), completing_.end(), std::make_pair(comm, lane));
  if (at != completing_.end()) {
    completing_.erase(at);
  }
}

bool Progress::drain(const Communicator& comm, Clock::time_point deadline, bool start) {
  Backoff backoff;
  for (;;) {
    const bool moved = sweep(start);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const auto of_comm = [&](const auto& w) { return w->comm_.get() == &comm; };
      if (std::none_of(inflight_.begin(), inflight_.end(), of_comm) &&
          std::none_of(deferred_.begin(), deferred_.end(), of_comm)) {
        return true;
      }
    }
    if (Clock::now() > deadline) {
      return false;
    }
    sleep_within(backoff.pause(moved), deadline);
  }
}

void Progress::waiter_left() {
  if (waiters.fetch_sub(1) == 1 && watched_.load() > 0) {
    cv_.notify_one();
  }
}

std::string Progress::need_background() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (background_.joinable() || stop_) {
    return {};
  }
  try {
    background_ = std::thread([this] { background_loop(); });
  } catch (const std::system_error& e) {
    return e.what();
  }
  return {};
}

void Progress::watch_future() {
  std::lock_guard<std::mutex> lock(mutex_);
  watched_.fetch_add(1);
  ++futures_seen_;
  if (!background_.joinable() && !stop_) {
    try {
      background_ = std::thread([this] { background_loop(); });
    } catch (const std::system_error&) {
      // (need_background() started it; only its own end since could bring this here.)
    }
  }
  cv_.notify_one();
}

void Progress::background_loop() {
  pthread_setname_np(pthread_self(), "ccl-progress");
  Backoff backoff;
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_) {
    if ((inflight_.empty() && deferred_.empty()) || watched_.load() == 0) {
      backoff = Backoff();
      cv_.wait(lock);
      continue;
    }
    if (waiters.load() > 0) {
      cv_.wait_for(lock, std::chrono::milliseconds(1));
      continue;
    }
    const uint64_t futures = futures_seen_;
    lock.unlock();
    const bool moved = sweep();
    const auto pause = backoff.pause(moved);
    lock.lock();
    if (futures_seen_ != futures) {
      backoff = Backoff(); // a new op to move: poll it at once
    } else if (pause.count() > 0) {
      cv_.wait_for(lock, pause); // a new Future wakes it
    }
  }
}

void Progress::shutdown() {
  Callbacks::get().shutdown();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  if (background_.joinable() && background_.get_id() != std::this_thread::get_id()) {
    background_.join();
  }
}

} // namespace oneccl_bind_pt

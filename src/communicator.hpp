// Communicators: one per process group, created once at group construction
// and shared by every op (and every in-flight Work) of that group. It holds
// the group's oneCCL communicator and its transports: the oneCCL one
// (transport_ccl.hpp) always, shared memory (shm.hpp) when every rank of the
// group is on this host (route.hpp says which runs what).
#pragma once

#include "made_once.hpp"
#include "transport_ccl.hpp"

#include <oneapi/ccl.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include <sys/types.h>

namespace oneccl_bind_pt {

class Shm;

// At process exit. libfabric's endpoints belong to the process and outlive its
// groups, and a group left unfreed (a peer died, an op was abandoned) keeps
// them open: their /dev/shm segments can go only when the process ends, and
// an exit through os._exit (multiprocessing's children) skips libfabric's own
// cleanup.
void unlink_own_fabric_segments();

// At process exit: waits (at most `limit`) for abort hooks still running on
// their own threads (Communicator::run_abort_hooks), so that a trace a hook
// is writing is not cut off.
void wait_for_abort_hooks(std::chrono::milliseconds limit);

// Marks a thread inside a group's abort() for its lifetime (process-wide).
class AbortInProgress {
 public:
  AbortInProgress();
  ~AbortInProgress();
  AbortInProgress(const AbortInProgress&) = delete;
  AbortInProgress& operator=(const AbortInProgress&) = delete;
};

// At interpreter exit: waits (at most `limit`) until no thread is inside a
// group's abort(), and then a little longer, without the GIL, so that such a
// thread (a watchdog's, often a daemon thread) takes the GIL and is back in
// Python before the interpreter finalizes. A thread that takes the GIL after
// that is ended by pthread_exit, and the unwinding through the C++ frames of
// torch's binding calls std::terminate: SIGABRT at exit (measured, fault matrix).
void settle_aborts(std::chrono::milliseconds limit);

// In a forked child: the two waits above start afresh (made_once.hpp).
void forget_exit_waits_in_child();

class Communicator {
 public:
  Communicator(
      const c10::intrusive_ptr<c10d::Store>& store,
      int rank,
      int size,
      std::chrono::milliseconds timeout);
  ~Communicator();

  // Starts an op's Prims on the group's transport: shared memory when the
  // group has it, else oneCCL. Caller holds Progress's lock.
  std::unique_ptr<Pending> start(const char* op, std::vector<Prim> prims);
  Shm* shm() const { return shm_.get(); }

  ccl::communicator& get() { return *comm_; }
  // A count of this process's own threads about to let go of Works of this group: a completion
  // job (it frees the Future's callbacks, which may refer to Works), a sweep (the Works it
  // completed). Kept apart from the Communicator, which those Works keep alive.
  const std::shared_ptr<std::atomic<int>>& internal_holds() const { return holds_; }
  int rank() const { return rank_; }
  int size() const { return size_; }

  // Completion hooks (torch's FlightRecorder, 2.15 on): each is called with
  // the Work's completion key once for every op that succeeds.
  void add_completion_hook(int64_t id, std::function<void(uint64_t)> hook);
  void remove_completion_hook(int64_t id);
  void completed(uint64_t key) const;

  // Abort hooks (torch 2.14 on: Backend::registerAbortHook): called once,
  // in the order of their ids, when an op's timeout or failure breaks the
  // group, before that op completes with its error (waited for at most 1 s;
  // a slower hook finishes on its own thread). Not on abort(), which the
  // caller asked for. A hook that throws is reported as a warning.
  void add_abort_hook(int64_t id, std::function<void()> hook);
  void remove_abort_hook(int64_t id);
  void run_abort_hooks();

  // After a timeout or a oneCCL failure, operations may still be in flight and
  // peers may sit in different collectives: nothing more can run safely.
  // True for the call that broke it.
  bool mark_broken(const std::string& why);
  // Also in a forked child, whose copy of the group is the parent's (its peers, its
  // sockets, its shared memory): it refuses every op, and shutdown() and abort() leave it.
  bool broken() const { return broken_.load(std::memory_order_acquire) || inherited(); }
  bool inherited() const { return g_forks.load(std::memory_order_relaxed) != forks_; }
  std::string broken_reason() const;

  // After an op of this group timed out here: a roll call through the group's store. This
  // rank signs in, then waits at most min(0.5 s, timeout / 4) for every other rank to sign
  // in too (each does when a timeout breaks its group). Returns a sentence for the error
  // naming the ranks that did not: dead, hung, or elsewhere. Lock-step peers time
  // out together, so a missing rank is the one to look at (oneCCL itself cannot say).
  std::string roll_call() const;
  // Adds to the reason later ops are refused with.
  void explain_break(const std::string& more);

  // Backend::abort(): every op in flight on the group fails at its next poll
  // (a waiter polls continuously), and the group is broken. Idempotent.
  // `ops_in_flight`: some op may stay inside oneCCL for good (it cannot be
  // cancelled); the peers are told through the group's store, so that none
  // frees its communicator and hands that op's tags to its next one; abort()
  // returns once the store has that (or after at most 5 s).
  void abort(bool ops_in_flight);
  bool aborted() const { return aborted_.load(std::memory_order_acquire); }

  // A broken group's peers on this host that died (or are stopped) cannot
  // unlink libfabric's segments themselves: the survivors do, when the group
  // is shut down and again when it is freed, for peers that were not gone yet
  // at the first look (Works still held can delay the latter past a
  // multiprocessing child's os._exit).
  void unlink_segments_of_dead_peers();

 private:
  bool peer_abandoned_an_op() const;

  // Runs fn (a call to the group's store or to oneCCL's key-value store) on a
  // thread of its own and waits for it at most min(timeout, 5 s); nullopt if
  // it threw or did not answer in time. A store whose host is cut off can hold
  // a call in recv() for good (torch's TCPStore client after one of its waits
  // timed out; oneCCL's key-value store client always), and teardown must not
  // wait on it. After one call is given up on, later ones are not tried: the
  // blocked thread may hold the store's lock.
  // `limit` (if set) replaces that wait, and a call that passes it then leaves later calls be.
  // Where no thread can be started (a pids limit), a call with a time limit of its own
  // (the group's store: `Inline::kAllowed`) runs on the caller's thread; oneCCL's
  // key-value store has none, so its call (`Inline::kNever`) counts as not answered.
  enum class Inline { kAllowed, kNever };
  template <class Fn>
  std::optional<std::invoke_result_t<Fn>> bounded(
      Fn fn,
      std::optional<std::chrono::milliseconds> limit = {},
      Inline fallback = Inline::kAllowed) const;

  const unsigned forks_ = g_forks.load(std::memory_order_relaxed); // inherited()
  c10::intrusive_ptr<c10d::Store> store_;
  int rank_;
  int size_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<ccl::kvs> kvs_;
  pid_t kvs_server_ = 0; // rank 0: the thread serving kvs_ (0: not known)
  const std::shared_ptr<std::atomic<int>> holds_ = std::make_shared<std::atomic<int>>(0); // internal_holds()
  std::vector<int> host_peers_; // pids of the group's other ranks on this host, not yet swept
  std::optional<ccl::communicator> comm_;
  std::unique_ptr<CclTransport> ccl_; // after comm_, which it refers to
  std::unique_ptr<Shm> shm_;          // after ccl_, which it hands large steps to
  std::atomic<bool> broken_{false};
  std::atomic<bool> aborted_{false};
  std::mutex sweep_mutex_; // host_peers_ after construction
  mutable std::atomic<bool> stores_silent_{false};
  std::atomic<bool> has_hooks_{false};
  mutable std::mutex hooks_mutex_;
  std::map<int64_t, std::function<void(uint64_t)>> hooks_;
  std::map<int64_t, std::function<void()>> abort_hooks_; // under hooks_mutex_
  mutable std::mutex why_mutex_;
  std::string why_;
};

} // namespace oneccl_bind_pt

// Runs Future completions, and so the user's then() callbacks, off the thread
// that progresses communication.
//
// A callback may wait on another collective, or issue one and wait on it
// (DDP's PowerSGD hook does both). Run inline on the progress thread, that
// wait would block the only thread that could finish the op. So completions
// are jobs, run by a small pool of threads, in lanes:
//  - lane 0 holds the completions of ops issued by ordinary threads; its jobs
//    run one at a time in completion order (for collectives with Futures,
//    issue order per group: Progress::sweep), so callbacks that issue
//    collectives issue them in the same order on every rank;
//  - an op issued from inside a callback gets the lane of that callback's
//    job: a callback that waits on it does not block its completion;
//  - a job that has run longer than kStuckAfter while its lane has more work,
//    and is blocked (a callback waiting on a lane-0 future that is queued
//    behind it), hands the lane to another thread. Order is kept except
//    across that one job. A job that computes (on a CPU a tenth of the last
//    200 ms or more) or waits in Work::wait() (which moves its op itself) is
//    not blocked by its lane and keeps it, as does one whose own ops are in
//    flight (waiting on their Futures), and for a second after such a wait
//    ends (time to wake and take the GIL): handing the lane on would let later
//    callbacks issue their collectives before this one's, in an order that
//    differs between ranks. After 30 s any job with work behind it hands on.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include <time.h>

namespace oneccl_bind_pt {

class Callbacks {
 public:
  using Lane = uint64_t;
  static constexpr std::chrono::milliseconds kStuckAfter{20};

  static Callbacks& get();
  // In a forked child: the next get() makes a fresh one (the parent's runners are not
  // there, and one may have held the lock at the fork).
  static void forget_in_child();

  // The lane for the completion of an op the calling thread issues now.
  Lane lane_for_new_work();
  void post(Lane lane, std::function<void()> job);
  // Waits (bounded) for queued jobs to finish, then lets idle threads exit.
  void shutdown();
  // Whether the calling thread runs a completion job (a Future's callbacks).
  static bool in_job();
  // For an op issued from inside a job: a count of that job's ops in flight, which the
  // caller holds and decrements once the op is complete (a job whose ops are in flight waits
  // on them, not on its lane). Null outside a job.
  static std::shared_ptr<std::atomic<int>> count_op_in_job();
  // Marks the calling thread, for its lifetime, as inside Work::wait(): if it runs a
  // job, that job is not blocked on its lane.
  class InWait {
   public:
    InWait();
    ~InWait();
    InWait(const InWait&) = delete;
    InWait& operator=(const InWait&) = delete;
  };

 private:
  // What another thread may read of a runner (under mutex_, while it owns a lane).
  struct Runner {
    clockid_t cpu_clock{}; // the runner thread's CPU time
    bool has_clock = false;
    std::atomic<int> in_wait{0};
    std::shared_ptr<std::atomic<int>> job_ops; // its current job's ops in flight (under mutex_)
  };
  struct LaneState {
    std::deque<std::function<void()>> jobs;
    uint64_t owner = 0; // runner serving the lane, 0 when none
    const Runner* runner = nullptr; // the owner's, while owner != 0
    std::chrono::steady_clock::time_point job_started;
    // The last look at a long job: when, and the runner's CPU time then.
    std::chrono::steady_clock::time_point looked;
    std::chrono::nanoseconds cpu_looked{0};
    bool after_wait = false; // the last look found it waiting (kJudgeAfterWait)
  };

  Callbacks() = default;
  void runner_loop(uint64_t id);
  // False if no thread could be started.
  bool spawn_locked();
  // Hands lanes whose runner is stuck to another runner; true if any lane
  // is being served with jobs waiting (the caller should look again soon).
  bool rescue_stuck_locked();

  std::mutex mutex_;
  std::condition_variable cv_;
  std::map<Lane, LaneState> lanes_;
  std::deque<Lane> ready_; // lanes with jobs and no runner
  Lane next_lane_ = 1;
  uint64_t next_runner_ = 1;
  int idle_ = 0;
  int runners_ = 0;
  bool stop_ = false;
  std::thread::id inline_thread_; // running completions itself: no runner could be started
};

} // namespace oneccl_bind_pt

#include "callbacks.hpp"
#include "made_once.hpp"

#include <c10/util/Exception.h>

#include <system_error>
#include <thread>
#include <vector>

namespace oneccl_bind_pt {

namespace {

using Clock = std::chrono::steady_clock;

// Idle runners beyond the first exit after this long without work.
constexpr std::chrono::seconds kIdleExit{10};

// Set while this thread runs a job: ops it issues complete in `child_lane`
// (allocated on first use), not behind the job that issued them.
thread_local bool tl_in_job = false;
thread_local Callbacks::Lane tl_child_lane = 0;
thread_local std::atomic<int>* tl_in_wait = nullptr; // a runner's Runner::in_wait
thread_local std::shared_ptr<std::atomic<int>>* tl_job_ops = nullptr; // a runner's Runner::job_ops

// A job using at least this share of its thread's time since the last look is computing, not
// blocked. Blocked waits use none (a condition variable) or little (Work::wait's backoff is
// excluded anyway); a computing thread on a crowded host still gets well above this.
constexpr double kComputing = 0.1;
// Over at least this long: a computing thread may wait for the GIL or for a core a while (a
// loaded host), and a job blocked on its lane (rare) loses this much once.
constexpr std::chrono::milliseconds kJudgeOver{200};
// Once a wait of its own (Work::wait, its ops' Futures) has ended, a job is judged over this
// long instead: it first has to be woken, scheduled and given the GIL, which on a crowded host
// can take a while with no CPU time to show for it.
constexpr std::chrono::milliseconds kJudgeAfterWait{1000};
// A job kept past this with work queued behind it hands its lane on anyway (a callback spinning
// on a Future that is queued behind it would otherwise hold it for good).
constexpr std::chrono::seconds kKeepAtMost{30};

std::chrono::nanoseconds cpu_time(clockid_t clock) {
  timespec ts{};
  if (clock_gettime(clock, &ts) != 0) {
    return std::chrono::nanoseconds(0);
  }
  return std::chrono::seconds(ts.tv_sec) + std::chrono::nanoseconds(ts.tv_nsec);
}

} // namespace

bool Callbacks::in_job() {
  return tl_in_job;
}

std::shared_ptr<std::atomic<int>> Callbacks::count_op_in_job() {
  if (!tl_in_job || !tl_job_ops || !*tl_job_ops) {
    return nullptr;
  }
  (*tl_job_ops)->fetch_add(1, std::memory_order_relaxed);
  return *tl_job_ops;
}

Callbacks::InWait::InWait() {
  if (tl_in_wait) {
    tl_in_wait->fetch_add(1, std::memory_order_relaxed);
  }
}

Callbacks::InWait::~InWait() {
  if (tl_in_wait) {
    tl_in_wait->fetch_sub(1, std::memory_order_relaxed);
  }
}

namespace {
std::atomic<Callbacks*> g_callbacks{nullptr};
} // namespace

Callbacks& Callbacks::get() {
  return made_once(g_callbacks, [] { return new Callbacks(); });
}

void Callbacks::forget_in_child() {
  g_callbacks.store(nullptr, std::memory_order_relaxed);
}

Callbacks::Lane Callbacks::lane_for_new_work() {
  if (!tl_in_job) {
    return 0;
  }
  if (tl_child_lane == 0) {
    std::lock_guard<std::mutex> lock(mutex_);
    tl_child_lane = next_lane_++;
  }
  return tl_child_lane;
}

void Callbacks::post(Lane lane, std::function<void()> job) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (stop_) {
    // Interpreter exit: no runner will take it; complete it here.
    lock.unlock();
    job();
    return;
  }
  auto& state = lanes_[lane];
  state.jobs.push_back(std::move(job));
  if (state.owner == 0 && state.jobs.size() == 1) {
    ready_.push_back(lane);
  }
  // An idle runner either takes the lane or watches it for a stuck job.
  if (idle_ > 0) {
    cv_.notify_one();
    return;
  }
  if (spawn_locked() || runners_ > 0) {
    return; // a busy runner takes it once free
  }
  // No thread could be started and none runs (the process is at its thread limit):
  // completions run on one thread at a time, in their lanes' order, rather than never.
  // A job posted from inside one of them (a callback's own op) runs at once, as it would
  // in its child lane; one posted meanwhile by another thread is left to the draining one.
  const auto me = std::this_thread::get_id();
  if (inline_thread_ != std::thread::id() && inline_thread_ != me) {
    return;
  }
  const bool outermost = inline_thread_ == std::thread::id();
  inline_thread_ = me;
  while (true) {
    std::vector<std::function<void()>> jobs;
    for (auto it = lanes_.begin(); it != lanes_.end();) {
      if (it->second.owner != 0) {
        ++it; // a runner started since serves it
        continue;
      }
      for (auto& queued : it->second.jobs) {
        jobs.push_back(std::move(queued));
      }
      it = it->first != 0 ? lanes_.erase(it) : (it->second.jobs.clear(), std::next(it));
    }
    if (jobs.empty()) {
      break;
    }
    ready_.clear();
    lock.unlock();
    for (auto& queued : jobs) {
      const bool was_in_job = tl_in_job;
      tl_in_job = true; // a wait() inside must not wait for a completion only this thread runs
      try {
        queued();
      } catch (...) {
        // As in runner_loop: a Future reports its callbacks' errors itself.
      }
      tl_in_job = was_in_job;
    }
    jobs.clear(); // what they hold (a Future, its value) is freed without the lock: that may post
    lock.lock();
  }
  if (outermost) {
    inline_thread_ = std::thread::id();
  }
}

bool Callbacks::spawn_locked() {
  const uint64_t id = next_runner_++;
  try {
    std::thread([this, id] { runner_loop(id); }).detach();
  } catch (const std::system_error& e) {
    TORCH_WARN_ONCE("ccl: no thread could be started for Future callbacks (", e.what(),
                    "); they run on the thread that completes the op until one can");
    return false;
  }
  ++runners_; // under mutex_, which the new runner takes first
  return true;
}

bool Callbacks::rescue_stuck_locked() {
  const auto now = Clock::now();
  bool watching = false;
  for (auto& [lane, state] : lanes_) {
    if (state.owner == 0 || state.jobs.empty()) {
      continue;
    }
    if (now - state.job_started <= kStuckAfter) {
      watching = true;
      continue;
    }
    // Long, but not blocked on its lane: inside Work::wait(), waiting on ops it issued, or
    // computing since the last look.
    bool busy = state.runner && now - state.job_started < kKeepAtMost &&
        (state.runner->in_wait.load(std::memory_order_relaxed) > 0 ||
         (state.runner->job_ops && state.runner->job_ops->load(std::memory_order_relaxed) > 0));
    if (busy) {
      // Judged afresh from when that wait ends: the job then takes a moment (its Future's
      // completion, the GIL) before it computes or issues its next collective, and its CPU
      // time over the wait says nothing of that.
      state.looked = now;
      state.cpu_looked = state.runner->has_clock ? cpu_time(state.runner->cpu_clock) : std::chrono::nanoseconds(0);
      state.after_wait = true;
    } else if (state.runner && state.runner->has_clock && now - state.job_started < kKeepAtMost) {
      const auto since = now - state.looked;
      if (since < (state.after_wait ? kJudgeAfterWait : kJudgeOver)) {
        watching = true; // too soon to tell
        continue;
      }
      const auto cpu = cpu_time(state.runner->cpu_clock);
      busy = cpu - state.cpu_looked >= std::chrono::duration_cast<std::chrono::nanoseconds>(since * kComputing);
      state.looked = now;
      state.cpu_looked = cpu;
      state.after_wait = false;
    }
    if (busy) {
      watching = true;
    } else {
      state.owner = 0; // the stuck runner finishes its job, then lets go
      state.runner = nullptr;
      ready_.push_back(lane);
    }
  }
  return watching;
}

void Callbacks::runner_loop(uint64_t id) {
  pthread_setname_np(pthread_self(), "ccl-callbacks");
  Runner me;
  me.has_clock = pthread_getcpuclockid(pthread_self(), &me.cpu_clock) == 0;
  tl_in_wait = &me.in_wait;
  tl_job_ops = &me.job_ops;
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    while (ready_.empty()) {
      if (stop_) {
        --runners_;
        cv_.notify_all();
        return;
      }
      ++idle_;
      const bool watching = rescue_stuck_locked();
      if (ready_.empty()) {
        if (watching) {
          cv_.wait_for(lock, kStuckAfter / 4);
        } else if (cv_.wait_for(lock, kIdleExit) == std::cv_status::timeout && ready_.empty() &&
                   runners_ > 1) {
          --idle_;
          --runners_;
          return;
        }
      }
      --idle_;
    }
    const Lane lane = ready_.front();
    ready_.pop_front();
    auto it = lanes_.find(lane);
    if (it == lanes_.end() || it->second.owner != 0 || it->second.jobs.empty()) {
      continue; // taken or drained meanwhile
    }
    it->second.owner = id;
    it->second.runner = &me;
    while (it != lanes_.end() && it->second.owner == id && !it->second.jobs.empty()) {
      auto job = std::move(it->second.jobs.front());
      it->second.jobs.pop_front();
      it->second.job_started = it->second.looked = Clock::now();
      it->second.after_wait = false;
      it->second.cpu_looked = me.has_clock ? cpu_time(me.cpu_clock) : std::chrono::nanoseconds(0);
      me.job_ops = std::make_shared<std::atomic<int>>(0);
      lock.unlock();
      tl_in_job = true;
      tl_child_lane = 0;
      try {
        job();
      } catch (...) {
        // A Future reports its callbacks' errors itself; nothing to add here.
      }
      tl_in_job = false;
      job = nullptr; // drop captured state without the lock held
      lock.lock();
      it = lanes_.find(lane);
    }
    if (it != lanes_.end() && it->second.owner == id) {
      it->second.owner = 0;
      it->second.runner = nullptr;
      if (lane != 0) {
        lanes_.erase(it);
      }
    }
  }
}

void Callbacks::shutdown() {
  std::unique_lock<std::mutex> lock(mutex_);
  // Let queued completions finish, for a bounded time: a callback may be stuck.
  auto busy = [this] {
    if (!ready_.empty()) {
      return true;
    }
    for (const auto& entry : lanes_) {
      if (entry.second.owner != 0) {
        return true;
      }
    }
    return false;
  };
  for (int i = 0; i < 200 && busy(); ++i) {
    lock.unlock();
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    lock.lock();
  }
  stop_ = true;
  cv_.notify_all();
}

} // namespace oneccl_bind_pt

#include "helpers.hpp"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>

namespace oneccl_bind_pt {

namespace {

// Memory bandwidth, not cores, bounds a copy beyond a few threads; the cap keeps
// idle helpers few (each one spins briefly after a split, then sleeps).
constexpr int kMaxHelpers = 3;
constexpr int kMaxHelpersAsked = 64;
// After its piece a helper spins this long for the next split (the next chunk of
// the same collective comes after one meeting of the ranks), then sleeps.
constexpr auto kSpinFor = std::chrono::microseconds(50);

int env_int(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) {
    return -1;
  }
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  return *end || x < 0 ? -1 : static_cast<int>(std::min<long>(x, INT32_MAX));
}

HelperPlan choose() {
  HelperPlan plan;
  if (const char* asked = std::getenv("ONECCL_BIND_PT_HELPERS"); asked && *asked) {
    char* end = nullptr;
    const long x = std::strtol(asked, &end, 10);
    TORCH_CHECK_VALUE(*end == '\0' && x >= 0 && x <= kMaxHelpersAsked, "ONECCL_BIND_PT_HELPERS=", asked,
                      " is not a whole number from 0 to ", kMaxHelpersAsked);
    plan.count = static_cast<int>(x);
    plan.description = "helpers " + std::to_string(plan.count) + " (ONECCL_BIND_PT_HELPERS)";
    return plan;
  }
  cpu_set_t set;
  CPU_ZERO(&set);
  const int online = static_cast<int>(std::max<long>(1, sysconf(_SC_NPROCESSORS_ONLN)));
  const int cpus = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : online;
  int local = env_int("CCL_LOCAL_SIZE");
  if (local < 1) {
    local = std::max(1, env_int("LOCAL_WORLD_SIZE"));
  }
  // A set narrower than the host's: the launcher gave this rank its own cores.
  const bool pinned = cpus < online;
  const int mine = pinned ? cpus : std::max(1, cpus / local);
  const int compute = std::max(1, at::get_num_threads());
  plan.count = std::clamp(mine - compute, 0, kMaxHelpers);
  auto of = [](int n, const char* what) { return std::to_string(n) + " " + what + (n == 1 ? "" : "s"); };
  plan.description = "helpers " + std::to_string(plan.count) + " (" + of(mine, "core") + " for this rank: " +
      (pinned ? of(cpus, "CPU") + " in its affinity" : of(cpus, "CPU") + " / " + of(local, "rank") + " on this host") +
      "; less " + of(compute, "torch thread") + "; at most " + std::to_string(kMaxHelpers) +
      "; ONECCL_BIND_PT_HELPERS sets it)";
  return plan;
}

class Pool {
 public:
  explicit Pool(int helpers) : helpers_(helpers) {
    // Helpers take no signals: Python's handlers and the launchers' signals stay the
    // main thread's business.
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    for (int i = 1; i <= helpers_; ++i) {
      std::thread([this, i] { loop(i); }).detach();
    }
    pthread_sigmask(SIG_SETMASK, &old, nullptr);
  }

  // False when another thread's split holds the pool.
  bool run(size_t total, size_t align, int pieces, Part part, void* ctx) {
    std::unique_lock<std::mutex> lock(use_, std::try_to_lock);
    if (!lock.owns_lock()) {
      return false;
    }
    total_ = total;
    align_ = align;
    pieces_ = pieces;
    part_ = part;
    ctx_ = ctx;
    remaining_.store(helpers_, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
    generation_.notify_all();
    piece(0);
    // Every helper takes part in every generation (the next starts after this
    // wait), so each one's piece is a bounded memory move that is under way.
    for (unsigned spins = 0; remaining_.load(std::memory_order_acquire) != 0;) {
      // Yields too: with helpers asked for beyond the cores, a helper needs this core.
      if (++spins > 64) {
        std::this_thread::yield();
      } else {
        __builtin_ia32_pause();
      }
    }
    return true;
  }

 private:
  void piece(int i) const {
    if (i >= pieces_) {
      return;
    }
    const size_t per = (total_ / align_ + pieces_ - 1) / pieces_ * align_;
    const size_t lo = std::min(total_, per * i);
    const size_t hi = i + 1 == pieces_ ? total_ : std::min(total_, lo + per);
    if (hi > lo) {
      part_(ctx_, lo, hi);
    }
  }

  void loop(int index) {
    pthread_setname_np(pthread_self(), "ccl-helper");
    // 0, not a load: a thread that starts after the first split was posted must still take it.
    int seen = 0;
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + kSpinFor;
      int now;
      for (unsigned spins = 0; (now = generation_.load(std::memory_order_acquire)) == seen;) {
        if (++spins % 64 != 0 || std::chrono::steady_clock::now() < until) {
          __builtin_ia32_pause();
        } else {
          generation_.wait(seen, std::memory_order_acquire);
        }
      }
      seen = now;
      piece(index);
      remaining_.fetch_sub(1, std::memory_order_release);
    }
  }

  const int helpers_;
  std::mutex use_;
  std::atomic<int> generation_{0};
  std::atomic<int> remaining_{0};
  // The split under way: written before generation_ is bumped (release), read after.
  size_t total_ = 0, align_ = 1;
  int pieces_ = 0;
  Part part_ = nullptr;
  void* ctx_ = nullptr;
};

// Made at the first split; a forked child (whose copy has no threads) makes its own.
std::atomic<Pool*> g_pool{nullptr};
pthread_mutex_t g_making = PTHREAD_MUTEX_INITIALIZER;

void forget_pool_in_child() {
  g_pool.store(nullptr, std::memory_order_relaxed); // the parent's: left, its threads are not here
  pthread_mutex_init(&g_making, nullptr);
}

Pool* pool() {
  Pool* p = g_pool.load(std::memory_order_acquire);
  if (p || helper_plan().count == 0) {
    return p;
  }
  pthread_mutex_lock(&g_making);
  p = g_pool.load(std::memory_order_acquire);
  if (!p) {
    static const bool registered = (pthread_atfork(nullptr, nullptr, forget_pool_in_child), true);
    (void)registered;
    p = new Pool(helper_plan().count); // lives as long as the process
    g_pool.store(p, std::memory_order_release);
  }
  pthread_mutex_unlock(&g_making);
  return p;
}

} // namespace

const HelperPlan& helper_plan() {
  static const HelperPlan plan = choose();
  return plan;
}

void split(size_t total, size_t align, size_t min_per_piece, Part part, void* ctx) {
  const int helpers = helper_plan().count;
  const size_t units_per_piece = std::max<size_t>(align, min_per_piece);
  const int pieces = static_cast<int>(std::min<size_t>(helpers + 1, total / units_per_piece));
  Pool* p = pieces > 1 ? pool() : nullptr;
  if (!p || !p->run(total, align, pieces, part, ctx)) {
    part(ctx, 0, total);
  }
}

} // namespace oneccl_bind_pt

#include "helpers.hpp"
#include "made_once.hpp"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <xmmintrin.h>
#include <sched.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <climits>
#include <cstring>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <mutex>
#include <sstream>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

namespace oneccl_bind_pt {

namespace {

// Memory bandwidth, not cores, bounds a copy beyond a few threads; the cap keeps
// idle helpers few (each one spins briefly after a split, then sleeps). On a 16-core
// Intel Xeon, 2 ranks, 6 helpers against 3 took 0.56-0.88x the time at 16 MiB for
// allreduce, allgather, reduce_scatter and broadcast, 0.80-1.13x at 64 MiB, and send/recv
// 1.1-1.2x (one run, docs/performance.md, run C).
constexpr int kMaxHelpers = 6;
constexpr int kMaxHelpersAsked = 64;
constexpr int kMaxIdleCpus = 1 << 16;
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

// The CPUs this process may use when the count is chosen; the helpers run on them
// (not on whatever a thread that later makes the pool was narrowed to, e.g. by OpenMP).
cpu_set_t g_mask;

// A "0-7,16,18-19" CPU list's size.
int count_cpu_list(const std::string& list) {
  int n = 0;
  size_t at = 0;
  while (at < list.size()) {
    const size_t comma = std::min(list.find(',', at), list.size());
    const std::string part = list.substr(at, comma - at);
    const size_t dash = part.find('-');
    try {
      n += dash == std::string::npos ? 1 : std::stoi(part.substr(dash + 1)) - std::stoi(part.substr(0, dash)) + 1;
    } catch (const std::exception&) {
      return 0;
    }
    at = comma + 1;
  }
  return n;
}

// What a container (cgroup v2, or v1's cpuset and cpu controllers) allows this
// process: its cpuset's CPUs and its CPU quota in whole CPUs (0: no limit, or not known).
struct Container {
  int cpuset = 0;
  int quota = 0;
};

int quota_cpus(long quota, long period) {
  return quota > 0 && period > 0 ? static_cast<int>(std::max(1L, (quota + period - 1) / period)) : 0;
}

Container container() {
  Container box;
  std::ifstream cgroup("/proc/self/cgroup");
  std::string line, v2, v1_cpuset, v1_cpu;
  while (std::getline(cgroup, line)) {
    // "hierarchy:controllers:path"
    const size_t a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) {
      continue;
    }
    const std::string controllers = "," + line.substr(a + 1, b - a - 1) + ",";
    const std::string path = line.substr(b + 1) == "/" ? "" : line.substr(b + 1);
    if (line.rfind("0::", 0) == 0) {
      v2 = "/sys/fs/cgroup" + path;
    } else if (controllers.find(",cpuset,") != std::string::npos) {
      v1_cpuset = "/sys/fs/cgroup/cpuset" + path;
    } else if (controllers.find(",cpu,") != std::string::npos) {
      v1_cpu = "/sys/fs/cgroup/" + line.substr(a + 1, b - a - 1) + path;
    }
  }
  std::string list;
  if (std::ifstream f(v2 + "/cpuset.cpus.effective"); !v2.empty() && f >> list) {
    box.cpuset = count_cpu_list(list);
  } else if (std::ifstream g(v1_cpuset + "/cpuset.effective_cpus"); !v1_cpuset.empty() && g >> list) {
    box.cpuset = count_cpu_list(list);
  }
  std::string max;
  long quota = 0, period = 0;
  if (std::ifstream f(v2 + "/cpu.max"); !v2.empty() && f >> max >> period) {
    try {
      box.quota = max == "max" ? 0 : quota_cpus(std::stol(max), period);
    } catch (const std::exception&) {
    }
  } else if (std::ifstream q(v1_cpu + "/cpu.cfs_quota_us"), r(v1_cpu + "/cpu.cfs_period_us");
             !v1_cpu.empty() && q >> quota && r >> period) {
    box.quota = quota_cpus(quota, period);
  }
  return box;
}

// oneCCL's worker threads this process will have, from the variables the package
// sets before the first group (_env.py) or the user did: none with
// CCL_WORKER_OFFLOAD=0, else CCL_WORKER_COUNT, else oneCCL's own 1 once any
// CCL_WORKER_* is set; none when nothing is (the doctor, before any group).
int oneccl_workers() {
  const char* offload = std::getenv("CCL_WORKER_OFFLOAD");
  if (offload && std::string(offload) == "0") {
    return 0;
  }
  const int count = env_int("CCL_WORKER_COUNT");
  if (count >= 0) {
    return count;
  }
  const char* affinity = std::getenv("CCL_WORKER_AFFINITY");
  return (offload && *offload) || (affinity && *affinity) ? 1 : 0;
}

// This process's siblings (the launcher's other children: torchrun's or mp.spawn's
// ranks, an MPI proxy's, a shell's), from /proc/PPID/task/*/children, else by a scan
// of /proc. None where the parent is init or another namespace's (getppid() is 0).
std::vector<pid_t> siblings() {
  std::vector<pid_t> found;
  const pid_t self = getpid(), parent = getppid();
  if (parent <= 1) {
    return found;
  }
  const std::string tasks = "/proc/" + std::to_string(parent) + "/task";
  bool listed = false;
  if (DIR* dir = opendir(tasks.c_str())) {
    while (const dirent* e = readdir(dir)) {
      std::ifstream children(tasks + "/" + e->d_name + "/children");
      listed = listed || children.is_open();
      for (long pid; children >> pid;) {
        if (pid != self) {
          found.push_back(static_cast<pid_t>(pid));
        }
      }
    }
    closedir(dir);
  }
  if (listed) {
    return found;
  }
  // A kernel without CONFIG_PROC_CHILDREN: every process's parent, from /proc/PID/stat
  // ("pid (comm) state ppid ...", comm may hold spaces and parentheses).
  if (DIR* dir = opendir("/proc")) {
    while (const dirent* e = readdir(dir)) {
      char* end = nullptr;
      const long pid = std::strtol(e->d_name, &end, 10);
      if (*end || pid <= 0 || pid == self) {
        continue;
      }
      std::ifstream f(std::string("/proc/") + e->d_name + "/stat");
      std::string stat((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
      const size_t close = stat.rfind(')');
      if (close == std::string::npos) {
        continue;
      }
      std::istringstream rest(stat.substr(close + 1));
      std::string state;
      long ppid = 0;
      if (rest >> state >> ppid && ppid == parent) {
        found.push_back(static_cast<pid_t>(pid));
      }
    }
    closedir(dir);
  }
  return found;
}

// How many siblings run on CPUs of this rank's set and on no other: other ranks given
// the same set (a job-wide taskset or numactl around torchrun or mp.spawn, an MPI
// launcher binding ranks per socket). A sibling with a wider set (mp.spawn's resource
// tracker keeps the parent's) is not counted, nor one whose set is apart from it
// (a launcher pinning each rank).
int siblings_within(const cpu_set_t& mine) {
  int within = 0;
  for (const pid_t pid : siblings()) {
    cpu_set_t theirs, both;
    CPU_ZERO(&theirs);
    if (sched_getaffinity(pid, sizeof theirs, &theirs) != 0) {
      continue; // gone since
    }
    CPU_AND(&both, &theirs, &mine);
    within += CPU_COUNT(&both) > 0 && CPU_EQUAL(&both, &theirs);
  }
  return within;
}

std::string of(int n, const char* what) {
  return std::to_string(n) + " " + what + (n == 1 ? "" : "s");
}

// The CPUs the idle helpers' share comes from (this process's, and no more than a
// container's CPU quota) and the ranks on this host, set with the plan.
int g_allowed = 1;
int g_local = 1;
int g_loadavg = -1; // /proc/loadavg, opened with the plan where it has idle helpers
// Idle helpers a split takes whenever this rank's compute is idle: the rank's own cores
// less the op's thread, oneCCL's workers and the helpers it always has (set with the plan).
int g_own_idle = 0;

// A whole number from `least` to `most` in `name`, or -1 where unset or empty; "auto"
// (where `automatic` allows it) gives -2.
int asked_count(const char* name, bool automatic, int least = 0, int most = kMaxHelpersAsked) {
  const char* asked = std::getenv(name);
  if (!asked || !*asked) {
    return -1;
  }
  if (automatic && std::string(asked) == "auto") {
    return -2;
  }
  char* end = nullptr;
  const long x = std::strtol(asked, &end, 10);
  TORCH_CHECK_VALUE(*end == '\0' && x >= least && x <= most, name, "=", asked,
                    " is not a whole number from ", least, " to ", most, automatic ? " or auto" : "");
  return static_cast<int>(x);
}

HelperPlan choose() {
  HelperPlan plan;
  CPU_ZERO(&g_mask);
  if (sched_getaffinity(0, sizeof g_mask, &g_mask) != 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      CPU_SET(c, &g_mask);
    }
  }
  const int forced = asked_count("ONECCL_BIND_PT_HELPERS", false);
  const int idle = asked_count("ONECCL_BIND_PT_IDLE_HELPERS", true);
  const int idle_cpus = asked_count("ONECCL_BIND_PT_IDLE_CPUS", false, 1, kMaxIdleCpus);
  const int local = local_ranks();
  const int workers = oneccl_workers();
  RankCores mine;
  if (forced < 0 || idle != -1) {
    mine = rank_cores(local);
  }
  if (forced >= 0) {
    plan.count = forced;
    plan.description = "helpers " + std::to_string(plan.count) + " (ONECCL_BIND_PT_HELPERS)";
  } else {
    const int compute = std::max(1, at::get_num_threads());
    // In long: an absurd CCL_WORKER_COUNT (read up to INT32_MAX) must not wrap to a large count.
    plan.count = static_cast<int>(std::clamp<long>(static_cast<long>(mine.cores) - compute - workers, 0, kMaxHelpers));
    plan.description = "helpers " + std::to_string(plan.count) + " (" + of(mine.cores, "core") + " for this rank: " +
        mine.why + "; less " + of(compute, "torch thread") +
        (workers > 0 ? "; less " + of(workers, "oneCCL worker") : std::string()) + "; at most " +
        std::to_string(kMaxHelpers) + "; ONECCL_BIND_PT_HELPERS sets it)";
  }
  if (idle == -2) {
    // Every core of the rank but the one running the op and oneCCL's workers', at most
    // kMaxHelpers with the others.
    plan.idle = static_cast<int>(std::clamp<long>(static_cast<long>(mine.cores) - 1 - workers - plan.count, 0,
                                                  std::max(0, kMaxHelpers - plan.count)));
    plan.description += "; up to " + std::to_string(plan.idle) + " more while this rank's compute or the host is idle (" +
        of(mine.cores, "core") + " less the op's thread" + (workers > 0 ? " and " + of(workers, "oneCCL worker") : "") +
        "; ONECCL_BIND_PT_IDLE_HELPERS=auto)";
  } else if (idle > 0) {
    plan.idle = idle;
    plan.description += "; up to " + std::to_string(plan.idle) + " more while this rank's compute or the host is idle (ONECCL_BIND_PT_IDLE_HELPERS)";
  }
  // What /proc/loadavg's count of runnable threads is out of: the host's CPUs, or a
  // container's (its cpuset, its CPU quota), not this rank's own narrower set.
  const Container box = container();
  const int online = static_cast<int>(std::max<long>(1, sysconf(_SC_NPROCESSORS_ONLN)));
  g_allowed = box.cpuset > 0 ? std::min(box.cpuset, online) : online;
  if (box.quota > 0) {
    g_allowed = std::min(g_allowed, box.quota);
  }
  if (plan.idle > 0) {
    g_loadavg = ::open("/proc/loadavg", O_RDONLY | O_CLOEXEC); // once, with the plan
  }
  if (idle_cpus > 0) {
    g_allowed = idle_cpus;
    if (plan.idle > 0) {
      plan.description += "; idle cores counted among " + of(idle_cpus, "CPU") + " (ONECCL_BIND_PT_IDLE_CPUS)";
    }
  }
  g_local = local;
  if (plan.idle > 0) {
    // ONECCL_BIND_PT_IDLE_CPUS, the host's CPUs for the count, caps this too (shared by its ranks).
    const long cores = idle_cpus > 0 ? std::min(mine.cores, std::max(1, idle_cpus / std::max(1, local))) : mine.cores;
    g_own_idle = static_cast<int>(std::clamp<long>(cores - 1 - workers - plan.count, 0, plan.idle));
    if (g_own_idle < plan.idle) {
      plan.description += "; " + std::to_string(g_own_idle) + " of them whenever this rank's compute is idle (" +
          of(static_cast<int>(cores), "core") + " for this rank)";
    }
  }
  return plan;
}

// The pieces of a split are claimed, not assigned: the caller claims them too, so a
// helper that is slow to wake (asleep, or its core busy) never delays the split; the
// caller only waits for pieces already under way.
class Pool {
 public:
  // `always` helpers wake for every split; the rest (idle helpers) only for a split that
  // has pieces for them, so a split while the host is busy leaves them asleep.
  Pool(int always, int helpers) : always_(always) {
    // Helpers take no asynchronous signals: Python's handlers and the launchers' signals
    // stay the main thread's business. A fault in a helper still reaches the handlers.
    sigset_t mask, old;
    sigfillset(&mask);
    for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT, SIGTRAP}) {
      sigdelset(&mask, sig);
    }
    pthread_sigmask(SIG_BLOCK, &mask, &old);
    struct Restore {
      sigset_t* old;
      ~Restore() { pthread_sigmask(SIG_SETMASK, old, nullptr); }
    } restore{&old};
    for (int i = 0; i < helpers; ++i) {
      try {
        std::thread([this, i] { loop(i < always_ ? generation_ : idle_generation_); }).detach();
      } catch (const std::system_error&) {
        break; // no more threads to be had (a pids limit): fewer helpers, the caller claims the rest
      }
    }
  }

  // Helpers not asleep (spinning for the next split, or working): runnable threads of ours.
  int awake() const { return awake_.load(std::memory_order_relaxed); }

  // False when another thread's split holds the pool.
  bool run(size_t total, size_t align, int pieces, Part part, void* ctx) {
    std::unique_lock<std::mutex> lock(use_, std::try_to_lock);
    if (!lock.owns_lock()) {
      return false;
    }
    total_ = total;
    align_ = align;
    part_ = part;
    ctx_ = ctx;
    csr_ = _mm_getcsr(); // the caller's rounding and denormal modes, for every piece
    done_.store(0, std::memory_order_relaxed);
    const uint32_t g = ++generation_count_;
    // Publishes the fields above to whoever claims a piece of generation g.
    claims_.store(pack(g, pieces, 0), std::memory_order_release);
    // A read-modify-write: notify_all's check for sleepers cannot move ahead of it.
    generation_.exchange(static_cast<int>(g), std::memory_order_seq_cst);
    generation_.notify_all();
    if (pieces > always_ + 1) {
      idle_generation_.exchange(static_cast<int>(g), std::memory_order_seq_cst);
      idle_generation_.notify_all();
    }
    work(g);
    for (unsigned spins = 0; done_.load(std::memory_order_acquire) != pieces;) {
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
  // claims_: generation (32 bits), pieces (16), next piece to claim (16).
  static uint64_t pack(uint32_t g, int pieces, int next) {
    return uint64_t{g} << 32 | uint64_t(pieces) << 16 | uint64_t(next);
  }

  // Claims and runs pieces of generation g until none is left; a generation that is
  // over (its pieces all claimed, or a newer one posted) is left alone.
  void work(uint32_t g) {
    for (;;) {
      uint64_t c = claims_.load(std::memory_order_acquire);
      int pieces, i;
      do {
        pieces = static_cast<int>((c >> 16) & 0xffff);
        i = static_cast<int>(c & 0xffff);
        if (static_cast<uint32_t>(c >> 32) != g || i >= pieces) {
          return;
        }
      } while (!claims_.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel, std::memory_order_acquire));
      // Claimed: the fields stay as they are until done_ counts this piece.
      if (_mm_getcsr() != csr_) {
        _mm_setcsr(csr_);
      }
      const size_t per = (total_ / align_ + pieces - 1) / pieces * align_;
      const size_t lo = std::min(total_, per * i);
      const size_t hi = i + 1 == pieces ? total_ : std::min(total_, lo + per);
      if (hi > lo) {
        part_(ctx_, lo, hi);
      }
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  void loop(std::atomic<int>& generation) {
    pthread_setname_np(pthread_self(), "ccl-helper");
    pthread_setaffinity_np(pthread_self(), sizeof g_mask, &g_mask);
    awake_.fetch_add(1, std::memory_order_relaxed);
    int seen = 0;
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + kSpinFor;
      int now;
      for (unsigned spins = 0; (now = generation.load(std::memory_order_acquire)) == seen;) {
        if (++spins % 64 != 0 || std::chrono::steady_clock::now() < until) {
          __builtin_ia32_pause();
        } else {
          awake_.fetch_sub(1, std::memory_order_relaxed);
          generation.wait(seen, std::memory_order_acquire);
          awake_.fetch_add(1, std::memory_order_relaxed);
        }
      }
      seen = now;
      work(static_cast<uint32_t>(now));
    }
  }

  std::mutex use_;
  uint32_t generation_count_ = 0;                // the caller's, under use_
  const int always_;
  alignas(64) std::atomic<int> generation_{0};   // what helpers sleep on
  alignas(64) std::atomic<int> idle_generation_{0}; // and idle helpers
  alignas(64) std::atomic<uint64_t> claims_{0};
  alignas(64) std::atomic<int> done_{0};
  alignas(64) std::atomic<int> awake_{0};
  // The split under way: written before claims_ (release), read after a claim.
  alignas(64) size_t total_ = 0;
  size_t align_ = 1;
  Part part_ = nullptr;
  void* ctx_ = nullptr;
  unsigned csr_ = 0;
};

// Made at the first split; a forked child (whose copy has no threads) makes its own
// (forget_helpers_in_child).
std::atomic<Pool*> g_pool{nullptr};
pthread_mutex_t g_making = PTHREAD_MUTEX_INITIALIZER;

Pool* pool() {
  Pool* p = g_pool.load(std::memory_order_acquire);
  if (p || helper_plan().count + helper_plan().idle == 0) {
    return p;
  }
  pthread_mutex_lock(&g_making);
  struct Unlock {
    ~Unlock() { pthread_mutex_unlock(&g_making); }
  } unlock;
  p = g_pool.load(std::memory_order_acquire);
  if (!p) {
    p = new Pool(helper_plan().count, helper_plan().count + helper_plan().idle); // lives as long as the process
    g_pool.store(p, std::memory_order_release);
  }
  return p;
}

std::atomic<uint64_t> g_splits{0};
std::atomic<uint64_t> g_idle_splits{0};
// Off: splits leave the idle helpers be (bench_ddp's `ccl` beside `ccl+idle`, same processes).
std::atomic<bool> g_idle_allowed{true};

// The idle helpers' share, read again at most this often: reading costs a few
// microseconds, a staged step of a large collective takes tens to hundreds.
constexpr auto kReadIdleEvery = std::chrono::microseconds(200);
std::atomic<int64_t> g_idle_until{0};
std::atomic<int> g_idle_now{0};

thread_local pid_t t_issuer = 0; // IssuerScope's

// The last readings of the issuing threads' states, each read again at most every
// kReadIdleEvery; a few threads' at once (ops of several issuers interleave). Plain data
// under a pthread mutex, which a forked child can set up afresh.
struct IssuerReading {
  pid_t tid = 0;
  int fd = -1; // its /proc stat; -2: could not be opened (a thread gone, another /proc)
  int asleep = 0; // readings in a row, each within kReadAgainWithin of the last, that found it asleep
  int64_t read_at = 0;
};
constexpr int kIssuersKept = 4;
// A reading older than this starts the count again: readings come only with splits.
constexpr auto kReadAgainWithin = std::chrono::microseconds(600);
pthread_mutex_t g_issuer_lock = PTHREAD_MUTEX_INITIALIZER;
IssuerReading g_issuers[kIssuersKept];

// Whether `fd`'s thread is asleep (waiting: for a Future, a lock, I/O).
bool stat_says_asleep(int fd) {
  char text[512];
  const ssize_t n = ::pread(fd, text, sizeof text - 1, 0);
  if (n <= 0) {
    return false;
  }
  text[n] = '\0';
  // "tid (comm) S ...": the state follows the last ')' (a name may hold one).
  const char* close = std::strrchr(text, ')');
  return close && close[1] == ' ' && (close[2] == 'S' || close[2] == 'D');
}

// Whether thread `tid` of this process has been asleep for two readings in a row (one
// could fall on a moment it waits inside its own compute: a lock, an OpenMP barrier whose
// runtime sleeps at once).
bool issuer_sleeps(pid_t tid, int64_t now) {
  using std::chrono::nanoseconds;
  pthread_mutex_lock(&g_issuer_lock);
  IssuerReading* r = nullptr;
  for (auto& kept : g_issuers) {
    if (kept.tid == tid) {
      r = &kept;
      break;
    }
    if (!r || kept.read_at < r->read_at) {
      r = &kept; // else the one read longest ago makes room
    }
  }
  if (r->tid != tid) {
    if (r->fd >= 0) {
      ::close(r->fd);
    }
    const std::string path = "/proc/self/task/" + std::to_string(tid) + "/stat";
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    *r = IssuerReading{tid, fd >= 0 ? fd : -2, 0, 0};
  }
  const int64_t every = nanoseconds(kReadIdleEvery).count();
  if (r->fd >= 0 && now - r->read_at >= every) {
    const bool recent = now - r->read_at <= nanoseconds(kReadAgainWithin).count();
    r->asleep = stat_says_asleep(r->fd) ? (recent ? r->asleep : 0) + 1 : 0;
    r->read_at = now;
  }
  const bool asleep = r->asleep >= 2;
  pthread_mutex_unlock(&g_issuer_lock);
  return asleep;
}

// Idle helpers a split may take now. Where this rank's torch compute is idle, as many as its
// own cores leave (g_own_idle): the split runs on the thread that issued the op (a
// collective waited for where it was issued), or that thread sleeps (DDP's reducer waiting
// for its last buckets after the backward pass), so the OpenMP team it computes with has
// no work. libgomp's threads spin a few ms past each parallel region, runnable meanwhile,
// which /proc/loadavg cannot tell from work. Otherwise the host's free CPUs decide
// (idle_share). The issuer stands for the rank's compute: torch's parallel regions start
// from the thread that computes, which issues the collectives in a training loop.
int idle_now(int most) {
  const int64_t now = std::chrono::steady_clock::now().time_since_epoch().count();
  if (now >= g_idle_until.load(std::memory_order_relaxed)) {
    // Threads splitting at once may both read: harmless, either value is recent.
    g_idle_until.store(now + std::chrono::nanoseconds(kReadIdleEvery).count(), std::memory_order_relaxed);
    const Pool* p = g_pool.load(std::memory_order_acquire);
    const int running = runnable_threads();
    g_idle_now.store(running < 0 ? 0 : idle_share(g_allowed, running, p ? p->awake() : 0, g_local, most),
                     std::memory_order_relaxed);
  }
  const int host = g_idle_now.load(std::memory_order_relaxed);
  if (g_own_idle > 0) {
    const pid_t issuer = t_issuer != 0 ? t_issuer : getpid();
    if (issuer == this_thread_id() || issuer_sleeps(issuer, now)) {
      return std::max(host, std::min(most, g_own_idle));
    }
  }
  return host;
}

} // namespace

void check_helper_settings() {
  asked_count("ONECCL_BIND_PT_HELPERS", false);
  asked_count("ONECCL_BIND_PT_IDLE_HELPERS", true);
  asked_count("ONECCL_BIND_PT_IDLE_CPUS", false, 1, kMaxIdleCpus);
}

int idle_share(int allowed, int running, int awake, int local, int most) {
  local = std::max(1, local);
  const long free = static_cast<long>(allowed) - running + static_cast<long>(awake) * local;
  return static_cast<int>(std::clamp<long>(free / local, 0, std::max(0, most)));
}

int runnable_threads() {
  // pread at 0 renders the file anew each time.
  int fd = g_loadavg;
  bool own = false;
  if (fd < 0) {
    fd = ::open("/proc/loadavg", O_RDONLY | O_CLOEXEC); // a caller outside the plan (tests, the doctor)
    own = true;
  }
  if (fd < 0) {
    return -1;
  }
  char text[128];
  const ssize_t n = ::pread(fd, text, sizeof text - 1, 0);
  if (own) {
    ::close(fd);
  }
  if (n <= 0) {
    return -1;
  }
  text[n] = '\0';
  // "0.52 0.58 0.59 3/512 12345": runnable / all scheduling entities
  const char* at = text;
  for (int field = 0; field < 3; ++field) {
    at = std::strchr(at, ' ');
    if (!at) {
      return -1;
    }
    ++at;
  }
  char* end = nullptr;
  const long running = std::strtol(at, &end, 10);
  // At least the reader runs: 0 is a count this kernel (or sandbox) does not keep.
  return end == at || *end != '/' || running < 1 ? -1 : static_cast<int>(std::min<long>(running, INT32_MAX));
}

bool may_split() {
  const HelperPlan& plan = helper_plan();
  return plan.count + plan.idle > 0;
}

pid_t this_thread_id() {
  // Once per thread (every op asks, at issue): a forked child's thread asks again.
  thread_local pid_t tid = 0;
  thread_local unsigned forks = 0;
  const unsigned now = g_forks.load(std::memory_order_relaxed);
  if (tid == 0 || forks != now) {
    tid = static_cast<pid_t>(syscall(SYS_gettid));
    forks = now;
  }
  return tid;
}

pid_t current_issuer() {
  return t_issuer != 0 ? t_issuer : this_thread_id();
}

IssuerScope::IssuerScope(pid_t issuer) : previous_(t_issuer) {
  t_issuer = issuer;
}

IssuerScope::~IssuerScope() {
  t_issuer = previous_;
}

bool allow_idle_helpers(bool allowed) {
  return g_idle_allowed.exchange(allowed, std::memory_order_relaxed);
}

std::pair<uint64_t, uint64_t> split_counts() {
  return {g_splits.load(std::memory_order_relaxed), g_idle_splits.load(std::memory_order_relaxed)};
}

void forget_helpers_in_child() {
  g_pool.store(nullptr, std::memory_order_relaxed); // the parent's: left, its threads are not here
  g_splits.store(0, std::memory_order_relaxed);
  g_idle_splits.store(0, std::memory_order_relaxed);
  g_idle_until.store(0, std::memory_order_relaxed);
  // The parent's threads' readings: their fds are left open (the fork may have come while
  // another thread was changing one, so a number here may not be ours to close).
  pthread_mutex_init(&g_issuer_lock, nullptr);
  for (auto& kept : g_issuers) {
    kept = IssuerReading{};
  }
  pthread_mutex_init(&g_making, nullptr);
}

RankCores rank_cores(int local) {
  local = std::max(1, local);
  RankCores r;
  cpu_set_t mask;
  CPU_ZERO(&mask);
  const int online = static_cast<int>(std::max<long>(1, sysconf(_SC_NPROCESSORS_ONLN)));
  const int cpus = sched_getaffinity(0, sizeof mask, &mask) == 0 ? CPU_COUNT(&mask) : online;
  const Container box = container();
  const int allowed = box.cpuset > 0 ? std::min(box.cpuset, online) : online;
  // Ranks that share one set narrower than the host (a job-wide taskset or numactl, or
  // an MPI launcher's binding per socket) divide it; the siblings tell them apart from
  // ranks pinned each to a set of its own. At most this host's ranks share it (the
  // siblings may include a process that is no rank).
  const int sharing = cpus < allowed ? std::min(local, 1 + siblings_within(mask)) : 1;
  if (sharing > 1) {
    r.cores = std::max(1, cpus / sharing);
    r.crowded = sharing > cpus;
    r.why = of(cpus, "CPU") + " in its affinity / " + of(sharing, "rank") + " given the same CPUs";
  } else {
    // A set narrower than what the host or container allows is this rank's own (a
    // launcher pinned it), unless it is too wide for every rank to have one like it.
    r.pinned = cpus < allowed && static_cast<long>(cpus) * local <= allowed;
    r.cores = r.pinned ? cpus : std::max(1, cpus / local);
    r.crowded = !r.pinned && local > cpus;
    r.why = r.pinned ? of(cpus, "CPU") + " in its affinity" : of(cpus, "CPU") + " / " + of(local, "rank") + " on this host";
  }
  // A CPU quota is the container's, shared by all its ranks.
  if (box.quota > 0 && box.quota / local < r.cores) {
    r.cores = std::max(1, box.quota / local);
    r.why = "a CPU quota of " + of(box.quota, "CPU") + " / " + of(local, "rank");
  }
  r.crowded = r.crowded || (box.quota > 0 && local > box.quota);
  return r;
}

int local_ranks() {
  const int local = env_int("CCL_LOCAL_SIZE");
  return local >= 1 ? local : std::max(1, env_int("LOCAL_WORLD_SIZE"));
}

const HelperPlan& helper_plan() {
  static const HelperPlan plan = choose();
  return plan;
}

void split(size_t total, size_t align, size_t min_per_piece, Part part, void* ctx) {
  const HelperPlan& plan = helper_plan();
  const size_t units_per_piece = std::max<size_t>(align, min_per_piece);
  const size_t most = total / units_per_piece;
  int helpers = plan.count;
  if (plan.idle > 0 && most > static_cast<size_t>(helpers) + 1 && g_idle_allowed.load(std::memory_order_relaxed)) {
    helpers += idle_now(plan.idle);
  }
  const int pieces = static_cast<int>(std::min<size_t>(helpers + 1, most));
  Pool* p = pieces > 1 ? pool() : nullptr;
  if (!p || !p->run(total, align, pieces, part, ctx)) {
    part(ctx, 0, total);
    return;
  }
  g_splits.fetch_add(1, std::memory_order_relaxed);
  if (pieces > plan.count + 1) {
    g_idle_splits.fetch_add(1, std::memory_order_relaxed);
  }
}

} // namespace oneccl_bind_pt

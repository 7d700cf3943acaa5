// Helper threads: a rank's large copies and reductions on the shared-memory
// transport split across threads on cores the rank would otherwise leave idle.
//
// One pool per process, made at the first split. How many threads comes once,
// at the first process group's creation, from ONECCL_BIND_PT_HELPERS or from
// the cores this rank has: its CPU affinity if a launcher narrowed it below what
// the host or container allows (and every local rank could have a set that
// size), divided among the ranks given the same set (a taskset or numactl around
// the launcher), else those CPUs divided by the ranks on this host (CCL_LOCAL_SIZE),
// and no more than a container's CPU quota divided the same way; less torch's
// intra-op threads (at::get_num_threads(), which DDP's compute uses beside the
// collectives) and oneCCL's worker threads, at most 6. So a host with no spare
// core gets none, and a rank whose compute uses every core it has gets none. Helpers run on the CPUs the
// process had then, take no asynchronous signals, spin 50 us after a split,
// then sleep; a thread that cannot be started leaves fewer helpers.
//
// Idle helpers (ONECCL_BIND_PT_IDLE_HELPERS, off unless set): more threads, used by a split
// only while the host's runnable threads leave cores free, e.g. DDP's last buckets after
// the backward pass, when the cores torch's threads computed on go idle.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <utility>
#include <string>

namespace oneccl_bind_pt {

struct HelperPlan {
  int count = 0;            // threads besides the one running the collective
  int idle = 0;             // more, used only while the host has idle cores
  std::string description;  // one line for the doctor: the count and why
};

// The cores this rank has, where the helper count and oneCCL's worker count
// (_env.py) start: its CPU affinity if a launcher narrowed it below what the host
// or container allows (and each of `local_ranks` could have a set that size), else
// those CPUs / local_ranks, and no more than a container's CPU quota / local_ranks.
// A narrow set that sibling processes (the launcher's other children) have too is
// shared: divided by them and this rank, at most local_ranks in all.
struct RankCores {
  int cores = 1;
  bool pinned = false;  // the affinity is this rank's own
  bool crowded = false; // more ranks on this host than the CPUs (or CPU quota) they share
  std::string why;      // e.g. "16 CPUs / 2 ranks on this host"
};
RankCores rank_cores(int local_ranks);
// The ranks on this host: CCL_LOCAL_SIZE (the package sets it before the first group),
// else LOCAL_WORLD_SIZE, else 1.
int local_ranks();

// Chosen once per process; throws c10::ValueError for an ONECCL_BIND_PT_HELPERS
// that is not a whole number from 0 to kMaxHelpersAsked.
const HelperPlan& helper_plan();
// The same refusals as helper_plan()'s, choosing nothing: before the package's defaults
// (CCL_LOCAL_SIZE, CCL_WORKER_COUNT) that the plan depends on are set.
void check_helper_settings();

// Whether a split may run on helpers at all (always-used or idle ones): below, a copy or
// reduction runs on the calling thread without asking.
bool may_split();

// The idle helpers a split may use, by the host's count: the CPUs this process may use less
// the host's runnable threads (helpers awake count as idle: this rank's `awake`, as many for
// each other local rank), divided among the `local` ranks; from 0 to `most`. Where this
// rank's compute is idle (the split on the thread that issued the op, or that thread
// asleep), a split takes at least as many as the rank's own cores leave (helpers.cpp,
// idle_now).
int idle_share(int allowed, int running, int awake, int local, int most);
// The host's runnable threads now (/proc/loadavg's fourth field), -1 where unknown.
int runnable_threads();
// This thread's id (gettid).
pid_t this_thread_id();
// The issuer in scope on this thread, else this thread: what an op issued here counts as
// its issuer (an op issued by a Future's callback counts as the completed op's issuer's).
pid_t current_issuer();
// Names the thread that issued the op whose work runs on this thread meanwhile (its Work's
// start and polls, its Future's completion): idle helpers take the rank's own cores where
// that thread is the one running the op or is asleep (helpers.cpp, idle_now). Outside a
// scope, the main thread.
class IssuerScope {
 public:
  explicit IssuerScope(pid_t issuer);
  ~IssuerScope();
  IssuerScope(const IssuerScope&) = delete;
  IssuerScope& operator=(const IssuerScope&) = delete;

 private:
  pid_t previous_;
};

// Whether splits may take idle helpers from now on (default true; where the plan has
// none, nothing changes); returns the previous setting.
bool allow_idle_helpers(bool allowed);
// Splits that ran on helpers, and of them those that used idle helpers (process totals).
std::pair<uint64_t, uint64_t> split_counts();

// part(ctx, lo, hi) over pieces covering [0, total), each boundary a multiple of
// `align`, run at once on the helpers and on this thread; returns when all are done.
// Everything runs on this thread when there are no helpers, the work is under
// min_per_piece per piece, or the pool is busy with another group's split (never
// waits for it). Parts must not throw: they are plain memory moves.
using Part = void (*)(void* ctx, size_t lo, size_t hi);
void split(size_t total, size_t align, size_t min_per_piece, Part part, void* ctx);

// In a forked child: the next split makes the child's own pool (made_once.hpp says why).
void forget_helpers_in_child();

} // namespace oneccl_bind_pt

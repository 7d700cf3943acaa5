#include "route.hpp"

#include "helpers.hpp"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <string>

#include <unistd.h>

namespace oneccl_bind_pt {

namespace {

// A size like 262144, 256K or 4M; -1 where `v` is not one.
double parse_bytes(const char* v) {
  char* end = nullptr;
  const double x = std::strtod(v, &end);
  if (end == v || !(x >= 0)) {
    return -1;
  }
  const std::string unit(end);
  double scale = 1;
  if (unit == "K" || unit == "KiB" || unit == "k" || unit == "KB" || unit == "kB") {
    scale = 1024;
  } else if (unit == "M" || unit == "MiB" || unit == "m" || unit == "MB") {
    scale = 1024.0 * 1024;
  } else if (unit == "G" || unit == "GiB" || unit == "g" || unit == "GB") {
    scale = 1024.0 * 1024 * 1024;
  } else if (!unit.empty()) {
    return -1;
  }
  return x * scale;
}

size_t env_bytes(const char* name, size_t fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) {
    return fallback;
  }
  const double x = parse_bytes(v);
  if (x < 0) {
    TORCH_WARN("ccl: ", name, "=", v, " is not a size (e.g. 262144, 256K, 4M); using the default");
    return fallback;
  }
  return x >= static_cast<double>(SIZE_MAX) ? SIZE_MAX : static_cast<size_t>(x);
}

// Single copy in these bands of bytes per rank (reduce_scatter: its input; allgather:
// this rank's share), from `python -m oneccl_bind_pt.bench --backends staged,single` on 2
// ranks (docs/performance.md, "single copy"). Reading peers with process_vm_readv costs page
// pinning, and the staged path's 2 MiB buffers stay in cache; which wins differs by CPU and
// by whether helper threads split the staged copies (they do not split the reads):
//  - Intel, no helpers (a 16-core Xeon VM; a 2-core Xeon agreed at 1 MiB): single copy won
//    from 256 KiB to 64 MiB for allgather (0.66x at 256 KiB, 0.59x at 16 MiB),
//    reduce_scatter (0.70-0.83x) and all-to-all (0.37-0.73x), from 1 MiB for allreduce
//    (0.69x at 4 MiB, 0.94x at 64 MiB; 1.29x at 256 KiB), and up to 1 MiB for broadcast and
//    send (0.74-0.85x; 1.2-1.5x slower from 4 MiB).
//    Staged chunks sized to the L2 cache (default_chunk below) changed allreduce: on a 2-core
//    Intel Xeon VM staging then took 0.98-1.03x single copy's time at 16 MiB and 0.65-0.70x
//    at 64 MiB (at 4 MiB single copy still took 0.86-0.91x of staging's), and on the 16-core
//    Xeon staging of 2 MiB chunks was already within 1.06x of single copy at 64 MiB; so
//    allreduce reads directly only up to 8 MiB.
//  - On other CPUs without helpers (a 2-core AMD EPYC VM): only allgather and
//    reduce_scatter around 1 MiB. There staging was as fast or faster from ~16 MiB,
//    allreduce, broadcast and all-to-all showed no steady gain, and the receiver's single
//    read of a send was 1.2-2.2x slower from 16 KiB to 64 MiB.
//  - With helpers, on any CPU: only reduce_scatter of 256-512 KiB. Helpers split the staged
//    copies and not the reads, and on the 16-core Xeon with 6 helpers (2 ranks) single copy
//    took 1.35-5.4x staging's time from 1 MiB for every op (reduce_scatter of 1 MiB 2.0x,
//    allgather of 4 MiB 2.0x), 0.67-0.80x only at 256 KiB for reduce_scatter, all-to-all and
//    allgather (whose share there was 128 KiB, below any band); with 3 helpers on 4 ranks,
//    3.0x for an allgather of 1 MiB and 1.0x at 16 MiB, where the earlier band (shares of
//    1-4 MiB) had made it 1.7x the best oneCCL setting (docs/performance.md, run D). Not
//    all-to-all: its band would also take scatter, gather and uneven all-to-alls (every rank
//    follows any rank in the band, a peer sending far more too), for 9 us at 256 KiB.
constexpr size_t kNever = SIZE_MAX;
constexpr size_t kKiB = 1024, kMiB = kKiB * 1024;
//                          allreduce reduce  broadcast   allgather   alltoall    reduce_scatter send
constexpr PerKind kNarrowFrom{kNever,   kNever, kNever,     1 * kMiB,   kNever,     256 * kKiB,    kNever};
constexpr PerKind kNarrowTo{  0,        0,      0,          4 * kMiB,   0,          4 * kMiB,      kNever};
constexpr PerKind kHelpedFrom{kNever,   kNever, kNever,     kNever,     kNever,     256 * kKiB,    kNever};
constexpr PerKind kHelpedTo{  0,        0,      0,          0,          0,          512 * kKiB,    kNever};
constexpr PerKind kWideFrom{  1 * kMiB, kNever, 256 * kKiB, 256 * kKiB, 256 * kKiB, 256 * kKiB,    256 * kKiB};
constexpr PerKind kWideTo{    8 * kMiB, 0,      1 * kMiB,   kNever,     kNever,     kNever,        1 * kMiB};

// The staging chunk (ShmLimits::chunk_bytes). A staged step copies a chunk into the
// buffer, reduces or reads it back, and copies it out, and a chunk that stays in the
// L2 cache between those passes is faster: on a 2-core Intel Xeon VM (2 MiB L2), 2 ranks,
// staged, chunks of 128-512 KiB against the 2 MiB buffer took 0.82-0.96x for allreduce,
// 0.82-0.99x allgather, 0.71-0.91x reduce_scatter and 0.77-0.92x all-to-all at 1-16 MiB,
// 0.79-0.80x allreduce at 64 MiB (docs/performance.md, "The staging chunk"). Broadcast,
// which only copies, took 0.99-1.12x, so it keeps the whole buffer. With helper threads each
// thread moves its share of a chunk, so the chunk grows with them.
// But every chunk costs the ranks meetings, and a meeting waits until each rank's thread
// is scheduled: where torch's threads compute beside the collective (DDP all-reduces its
// buckets during the backward pass), small chunks lost more than the cache gave. DDP's
// communication (step - local) took 2.0-2.6x oneCCL's with 128 KiB chunks and 0.5-0.9x with
// 1 MiB (2-core AMD EPYC VM, 2 ranks x 1 thread, 25 M parameters, three rounds); on the
// 16-core Xeon, 2 ranks x 8 threads, 1.8x with 256 KiB. Alone, 1 MiB chunks took 0.73-1.04x
// the time of 128 KiB ones on that EPYC (2 ranks, 256 KiB-64 MiB, two rounds). So a chunk is
// at least 1 MiB (docs/performance.md, "The staging chunk"); but where a host's ranks
// outnumber its CPUs, where staged chunks showed no steady difference (0.6-1.9x either way
// between runs), they keep the cache's size.
constexpr size_t kMinDefaultChunk = size_t{1} << 20;

size_t default_chunk(bool crowded, std::string& why) {
  const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
  size_t per_thread = 256 * 1024;
  if (l2 > 0) {
    per_thread = 128 * 1024;
    while (per_thread < 512 * 1024 && per_thread * 2 <= static_cast<size_t>(l2) / 8) {
      per_thread *= 2;
    }
  }
  const int threads = helper_plan().count + 1;
  const size_t chunk = std::clamp(per_thread * threads, crowded ? per_thread : kMinDefaultChunk, kStagingBufferBytes);
  why = std::to_string(per_thread >> 10) + " KiB per thread (" +
      (l2 > 0 ? "an eighth of the " + std::to_string(l2 >> 10) + " KiB L2 cache, within 128-512 KiB"
              : std::string("the L2 cache's size unknown")) +
      ") x " + std::to_string(threads) + " (the helper threads and the caller), " +
      (crowded ? std::string("at most 2 MiB (more ranks than CPUs)")
               : std::string("from 1 MiB (fewer meetings where torch's threads compute beside it) to 2 MiB"));
  return chunk;
}

bool intel_cpu() {
  __builtin_cpu_init();
  return __builtin_cpu_is("intel");
}

bool env_on(const char* name) {
  const char* v = std::getenv(name);
  // Same reading as the Python side (_env.py), which decides CCL_ATL_SHM from ONECCL_BIND_PT_SHM.
  std::string s = v ? v : "1";
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return !(s == "0" || s == "off" || s == "false");
}

} // namespace

bool shm_enabled() {
  return env_on("ONECCL_BIND_PT_SHM");
}

bool single_copy_enabled() {
  return env_on("ONECCL_BIND_PT_SHM_SINGLE_COPY");
}

size_t ShmLimits::asked_chunk_bytes() {
  const char* chunk = std::getenv("ONECCL_BIND_PT_SHM_CHUNK_BYTES");
  if (!chunk || !*chunk) {
    return 0;
  }
  // Strict, unlike the crossovers: ranks given different chunks still agree (the smallest),
  // but a value that was meant and not understood should not pass as a default.
  const double b = parse_bytes(chunk);
  TORCH_CHECK_VALUE(b >= kMinStagingChunk && b <= kStagingBufferBytes, "ONECCL_BIND_PT_SHM_CHUNK_BYTES=", chunk,
                    " is not a size from 64K to 2M (e.g. 262144, 256K, 1M)");
  return static_cast<size_t>(b);
}

ShmLimits ShmLimits::from_env() {
  // Measured crossovers (docs/performance.md). Against oneCCL only all-to-all has
  // one, and only against oneCCL's own shared-memory provider (CCL_ATL_SHM=1, which
  // the user chose: we set 0 on one host): above 1 MiB per rank it can be faster
  // there (2 MiB on 4 ranks: 789 us vs 1006 us here; 4 MiB on 2 ranks: 361 vs 403 us).
  // Over oneCCL's sockets (CCL_ATL_SHM=0) every kind stays faster here.
  constexpr size_t kAny = SIZE_MAX;
  const char* atl_shm = std::getenv("CCL_ATL_SHM");
  const bool ccl_has_shm = atl_shm && std::string(atl_shm) == "1";
  ShmLimits l;
  l.max_bytes = PerKind{kAny, kAny, kAny, kAny, ccl_has_shm ? size_t{1} << 20 : kAny, kAny, kAny};
  const size_t all = env_bytes("ONECCL_BIND_PT_SHM_MAX_BYTES", 0);
  if (all > 0) {
    l.max_bytes = PerKind{all, all, all, all, all, all, kAny};
  }
  // Single copy: where reading peers' tensors directly beat staging them
  // (docs/performance.md, "single copy").
  // helper_plan() is chosen before the group's transports (ProcessGroupCCL's constructor).
  const bool helped = helper_plan().count > 0, wide = !helped && intel_cpu();
  l.single_copy = helped ? kHelpedFrom : wide ? kWideFrom : kNarrowFrom;
  l.single_copy_to = helped ? kHelpedTo : wide ? kWideTo : kNarrowTo;
  const RankCores cores = rank_cores(local_ranks());
  const size_t chunk = asked_chunk_bytes();
  if (chunk > 0) {
    l.chunk_bytes = chunk;
    l.chunk_why = "ONECCL_BIND_PT_SHM_CHUNK_BYTES";
  } else {
    l.chunk_bytes = default_chunk(cores.crowded, l.chunk_why);
  }
  // Single copy's reduce windows (ShmPending::capacity). Where ranks outnumber CPUs a window's
  // meeting waits for ranks to be scheduled: on a 2-core AMD EPYC VM, 4 ranks, reduce_scatter
  // of 256 KiB-4 MiB took 0.68-0.96x the time with 2 MiB windows against 128 KiB (18 points of
  // six in-process A/B runs, none slower), while 2 ranks there, not crowded, moved 0.87-1.19x.
  // Staged chunks showed no such steady difference at 4 ranks (0.6-1.9x either way), so they
  // keep the cache's size.
  l.window_bytes = l.chunk_bytes;
  l.window_why = "the staging chunk";
  if (cores.crowded && chunk == 0) {
    l.window_bytes = kStagingBufferBytes;
    l.window_why = "the whole buffer: " + cores.why + ", more ranks than CPUs";
  }
  const char* from = std::getenv("ONECCL_BIND_PT_SHM_SINGLE_COPY_BYTES");
  if (from && *from) {
    // One threshold for every kind, with no upper end; a value not understood keeps the
    // measured bands (it once turned single copy off for every size).
    const double parsed = parse_bytes(from);
    if (parsed < 0) {
      TORCH_WARN("ccl: ONECCL_BIND_PT_SHM_SINGLE_COPY_BYTES=", from,
                 " is not a size (e.g. 262144, 256K, 4M, 0); keeping the measured defaults");
    } else {
      const size_t b = parsed >= static_cast<double>(kAny) ? kAny : static_cast<size_t>(parsed);
      l.single_copy = PerKind{b, b, b, b, b, b, b};
      l.single_copy_to = PerKind{kAny, kAny, kAny, kAny, kAny, kAny, kAny};
    }
  }
  return l;
}

Route ShmLimits::route(Prim::Kind kind, size_t bytes, bool group_has_cma) const {
  switch (kind) {
    case Prim::Kind::Send:
      // Streamed through the rings, or, from a size on, read by the receiver.
      return group_has_cma && bytes > 0 && bytes >= single_copy.send && bytes <= single_copy_to.send ? Route::Cma
                                                                                                     : Route::Shm;
    case Prim::Kind::Recv:
    case Prim::Kind::Barrier:
      return Route::Shm;
    default:
      if (bytes > max_bytes.of(kind)) {
        return Route::OneCCL;
      }
      return group_has_cma && bytes >= single_copy.of(kind) && bytes <= single_copy_to.of(kind) ? Route::Cma
                                                                                                  : Route::Shm;
  }
}

size_t PerKind::of(Prim::Kind kind) const {
  switch (kind) {
    case Prim::Kind::Allreduce: return allreduce;
    case Prim::Kind::Reduce: return reduce;
    case Prim::Kind::Broadcast: return broadcast;
    case Prim::Kind::Allgatherv: return allgather;
    case Prim::Kind::Alltoallv: return alltoall;
    case Prim::Kind::ReduceScatter: return reduce_scatter;
    case Prim::Kind::Send: return send;
    default: return SIZE_MAX;
  }
}

} // namespace oneccl_bind_pt

#include "route.hpp"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <string>

namespace oneccl_bind_pt {

namespace {

size_t env_bytes(const char* name, size_t fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) {
    return fallback;
  }
  char* end = nullptr;
  const double x = std::strtod(v, &end);
  std::string unit = end ? std::string(end) : "";
  double scale = 1;
  if (unit == "K" || unit == "KiB" || unit == "k") {
    scale = 1024;
  } else if (unit == "M" || unit == "MiB") {
    scale = 1024.0 * 1024;
  } else if (unit == "G" || unit == "GiB") {
    scale = 1024.0 * 1024 * 1024;
  } else if (!unit.empty()) {
    TORCH_WARN("ccl: ", name, "=", v, " is not a size (e.g. 262144, 256K, 4M); using the default");
    return fallback;
  }
  return static_cast<size_t>(x * scale);
}

// Single copy in these bands of bytes per rank (reduce_scatter: its input; allgather:
// this rank's share), measured on 2 ranks of a 2-core VM with `python -m
// oneccl_bind_pt.bench --backends staged,single,raw` (docs/performance.md, "single
// copy"): reading peers with process_vm_readv costs page pinning, and from ~16 MiB the
// staged path, whose 2 MiB buffers stay in cache, was as fast or faster. allreduce,
// broadcast and all-to-all showed no steady gain over three runs: they stay staged.
// send/recv stays streamed: there the sender's copy into the ring and the receiver's
// copy out of it run at once on two cores; the receiver's single read was 1.2-2.2x slower
// from 16 KiB to 64 MiB quiet, and slower at 6 of 7 sizes beside a memory hog.
constexpr size_t kNever = SIZE_MAX;
constexpr PerKind kSingleCopyFrom{kNever, kNever, kNever, size_t{1} << 20, kNever, size_t{256} << 10, kNever};
constexpr PerKind kSingleCopyTo{0, 0, 0, size_t{4} << 20, 0, size_t{4} << 20, kNever};

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
  l.single_copy = kSingleCopyFrom;
  l.single_copy_to = kSingleCopyTo;
  const char* from = std::getenv("ONECCL_BIND_PT_SHM_SINGLE_COPY_BYTES");
  if (from && *from) {
    // One threshold for every kind, with no upper end.
    const size_t b = env_bytes("ONECCL_BIND_PT_SHM_SINGLE_COPY_BYTES", kAny);
    l.single_copy = PerKind{b, b, b, b, b, b, b};
    l.single_copy_to = PerKind{kAny, kAny, kAny, kAny, kAny, kAny, kAny};
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

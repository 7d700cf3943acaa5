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

} // namespace

bool shm_enabled() {
  const char* v = std::getenv("ONECCL_BIND_PT_SHM");
  // Same reading as the Python side (_env.py), which decides CCL_ATL_SHM from it.
  std::string s = v ? v : "1";
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return !(s == "0" || s == "off" || s == "false");
}

ShmLimits ShmLimits::from_env() {
  // Measured crossovers (docs/performance.md). Only all-to-all has one, and only
  // against oneCCL's own shared-memory provider (CCL_ATL_SHM=1, which the user
  // chose: we set 0 on one host): above 1 MiB per rank it can be faster there
  // (2 MiB on 4 ranks: 789 us vs 1006 us here; 4 MiB on 2 ranks: 361 vs 403 us).
  // Over oneCCL's sockets (CCL_ATL_SHM=0) every kind stays faster here.
  constexpr size_t kAny = SIZE_MAX;
  const char* atl_shm = std::getenv("CCL_ATL_SHM");
  const bool ccl_has_shm = atl_shm && std::string(atl_shm) == "1";
  ShmLimits l{kAny, kAny, kAny, kAny, ccl_has_shm ? size_t{1} << 20 : kAny, kAny};
  const size_t all = env_bytes("ONECCL_BIND_PT_SHM_MAX_BYTES", 0);
  if (all > 0) {
    l = ShmLimits{all, all, all, all, all, all};
  }
  return l;
}

size_t ShmLimits::max() const {
  return std::max({allreduce, reduce, broadcast, allgather, alltoall, reduce_scatter});
}

Route ShmLimits::route(Prim::Kind kind, size_t bytes) const {
  switch (kind) {
    case Prim::Kind::Send:
    case Prim::Kind::Recv:
    case Prim::Kind::Barrier:
      return Route::Shm; // streamed through the rings, any size
    default:
      return bytes <= of(kind) ? Route::Shm : Route::OneCCL;
  }
}

size_t ShmLimits::of(Prim::Kind kind) const {
  switch (kind) {
    case Prim::Kind::Allreduce: return allreduce;
    case Prim::Kind::Reduce: return reduce;
    case Prim::Kind::Broadcast: return broadcast;
    case Prim::Kind::Allgatherv: return allgather;
    case Prim::Kind::Alltoallv: return alltoall;
    case Prim::Kind::ReduceScatter: return reduce_scatter;
    default: return max();
  }
}

} // namespace oneccl_bind_pt

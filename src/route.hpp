// Which transport moves what: the one place that decides, and the crossover
// table it decides by (measurements in docs/performance.md).
//
// A process group gets the shared-memory transport when ONECCL_BIND_PT_SHM is
// not off (shm_enabled) and every rank is on this host (Shm::connect); all
// its ops then start there. A collective step that stages more than its
// kind's limit runs through the oneCCL transport instead; send/recv and the
// barrier always stay. Groups without shared memory use oneCCL for all.
#pragma once

#include "transport.hpp"

#include <cstddef>
#include <cstdint>

namespace oneccl_bind_pt {

enum class Route : uint8_t { Shm, OneCCL };

inline const char* route_name(Route r) {
  return r == Route::Shm ? "shm" : "oneccl";
}

struct ShmLimits {
  // Largest bytes a rank stages for one step of each kind; above, oneCCL.
  size_t allreduce, reduce, broadcast, allgather, alltoall, reduce_scatter;
  size_t max() const;
  size_t of(Prim::Kind kind) const;
  // Where a step of `kind` staging `bytes` runs, on a group with shared memory.
  Route route(Prim::Kind kind, size_t bytes) const;
  // From ONECCL_BIND_PT_SHM_MAX_BYTES (one value for every kind) or the
  // measured defaults.
  static ShmLimits from_env();
};

// Whether the shared-memory transport is on (ONECCL_BIND_PT_SHM, default 1).
bool shm_enabled();

} // namespace oneccl_bind_pt

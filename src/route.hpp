// Which transport moves what: the one place that decides, and the crossover
// table it decides by (measurements in docs/performance.md).
//
// A process group gets the shared-memory transport when ONECCL_BIND_PT_SHM is
// not off (shm_enabled) and every rank is on this host (Shm::connect); all
// its ops then start there. There a collective step runs one of three ways:
//  - shm: through the staging buffers of the segments (two copies per byte:
//    into the sender's buffer, out of it), best for small messages;
//  - cma: single copy, each rank reading its peers' tensors directly
//    (process_vm_readv), from a size per kind on, when the group can (every
//    rank may read every peer's memory: Shm::connect probes it); for a send,
//    the receiver reads the sender's tensor;
//  - oneccl: the oneCCL transport, above a kind's limit (none by default
//    but all-to-all against oneCCL's own shared memory).
// send/recv and the barrier never go to oneCCL (the sender decides a send's
// route; a recv takes whatever comes). Groups without shared memory use oneCCL
// for all.
#pragma once

#include "transport.hpp"

#include <cstddef>
#include <cstdint>
#include <string>

namespace oneccl_bind_pt {

enum class Route : uint8_t { Shm, Cma, OneCCL };

// Each rank's staging buffer (it has two): the largest chunk a staged step moves.
inline constexpr size_t kStagingBufferBytes = size_t{2} << 20;
// The smallest chunk ONECCL_BIND_PT_SHM_CHUNK_BYTES may ask for.
inline constexpr size_t kMinStagingChunk = size_t{64} << 10;

inline const char* route_name(Route r) {
  return r == Route::Shm ? "shm" : r == Route::Cma ? "cma" : "oneccl";
}

// One size per kind (bytes of one rank's data; send: the message).
struct PerKind {
  size_t allreduce, reduce, broadcast, allgather, alltoall, reduce_scatter, send;
  size_t of(Prim::Kind kind) const;
};

struct ShmLimits {
  PerKind max_bytes;   // above: oneCCL
  // cma in [single_copy, single_copy_to], on a group whose ranks can read each other.
  PerKind single_copy, single_copy_to;
  // Bytes a staged step moves per rank (broadcast: the whole buffer), this rank's
  // choice: ONECCL_BIND_PT_SHM_CHUNK_BYTES, or per thread an eighth of the L2 cache
  // (128-512 KiB) times the threads splitting the copies (helper_plan() + 1), from
  // 1 MiB (not where ranks outnumber CPUs) to the buffer. A group takes the smallest of
  // its ranks' (Shm::connect).
  size_t chunk_bytes = kStagingBufferBytes;
  std::string chunk_why;
  // What single copy's reduce and reduce_scatter read of their peers per step: the chunk,
  // but the whole buffer where this host's ranks outnumber their CPUs (RankCores::crowded),
  // as every window is a meeting. A group takes the smallest of its ranks' (Shm::connect).
  size_t window_bytes = kStagingBufferBytes;
  std::string window_why;
  // Where a collective of `kind` with `bytes` per rank runs on a group with shared memory.
  Route route(Prim::Kind kind, size_t bytes, bool group_has_cma) const;
  // From ONECCL_BIND_PT_SHM_MAX_BYTES, ONECCL_BIND_PT_SHM_SINGLE_COPY_BYTES (one
  // value for every kind each) and ONECCL_BIND_PT_SHM_CHUNK_BYTES, or the measured
  // defaults.
  static ShmLimits from_env();
  // The staging chunk asked for (ONECCL_BIND_PT_SHM_CHUNK_BYTES), 0 where unset; throws
  // c10::ValueError for a value that is not a size from 64K to 2M. Chooses nothing else.
  static size_t asked_chunk_bytes();
};

// Whether the shared-memory transport is on (ONECCL_BIND_PT_SHM, default 1).
bool shm_enabled();
// Whether single-copy reads may be tried (ONECCL_BIND_PT_SHM_SINGLE_COPY, default 1).
bool single_copy_enabled();

} // namespace oneccl_bind_pt

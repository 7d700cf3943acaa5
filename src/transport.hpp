// What moves the bytes of a collective: one small interface, two transports.
//
// Every op of the backend (process_group_ccl.cpp) checks its arguments and
// describes its communication as a few Prims: the primitives oneCCL offers
// (allreduce, reduce, broadcast, allgatherv, alltoallv, reduce_scatter,
// send, recv, barrier). A Transport starts them and hands back a Pending that
// the progress engine polls:
//  - CclTransport (transport_ccl.hpp): one non-blocking oneCCL call per Prim;
//  - Shm (shm.hpp): shared memory between the ranks of a group on one host,
//    handing a step above its size limit to the oneCCL transport.
// Which one runs what is decided in route.hpp.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace oneccl_bind_pt {

struct Reduction; // reduce_ops.hpp

struct Prim {
  enum class Kind : uint8_t {
    Allreduce, Reduce, Broadcast, Allgatherv, Alltoallv, ReduceScatter, Send, Recv, Barrier
  };
  Kind kind;
  const void* src = nullptr;
  void* dst = nullptr;
  // Reductions: elements of red->dtype (complex counts as 2). Broadcast,
  // send, recv: bytes. Allgatherv: the bytes this rank sends.
  size_t count = 0;
  std::vector<size_t> send_counts; // bytes per rank (alltoallv)
  std::vector<size_t> recv_counts; // bytes per rank (allgatherv, alltoallv)
  std::vector<void*> dst_list;     // allgatherv into one buffer per rank
  int peer = -1;                   // root, or the other rank of send/recv (-1: any source)
  int tag = 0;
  std::shared_ptr<const Reduction> red; // reductions only
};

inline const char* prim_name(Prim::Kind kind) {
  switch (kind) {
    case Prim::Kind::Allreduce: return "allreduce";
    case Prim::Kind::Reduce: return "reduce";
    case Prim::Kind::Broadcast: return "broadcast";
    case Prim::Kind::Allgatherv: return "allgatherv";
    case Prim::Kind::Alltoallv: return "alltoallv";
    case Prim::Kind::ReduceScatter: return "reduce_scatter";
    case Prim::Kind::Send: return "send";
    case Prim::Kind::Recv: return "recv";
    case Prim::Kind::Barrier: return "barrier";
  }
  return "?";
}

// A started set of Prims. poll() advances them without blocking and returns
// true once all are done; it throws (with the op named) when one failed.
class Pending {
 public:
  virtual ~Pending() = default;
  virtual bool poll() = 0;
  // Whether anything moved since the last call (a step, a chunk, slots of a message),
  // which tells a poller a stalled op from a moving one. A transport that cannot tell
  // says true: oneCCL's ops move only while they are polled, so they are never left to wait.
  virtual bool moved() { return true; }
  // recv from any source: the rank the message came from, once done.
  virtual int source_rank() const { return -1; }
  // Whether the transport may still read or write the op's buffers after a
  // timeout (oneCCL may; shared memory stops when we stop polling).
  virtual bool buffers_in_use_after_abort() const { return true; }
};

class Transport {
 public:
  virtual ~Transport() = default;
  // Starts `prims` (the collectives of one op, or one send/recv). `op` names
  // the op in errors. Throws if nothing could start; the group stays usable.
  // Caller holds Progress's lock.
  virtual std::unique_ptr<Pending> start(const char* op, std::vector<Prim> prims) = 0;
};

} // namespace oneccl_bind_pt

// The shared-memory transport: ranks of one process group on one host.
//
// Each rank creates one anonymous segment (memfd: never a name in /dev/shm,
// so nothing is left behind, whatever kills the process) and maps every
// peer's through /proc/<pid>/fd/<fd>, which only the same user can open.
// A segment holds what its owner writes: a step counter, the signature of
// the collective it is running, two staging buffers (steps alternate between
// them, so no step needs a closing barrier), and one ring of message slots
// per peer for send/recv.
//
// Collectives run one step per Prim, in issue order (a FIFO per group):
//  1. stage: copy this rank's input into its buffer, write its signature,
//     publish the step number;
//  2. meet: once every rank has published it, compare signatures (a
//     mismatch raises on every rank, names what each rank called, and leaves
//     the group usable) and decide, from what every rank staged, whether the
//     data moves here or through oneCCL (above the size limit of the op);
//  3. move: read peers' buffers (reductions fold them in rank order: every
//     rank's result is bit-identical), or run the Prim through oneCCL.
// From a size per kind on (route.hpp), step 1 copies nothing: each rank
// publishes its tensors' addresses and step 3 reads the peers' tensors
// directly (process_vm_readv: single copy, shm_single_copy.cpp), then waits
// until no peer reads its own tensors any more. connect() probes whether the
// kernel lets the ranks read each other; if not, every size is staged.
// send/recv stream through the rings and match by (source, tag) in order,
// with an unexpected-message queue; a recv may take any source.
#pragma once

#include "route.hpp"
#include "transport.hpp"

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <list>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace c10d {
class Store;
} // namespace c10d

namespace oneccl_bind_pt {

// Processes that can map each other's memory: same kernel boot, same PID
// namespace (to name the peer's /proc entry), and, to keep "hosts" in network
// namespaces apart, same network namespace and host name.
std::string host_identity();
// Dead or a zombie (a killed child its launcher has not reaped yet).
bool process_gone(int pid);
// The state letter of /proc/<pid>/stat ('R', 'S', 'T' stopped, 'Z' zombie,
// ...), 'X' once the process is gone.
char process_state(int pid);

class ShmPending;
class ShmRecv;
class ShmSend;

class Shm final : public Transport {
 public:
  // Collective over the group: returns nullptr (on every rank alike) unless
  // all ranks run on this host and each could map every peer's segment.
  static std::unique_ptr<Shm> connect(
      const c10::intrusive_ptr<c10d::Store>& store,
      int rank,
      int size,
      std::chrono::milliseconds timeout,
      Transport* fallback);
  ~Shm() override;

  // `op` also goes into the signature peers compare.
  std::unique_ptr<Pending> start(const char* op, std::vector<Prim> prims) override;

  const ShmLimits& limits() const { return limits_; }
  // Whether every rank can read every peer's memory (single copy), or why not.
  bool single_copy() const { return single_copy_; }
  const std::string& single_copy_status() const { return single_copy_status_; }
  // The group's staging chunk, the smallest of its ranks' (ShmLimits::chunk_bytes), and why.
  std::string chunk_status() const;
  // What single copy's reduce and reduce_scatter read per step on this group, and why.
  std::string window_status() const;
  size_t chunk_bytes() const { return chunk_bytes_; }
  size_t window_bytes() const { return window_bytes_; }
  // Whether a peer's process has exited (or is a zombie).
  bool any_peer_gone() const;
  // The pid of rank `peer` while its process runs (not exited, not a zombie,
  // not stopped), else 0.
  int running_peer_pid(int peer) const;
  // "shm" or "oneccl": where a step of `kind` staging `bytes` runs.
  const char* path(Prim::Kind kind, size_t bytes) const;

  struct Layout;
  struct Sig;
  struct SlotHeader;

 private:
  friend class ShmPending;
  friend class ShmRecv;
  friend class ShmSend;

  Shm(int rank, int size, Transport* fallback);
  std::unique_ptr<Pending> start_collective(const char* op, std::vector<Prim> prims);
  std::unique_ptr<Pending> start_p2p(const Prim& p);

  // send/recv engine (under the progress lock, like everything here)
  void progress_p2p();
  void pump_sends(int peer);
  void pump_incoming(int peer);
  void check_peer_alive(int peer, const char* op);

  // Where things live in rank q's segment.
  uint64_t* arrived(int q) const;
  uint64_t* reduced(int q) const;
  uint64_t* done(int q) const; // finished reading peers' tensors (single copy)
  Sig* sig(int q, uint64_t step) const;
  uint64_t* counts(int q, uint64_t step) const; // send counts, then recv counts
  char* buffer(int q, uint64_t step) const;
  uint64_t* ring_head(int src, int dst) const; // in src's segment
  uint64_t* ring_tail(int dst, int src) const; // in dst's segment
  SlotHeader* slot(int src, int dst, uint64_t index) const;
  // Copies `bytes` at `from` in rank q's address space to `to` (process_vm_readv);
  // throws DistBackendError naming q and `op` when it cannot read them all.
  void read_peer(int q, void* to, uint64_t from, size_t bytes, const char* op) const;

  int rank_;
  int size_;
  Transport* fallback_; // oneCCL, for steps above the limits
  ShmLimits limits_;
  std::unique_ptr<Layout> layout_;
  std::vector<char*> bases_; // every rank's segment, mapped; ours at rank_
  std::vector<int> pids_;
  bool single_copy_ = false;
  std::string single_copy_status_ = "off: not probed";
  size_t chunk_bytes_ = 0; // this rank's choice, then the group's (connect)
  int chunk_from_ = -1;     // the rank whose choice it is
  size_t window_bytes_ = 0; // this rank's single-copy reduce window, then the group's (connect)

  // Grows at every move (a collective's step or chunk, slots of a send or recv): what
  // the Pendings' moved() reads.
  uint64_t moves_ = 0;

  // collectives
  uint64_t next_step_ = 0;
  std::deque<ShmPending*> fifo_;

  // send/recv
  struct Incoming; // a message being received, or waiting for its recv
  void read_message(Incoming& in, uint64_t addr); // a single-copy message, into its recv or held
  std::vector<std::deque<ShmSend*>> sends_;           // per destination
  std::vector<uint64_t> next_msg_;                    // per destination
  std::vector<std::unique_ptr<Incoming>> current_in_; // per source: message mid-stream
  std::list<std::unique_ptr<Incoming>> unexpected_;   // arrived before their recv
  std::list<ShmRecv*> posted_;                        // recvs waiting, in post order
};

} // namespace oneccl_bind_pt

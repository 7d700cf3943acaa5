// Store rendezvous: how a group's ranks meet through the c10d Store before oneCCL makes
// their communicator, and the TCP_NODELAY sweep of oneCCL's key-value store sockets.
//
// Rank 0 creates oneCCL's main key-value store (KVS) and publishes its
// address; the other ranks read it here and attach to it in create_communicator
// (communicator.cpp), where the group's deadline is watched. The Store handed to a backend
// is already prefixed per process group, so every group has its own keys.
#pragma once

#include <oneapi/ccl.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <sys/types.h>

namespace oneccl_bind_pt {

// The store keys of this creation of a group. torch prefixes a group's store
// with the group's name, and a name can come back: new_group(ranks,
// use_local_synchronization=True) names a group after its ranks, so the same
// ranks after destroy_process_group get the same keys, still holding the last
// group's values (its arrival mark, its oneCCL address: measured, the second
// group then lost shared memory and the third hung in oneCCL). So every
// creation on a rank takes the next number from the store: the first uses
// `store` itself, later ones keys of their own. The ranks of a group create
// groups of one name in the same order (as torch requires of them), a rank
// that fails takes its number too (announce_failure callers pass this), so
// they agree. A fresh store starts again from the first.
c10::intrusive_ptr<c10d::Store> creation_keys(const c10::intrusive_ptr<c10d::Store>& store, int rank);

// oneCCL's key-value store talks over TCP sockets it opens without TCP_NODELAY, in
// exchanges of two small writes and a read: each one waited out the peer's delayed ACK
// (40 ms on Linux), seven times per communicator: a group took 320-520 ms to create at 2-4
// ranks on one host, and 9-51 ms with TCP_NODELAY (docs/performance.md, "Making and
// destroying groups").
// This sets it on the TCP sockets this process opened since it was made (the store's
// listeners too: the connections they accept inherit it). Another thread's socket opened
// meanwhile gets it as well, which changes only when its small writes leave.
class NewTcpSockets {
 public:
  NewTcpSockets();
  void no_delay();

 private:
  std::set<ino_t> seen_; // open before, or set since
};

struct Rendezvous {
  NewTcpSockets opened;                 // from before rank 0 opened the group's KVS
  std::shared_ptr<ccl::kvs> kvs;        // rank 0: the group's oneCCL KVS, which it serves
  pid_t kvs_server = 0;                 // rank 0: the thread serving it (0: not known)
  ccl::kvs::address_type address{};     // the other ranks: where rank 0 serves it
  // The pids of the group's other ranks on this host (`host`): read now, for
  // cleaning up after them if they die, since the store may die with rank 0.
  std::vector<int> host_peers;
};

// This process's thread ids (/proc/self/task).
std::set<pid_t> thread_ids();

// Returns once every rank of the group has arrived; throws DistBackendError
// naming the missing ranks on timeout, or the rank that announced a failure. `host` names this rank's host.
// Ranks other than 0 attach to rank 0's KVS later, where the group's deadline is watched
// (create_communicator): oneCCL retries a connection it is refused for 120 s whatever our timeout.
Rendezvous rendezvous(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    std::chrono::milliseconds timeout,
    const std::string& host);

// Called by a rank that cannot create its side of the group (a bad environment
// variable, oneCCL failing to initialize or to reach rank 0, its communicator not
// created): the others, in rendezvous() or arriving later, raise at once with `why`
// and this rank's number, and those past it see it through announced_failure(),
// instead of waiting out the group's timeout. Best effort: it never throws, since
// the caller is about to raise its own error.
void announce_failure(const c10::intrusive_ptr<c10d::Store>& store, int rank, const std::string& why);

// "rank R could not create its side of this process group: <why>" once a rank of
// the group announced it, else "". Never throws.
std::string announced_failure(const c10::intrusive_ptr<c10d::Store>& store);

// Every rank contributes `mine` under `key`; returns all ranks' values, by
// rank. Throws DistBackendError naming the missing ranks on timeout.
std::vector<std::string> exchange(
    const c10::intrusive_ptr<c10d::Store>& store,
    const std::string& key,
    const std::string& mine,
    int rank,
    int size,
    std::chrono::milliseconds timeout);

} // namespace oneccl_bind_pt

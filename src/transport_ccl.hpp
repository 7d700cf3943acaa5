// The oneCCL transport: each Prim as one non-blocking oneCCL call on the
// group's communicator. Every group has one (Communicator owns it); a group
// with shared memory hands it the steps above the shared-memory limits.
#pragma once

#include "transport.hpp"

#include <oneapi/ccl.hpp>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>

namespace oneccl_bind_pt {

// One send or recv's place in the line of p2p ops between this rank and one peer in one
// direction. oneCCL has no tags: it pairs a recv with a send by order alone, and with
// several in flight between two ranks it paired some out of send order
// (scripts/p2p_order.py). So each one is handed to oneCCL only once the one before it in
// its line has completed. Used under Progress's lock only.
struct P2pTurn {
  std::shared_ptr<P2pTurn> before; // until this one is issued
  std::optional<ccl::event> event; // once issued
  bool done = false;               // completed, or will never run (its op failed to start)
  bool complete();
};

class CclTransport final : public Transport {
 public:
  // broken_reason: why the group broke, or "" while it is usable: a send or recv still
  // waiting for its turn then fails instead of being handed to oneCCL.
  CclTransport(ccl::communicator& comm, std::function<std::string()> broken_reason)
      : comm_(comm), broken_reason_(std::move(broken_reason)) {}
  // Throws if oneCCL rejects the first Prim; a later rejection surfaces from poll().
  std::unique_ptr<Pending> start(const char* op, std::vector<Prim> prims) override;

 private:
  ccl::communicator& comm_;
  std::function<std::string()> broken_reason_;
  // The last p2p op of each line: (peer, true for sends).
  std::map<std::pair<int, bool>, std::shared_ptr<P2pTurn>> lines_;
};

// oneCCL reads its environment once, here; the Python package sets its
// defaults before the first group is created.
void ensure_ccl_initialized();

} // namespace oneccl_bind_pt

// The oneCCL transport: each Prim as one non-blocking oneCCL call on the
// group's communicator. Every group has one (Communicator owns it); a group
// with shared memory hands it the steps above the shared-memory limits.
#pragma once

#include "transport.hpp"

#include <oneapi/ccl.hpp>

namespace oneccl_bind_pt {

class CclTransport final : public Transport {
 public:
  explicit CclTransport(ccl::communicator& comm) : comm_(comm) {}
  // Throws if oneCCL rejects the first Prim; a later rejection surfaces from poll().
  std::unique_ptr<Pending> start(const char* op, std::vector<Prim> prims) override;

 private:
  ccl::communicator& comm_;
};

// oneCCL reads its environment once, here; the Python package sets its
// defaults before the first group is created.
void ensure_ccl_initialized();

} // namespace oneccl_bind_pt

#include "transport_ccl.hpp"

#include "dtypes.hpp"
#include "errors.hpp"
#include "reduce_ops.hpp"

#include <c10/util/Exception.h>

#include <mutex>
#include <string>

namespace oneccl_bind_pt {

namespace {

// `scratch`: two bytes that live as long as the op (see Barrier below).
void issue(ccl::communicator& comm, const Prim& p, std::vector<ccl::event>& events, uint8_t* scratch) {
  using K = Prim::Kind;
  switch (p.kind) {
    case K::Allreduce:
      events.push_back(ccl::allreduce(
          p.src, p.dst, p.count, p.red->dtype, p.red->op, comm, p.red->allreduce_attr()));
      break;
    case K::Reduce:
      events.push_back(ccl::reduce(p.src, p.dst, p.count, p.red->dtype, p.red->op, p.peer, comm));
      break;
    case K::ReduceScatter:
      events.push_back(ccl::reduce_scatter(p.src, p.dst, p.count, p.red->dtype, p.red->op, comm));
      break;
    case K::Broadcast:
      events.push_back(ccl::broadcast(p.dst, p.count, kByteType, p.peer, comm));
      break;
    case K::Allgatherv:
      if (p.dst_list.empty()) {
        events.push_back(ccl::allgatherv(p.src, p.count, p.dst, p.recv_counts, kByteType, comm));
      } else {
        events.push_back(ccl::allgatherv(p.src, p.count, p.dst_list, p.recv_counts, kByteType, comm));
      }
      break;
    case K::Alltoallv:
      events.push_back(ccl::alltoallv(p.src, p.send_counts, p.dst, p.recv_counts, kByteType, comm));
      break;
    case K::Send:
      events.push_back(ccl::send(const_cast<void*>(p.src), p.count, kByteType, p.peer, comm));
      break;
    case K::Recv:
      events.push_back(ccl::recv(p.dst, p.count, kByteType, p.peer, comm));
      break;
    case K::Barrier:
      // ccl::barrier blocks the calling thread until every rank arrives, so
      // it could never time out (and barrier(async_op=True) would not be
      // asynchronous). A one-byte allreduce synchronizes the same way but
      // returns an event we poll against the group's timeout like any op.
      events.push_back(ccl::allreduce(
          scratch, scratch + 1, 1, ccl::datatype::uint8, ccl::reduction::sum, comm));
      break;
  }
}

class CclPending final : public Pending {
 public:
  CclPending(ccl::communicator& comm, const char* op, std::vector<Prim> prims) : op_(op), prims_(std::move(prims)) {
    for (const auto& p : prims_) {
      try {
        issue(comm, p, events_, scratch_);
      } catch (const std::exception& e) {
        const auto msg = std::string("ccl ") + op_ + ": oneCCL rejected the call: " + e.what();
        if (events_.empty()) {
          C10_THROW_ERROR(DistBackendError, msg); // nothing started: the group is fine
        }
        // Part of the op is in flight: peers and buffers are in an unknown state.
        issue_error_ = msg + " (after part of it had started)";
        break;
      }
    }
  }

  bool poll() override {
    while (next_ < events_.size()) {
      if (!events_[next_].test()) {
        return false;
      }
      ++next_;
    }
    if (!issue_error_.empty()) {
      C10_THROW_ERROR(DistBackendError, issue_error_);
    }
    return true;
  }

 private:
  const char* op_;
  std::vector<Prim> prims_; // oneCCL may refer to their count vectors until done
  std::vector<ccl::event> events_;
  // The barrier's allreduce buffers: here, since an op that timed out is
  // kept (never freed) with its Pending while oneCCL may still write them.
  uint8_t scratch_[2] = {0, 0};
  size_t next_ = 0;
  std::string issue_error_;
};

} // namespace

std::unique_ptr<Pending> CclTransport::start(const char* op, std::vector<Prim> prims) {
  return std::make_unique<CclPending>(comm_, op, std::move(prims));
}

void ensure_ccl_initialized() {
  static std::once_flag once;
  std::call_once(once, [] {
    try {
      ccl::init();
    } catch (const ccl::exception& e) {
      C10_THROW_ERROR(
          DistBackendError, std::string("ccl: oneCCL failed to initialize: ") + e.what());
    }
  });
}

} // namespace oneccl_bind_pt

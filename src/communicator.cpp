#include "communicator.hpp"

#include "dtypes.hpp"
#include "errors.hpp"
#include "rendezvous.hpp"
#include "shm.hpp"

#include <c10/util/Exception.h>

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

const char* prim_name(Prim::Kind kind) {
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

std::unique_ptr<Pending> start_oneccl(ccl::communicator& comm, const char* op, std::vector<Prim> prims) {
  return std::make_unique<CclPending>(comm, op, std::move(prims));
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

Communicator::Communicator(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    std::chrono::milliseconds timeout)
    : rank_(rank), size_(size) {
  CCL_CHECK_ARG(
      size > 0 && rank >= 0 && rank < size, "ccl: invalid rank ", rank,
      " for a process group of size ", size);
  ensure_ccl_initialized();
  kvs_ = rendezvous(store, rank, size, timeout);
  try {
    comm_.emplace(ccl::create_communicator(size, rank, kvs_));
  } catch (const ccl::exception& e) {
    C10_THROW_ERROR(
        DistBackendError,
        std::string("ccl: creating the oneCCL communicator (rank ") + std::to_string(rank) +
            " of " + std::to_string(size) + ") failed: " + e.what());
  }
  shm_ = Shm::connect(store, rank, size, timeout, &*comm_);
}

namespace {

// Whether rank 0's oneCCL key-value store still answers. Its server lives in
// rank 0's process; when that process is gone, a client's request fails here
// as an exception we can catch, while the same failure inside oneCCL's
// communicator teardown is thrown from a destructor and aborts the process.
bool kvs_answers(ccl::kvs& kvs, int rank) {
  try {
    const std::string key = "oneccl_bind_pt/teardown/" + std::to_string(rank);
    kvs.set(key, {'1', '\0'}); // oneCCL requires the terminating NUL
    return !kvs.get(key).empty();
  } catch (...) {
    return false;
  }
}

} // namespace

Communicator::~Communicator() {
  // oneCCL's teardown talks to the group's key-value store, which rank 0
  // hosts; if rank 0 has already exited (its group broke, or it was killed),
  // oneCCL throws from a destructor and aborts the process. So a group that
  // knows a peer is gone, or finds the store silent, leaves its oneCCL
  // objects be: a leak at the end of a failed job instead of a SIGABRT.
  if ((shm_ && shm_->any_peer_gone()) || (rank_ != 0 && !kvs_answers(*kvs_, rank_))) {
    static auto* graveyard = new std::vector<std::pair<ccl::communicator, std::shared_ptr<ccl::kvs>>>();
    graveyard->emplace_back(std::move(*comm_), kvs_);
  }
}

std::unique_ptr<Pending> Communicator::start(const char* op, std::vector<Prim> prims) {
  if (shm_) {
    return shm_->start(op, std::move(prims));
  }
  return start_oneccl(*comm_, op, std::move(prims));
}

void Communicator::mark_broken(const std::string& why) {
  std::lock_guard<std::mutex> lock(why_mutex_);
  if (!broken_.load(std::memory_order_relaxed)) {
    why_ = why;
    broken_.store(true, std::memory_order_release);
  }
}

void Communicator::add_completion_hook(int64_t id, std::function<void(uint64_t)> hook) {
  std::lock_guard<std::mutex> lock(hooks_mutex_);
  hooks_[id] = std::move(hook);
  has_hooks_.store(true, std::memory_order_release);
}

void Communicator::remove_completion_hook(int64_t id) {
  std::lock_guard<std::mutex> lock(hooks_mutex_);
  hooks_.erase(id);
  has_hooks_.store(!hooks_.empty(), std::memory_order_release);
}

void Communicator::completed(uint64_t key) const {
  if (!has_hooks_.load(std::memory_order_acquire)) {
    return;
  }
  std::lock_guard<std::mutex> lock(hooks_mutex_);
  for (const auto& entry : hooks_) {
    entry.second(key);
  }
}

std::string Communicator::broken_reason() const {
  std::lock_guard<std::mutex> lock(why_mutex_);
  return why_;
}

} // namespace oneccl_bind_pt

#include "communicator.hpp"

#include "dtypes.hpp"
#include "errors.hpp"
#include "rendezvous.hpp"
#include "shm.hpp"

#include <c10/util/Exception.h>

namespace oneccl_bind_pt {

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
  ccl_ = std::make_unique<CclTransport>(*comm_);
  shm_ = Shm::connect(store, rank, size, timeout, ccl_.get());
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
  Transport& transport = shm_ ? static_cast<Transport&>(*shm_) : *ccl_;
  return transport.start(op, std::move(prims));
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

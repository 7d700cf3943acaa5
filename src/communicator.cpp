#include "communicator.hpp"

#include "errors.hpp"
#include "rendezvous.hpp"

#include <c10/util/Exception.h>

namespace oneccl_bind_pt {

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
}

void Communicator::mark_broken(const std::string& why) {
  std::lock_guard<std::mutex> lock(why_mutex_);
  if (!broken_.load(std::memory_order_relaxed)) {
    why_ = why;
    broken_.store(true, std::memory_order_release);
  }
}

std::string Communicator::broken_reason() const {
  std::lock_guard<std::mutex> lock(why_mutex_);
  return why_;
}

} // namespace oneccl_bind_pt

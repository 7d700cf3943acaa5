#include "raw.hpp"

#include "dtypes.hpp"

#include <c10/util/Exception.h>

#include <chrono>
#include <memory>
#include <mutex>

namespace oneccl_bind_pt {

std::vector<double> time_raw_oneccl(
    ProcessGroupCCL& pg,
    const std::string& op,
    const at::Tensor& input,
    const at::Tensor& output,
    int iters,
    std::chrono::milliseconds timeout) {
  TORCH_CHECK_VALUE(input.is_contiguous() && output.is_contiguous(), "raw oneCCL: contiguous tensors only");
  auto dtype = reduction_dtype(input.scalar_type());
  TORCH_CHECK_VALUE(dtype.has_value(), "raw oneCCL: unsupported dtype");
  auto& comm = pg.communicator()->get();
  const int rank = pg.getRank();
  const int size = pg.getSize();
  const size_t in_bytes = input.numel() * input.element_size();
  const size_t out_bytes = output.numel() * output.element_size();
  void* in = input.data_ptr();
  void* out = output.data_ptr();

  // Each call's wait is bounded like the backend's own ops: a rank that never makes the
  // call (a benchmark whose ranks disagree) must not hold the others for good.
  auto deadline = std::chrono::steady_clock::now();
  bool late = false;
  auto wait = [&](ccl::event event) {
    for (unsigned polls = 1; !late && !event.test(); ++polls) {
      if (polls % 1024 == 0 && std::chrono::steady_clock::now() > deadline) {
        // oneCCL may still write the buffers: its event is left to it, as the group's
        // communicator will be (abort below).
        static auto* left = new std::vector<std::unique_ptr<ccl::event>>();
        left->push_back(std::make_unique<ccl::event>(std::move(event)));
        late = true;
      }
    }
  };
  auto issue_and_wait = [&]() {
    if (op == "allreduce") {
      wait(ccl::allreduce(in, in, input.numel(), *dtype, ccl::reduction::sum, comm));
    } else if (op == "allgather") {
      std::vector<size_t> counts(size, in_bytes);
      wait(ccl::allgatherv(in, in_bytes, out, counts, kByteType, comm));
    } else if (op == "reduce_scatter") {
      wait(ccl::reduce_scatter(in, out, output.numel(), *dtype, ccl::reduction::sum, comm));
    } else if (op == "alltoall") {
      std::vector<size_t> send(size, in_bytes / size), recv(size, out_bytes / size);
      wait(ccl::alltoallv(in, send, out, recv, kByteType, comm));
    } else if (op == "broadcast") {
      wait(ccl::broadcast(in, in_bytes, kByteType, 0, comm));
    } else if (op == "sendrecv") {
      if (rank == 0) {
        wait(ccl::send(in, in_bytes, kByteType, 1, comm));
        if (!late) {
          wait(ccl::recv(out, out_bytes, kByteType, 1, comm));
        }
      } else if (rank == 1) {
        wait(ccl::recv(out, out_bytes, kByteType, 0, comm));
        if (!late) {
          wait(ccl::send(in, in_bytes, kByteType, 0, comm));
        }
      }
    } else {
      TORCH_CHECK_VALUE(false, "raw oneCCL: unknown op '", op, "'");
    }
  };

  std::vector<double> times;
  times.reserve(iters);
  {
    // Nothing of ours is in flight while the benchmark runs; the lock keeps it so.
    std::lock_guard<std::mutex> lock(Progress::get().ccl_mutex());
    for (int i = 0; i < iters; ++i) {
      const auto start = std::chrono::steady_clock::now();
      deadline = start + timeout;
      issue_and_wait();
      if (late) {
        break;
      }
      times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
  }
  if (late) {
    // Later ops on the group fail at once instead of meeting the call left in flight, and
    // every rank leaves its communicator to oneCCL (a call is in flight: `true`).
    pg.communicator()->abort(true);
    C10_THROW_ERROR(DistBackendError,
                    c10::str("raw oneCCL ", op, " on rank ", rank, " of ", size, ": call ", times.size() + 1, " of ",
                             iters, " did not complete within ", timeout.count(),
                             " ms (the timeout given); the group is aborted. Every rank must make the same calls."));
  }
  return times;
}

} // namespace oneccl_bind_pt

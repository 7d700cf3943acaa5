#include "raw.hpp"

#include "dtypes.hpp"

#include <c10/util/Exception.h>

#include <chrono>

namespace oneccl_bind_pt {

std::vector<double> time_raw_oneccl(
    ProcessGroupCCL& pg,
    const std::string& op,
    const at::Tensor& input,
    const at::Tensor& output,
    int iters) {
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

  auto issue_and_wait = [&]() {
    if (op == "allreduce") {
      ccl::allreduce(in, in, input.numel(), *dtype, ccl::reduction::sum, comm).wait();
    } else if (op == "allgather") {
      std::vector<size_t> counts(size, in_bytes);
      ccl::allgatherv(in, in_bytes, out, counts, kByteType, comm).wait();
    } else if (op == "reduce_scatter") {
      ccl::reduce_scatter(in, out, output.numel(), *dtype, ccl::reduction::sum, comm).wait();
    } else if (op == "alltoall") {
      std::vector<size_t> send(size, in_bytes / size), recv(size, out_bytes / size);
      ccl::alltoallv(in, send, out, recv, kByteType, comm).wait();
    } else if (op == "broadcast") {
      ccl::broadcast(in, in_bytes, kByteType, 0, comm).wait();
    } else if (op == "sendrecv") {
      if (rank == 0) {
        ccl::send(in, in_bytes, kByteType, 1, comm).wait();
        ccl::recv(out, out_bytes, kByteType, 1, comm).wait();
      } else if (rank == 1) {
        ccl::recv(out, out_bytes, kByteType, 0, comm).wait();
        ccl::send(in, in_bytes, kByteType, 0, comm).wait();
      }
    } else {
      TORCH_CHECK_VALUE(false, "raw oneCCL: unknown op '", op, "'");
    }
  };

  std::vector<double> times;
  times.reserve(iters);
  // Nothing of ours is in flight while the benchmark runs; the lock keeps it so.
  std::lock_guard<std::mutex> lock(Progress::get().ccl_mutex());
  for (int i = 0; i < iters; ++i) {
    const auto start = std::chrono::steady_clock::now();
    issue_and_wait();
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return times;
}

} // namespace oneccl_bind_pt

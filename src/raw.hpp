// The benchmark's baseline: oneCCL called directly on a group's communicator,
// with no Work, Future, profiler hook or Python around each call.
#pragma once

#include "process_group_ccl.hpp"

#include <chrono>
#include <string>
#include <vector>

namespace oneccl_bind_pt {

// Runs `iters` blocking calls of `op` and returns each one's duration in
// seconds. Ops and buffers match what the backend issues for the same torch
// call: allreduce (in place on `input`), allgather and reduce_scatter
// (`input` -> `output`), alltoall (equal splits), broadcast (root 0), and
// sendrecv (a ping-pong between ranks 0 and 1; one iteration is a round trip).
// A call not complete within `timeout` aborts the group and raises DistBackendError.
std::vector<double> time_raw_oneccl(
    ProcessGroupCCL& pg,
    const std::string& op,
    const at::Tensor& input,
    const at::Tensor& output,
    int iters,
    std::chrono::milliseconds timeout);

} // namespace oneccl_bind_pt

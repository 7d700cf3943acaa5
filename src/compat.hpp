// What differs between the torch releases this tree builds against (see
// meta/releases.yaml), in one place. Everything else in src/ is written
// against the API all of them share.
#pragma once

#include <torch/csrc/distributed/c10d/Work.hpp>
// torch/version.h (not headeronly/version.h, which 2.9 lacks) defines TORCH_VERSION_*.
#include <torch/version.h>

#define OBPT_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

// 2.10: Backend::shrink (torch.distributed.shrink_group). On 2.9 the backend
// has none and torch has no shrink_group to call it.
#define OBPT_HAS_SHRINK OBPT_TORCH_AT_LEAST(2, 10)

// 2.14: Backend::gather_single (gather into one flat tensor on the root),
// Work::getTimeout (Python's Work.timeout) and an OpType of its own for
// all_gather_single_coalesced.
#define OBPT_HAS_GATHER_SINGLE OBPT_TORCH_AT_LEAST(2, 14)
#define OBPT_HAS_WORK_TIMEOUT OBPT_TORCH_AT_LEAST(2, 14)
// 2.14: abort hooks (Backend::registerAbortHook), run before a backend gives
// up on a timeout or error; 2.15 adds supportsAbortHooks to advertise them.
#define OBPT_HAS_ABORT_HOOKS OBPT_TORCH_AT_LEAST(2, 14)
#define OBPT_HAS_SUPPORTS_ABORT_HOOKS OBPT_TORCH_AT_LEAST(2, 15)

// 2.15: completion hooks and Work::getCompletionKey. torch attaches its
// FlightRecorder to every process group; without them it would record each
// collective as finished the moment it was issued.
#define OBPT_HAS_COMPLETION_HOOKS OBPT_TORCH_AT_LEAST(2, 15)

namespace oneccl_bind_pt::compat {

constexpr c10d::OpType kAllgatherIntoTensorCoalesced =
#if OBPT_TORCH_AT_LEAST(2, 14)
    c10d::OpType::ALLGATHER_INTO_TENSOR_COALESCED;
#else
    c10d::OpType::COALESCED;
#endif

// 2.13 gave reduce_scatter_tensor_coalesced an OpType of its own; before, it
// was recorded as COALESCED, as NCCL's and gloo's were.
constexpr c10d::OpType kReduceScatterTensorCoalesced =
#if OBPT_TORCH_AT_LEAST(2, 13)
    c10d::OpType::REDUCE_SCATTER_TENSOR_COALESCED;
#else
    c10d::OpType::COALESCED;
#endif

// PREMUL_SUM's factor: 2.13 renamed NCCLPreMulSumSupplement (kept as an alias).
#if OBPT_TORCH_AT_LEAST(2, 13)
using PreMulSumSupplement = c10d::PreMulSumSupplement;
#else
using PreMulSumSupplement = c10d::NCCLPreMulSumSupplement;
#endif

} // namespace oneccl_bind_pt::compat

// What differs between the torch releases this tree builds against (see
// meta/releases.yaml), in one place. Everything else in src/ is written
// against the API all of them share.
#pragma once

#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/headeronly/version.h>

#define OBPT_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

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

} // namespace oneccl_bind_pt::compat

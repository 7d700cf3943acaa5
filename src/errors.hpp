// Exceptions for bad arguments.
//
// gloo and NCCL raise RuntimeError for a bad argument, and code written for
// them catches RuntimeError. Ours derive from c10d's DistBackendError (a
// RuntimeError in Python); module.cpp translates them to
// oneccl_bind_pt.ArgumentError / ArgumentTypeError, which are also ValueError
// / TypeError, so code that caught those keeps working.
#pragma once

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

namespace oneccl_bind_pt {

class ArgumentError : public c10::DistBackendError {
 public:
  using c10::DistBackendError::DistBackendError;
};

class ArgumentTypeError : public c10::DistBackendError {
 public:
  using c10::DistBackendError::DistBackendError;
};

// Ranks called different collectives (or the same with different sizes) at
// the same point. Found before any data moved: the group stays usable.
class CollectiveMismatch : public c10::DistBackendError {
 public:
  using c10::DistBackendError::DistBackendError;
};

} // namespace oneccl_bind_pt

// CCL_CHECK_ARG(cond, message parts...): an invalid value or shape.
#define CCL_CHECK_ARG(cond, ...)                                                   \
  if (C10_UNLIKELY(!(cond))) {                                                     \
    throw ::oneccl_bind_pt::ArgumentError(                                         \
        {__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, ::c10::str(__VA_ARGS__)); \
  }

// CCL_CHECK_TYPE(cond, message parts...): a dtype the op cannot take.
#define CCL_CHECK_TYPE(cond, ...)                                                  \
  if (C10_UNLIKELY(!(cond))) {                                                     \
    throw ::oneccl_bind_pt::ArgumentTypeError(                                     \
        {__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, ::c10::str(__VA_ARGS__)); \
  }

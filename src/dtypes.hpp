// dtype table: how a torch dtype travels through oneCCL.
//
// Data-movement collectives (broadcast, allgather, gather, scatter, alltoall,
// send/recv) move raw bytes, so they accept every dtype. Only reductions need
// oneCCL to understand the element type; this table says which ones it can.
#pragma once

#include <c10/core/ScalarType.h>
#include <oneapi/ccl.hpp>

#include <optional>

namespace oneccl_bind_pt {

// The element type oneCCL reduces for `t`, or nullopt when it cannot.
// bool is reduced as uint8 (the op table maps SUM/PRODUCT to MAX/MIN for it);
// complex tensors are reduced as their interleaved real/imaginary parts.
inline std::optional<ccl::datatype> reduction_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return ccl::datatype::float32;
    case at::kDouble: return ccl::datatype::float64;
    case at::kBFloat16: return ccl::datatype::bfloat16;
    case at::kHalf: return ccl::datatype::float16;
    case at::kChar: return ccl::datatype::int8;
    case at::kByte: return ccl::datatype::uint8;
    case at::kShort: return ccl::datatype::int16;
    case at::kInt: return ccl::datatype::int32;
    case at::kLong: return ccl::datatype::int64;
    case at::kBool: return ccl::datatype::uint8;
    case at::kComplexFloat: return ccl::datatype::float32;
    case at::kComplexDouble: return ccl::datatype::float64;
    default: return std::nullopt;
  }
}

// Listed in error messages so a user sees what would have worked.
constexpr const char* kReducibleDtypes =
    "float32, float64, bfloat16, float16, int8, uint8, int16, int32, int64, "
    "bool, complex64, complex128";

// Bytes are what every data-movement collective sends.
constexpr ccl::datatype kByteType = ccl::datatype::int8;

} // namespace oneccl_bind_pt

// Op table: what oneCCL runs for a c10d ReduceOp on a given dtype, and what
// the backend does around the call (pre-scaling, averaging, bitwise kernels).
#pragma once

#include "kernels.hpp"

#include <ATen/core/Tensor.h>
#include <oneapi/ccl.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <memory>
#include <optional>
#include <string>

namespace oneccl_bind_pt {

struct Reduction {
  at::ScalarType scalar_type = at::kFloat;                  // the tensors' dtype
  c10d::ReduceOp::RedOpType kind = c10d::ReduceOp::SUM;     // as the user asked
  ccl::datatype dtype = ccl::datatype::float32;
  ccl::reduction op = ccl::reduction::sum;
  // Bitwise ops run as a custom reduction function. oneCCL accepts custom
  // functions for allreduce only, so reduce/reduce_scatter go through allreduce.
  ccl::reduction_fn custom_fn = nullptr;
  // The shared-memory transport's kernel (kernels.hpp), looked up once here rather
  // than per chunk; nullptr when it has none for this op and dtype.
  ReduceKernel kernel = nullptr;
  int64_t items_per_element = 1; // complex values reduce as (re, im) pairs
  bool average = false;          // AVG: oneCCL's CPU path has none; SUM then divide
  bool premul = false;           // PREMUL_SUM: scale inputs, then SUM
  double premul_scalar = 1.0;
  at::Tensor premul_tensor;

  bool allreduce_only() const { return custom_fn != nullptr; }
  size_t count(const at::Tensor& t) const {
    return static_cast<size_t>(t.numel() * items_per_element);
  }
  // Applies the PREMUL_SUM factor to a buffer the backend owns or may overwrite.
  void scale_inplace(at::Tensor& t) const;
  // Applies AVG's division to a result.
  void finish(at::Tensor& t, int group_size) const;
  bool needs_finish() const { return average; }
  // oneCCL's default attribute unless a custom function must ride along:
  // building one costs an allocation per call.
  const ccl::allreduce_attr& allreduce_attr() const {
    return custom_fn ? custom_attr_ : ccl::default_allreduce_attr;
  }
  ccl::allreduce_attr custom_attr_ = ccl::default_allreduce_attr;
};

// Resolves op x dtype for collective `op_name`; throws an ArgumentError /
// ArgumentTypeError naming the op, the reduce op, the dtype and what is
// accepted instead. Made once per (op, dtype) and kept for the process, with no
// lock on the way to one already made, except PREMUL_SUM, whose factor differs
// per call, and float16's AVG, whose factor is 1 / group_size.
std::shared_ptr<const Reduction> resolve_reduction(
    const char* op_name,
    const c10d::ReduceOp& op,
    at::ScalarType dtype,
    int group_size);

std::string dtype_name(at::ScalarType t);
const char* reduce_op_name(c10d::ReduceOp::RedOpType op);

} // namespace oneccl_bind_pt

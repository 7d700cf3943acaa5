#include "reduce_ops.hpp"

#include "compat.hpp"
#include "errors.hpp"
#include "dtypes.hpp"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <array>
#include <atomic>
#include <functional>

namespace oneccl_bind_pt {

namespace {

// oneCCL calls these with `in` and `inout` holding `n` elements of `dt`.
template <template <class> class Op>
void bitwise_kernel(
    const void* in,
    size_t n,
    void* inout,
    size_t* out_n,
    ccl::datatype dt,
    const ccl::fn_context* /*ctx*/) {
  auto apply = [&](auto* typed_inout) {
    using T = std::remove_pointer_t<decltype(typed_inout)>;
    const T* a = static_cast<const T*>(in);
    Op<T> op;
    for (size_t i = 0; i < n; ++i) {
      typed_inout[i] = op(typed_inout[i], a[i]);
    }
  };
  switch (dt) {
    case ccl::datatype::int8: apply(static_cast<int8_t*>(inout)); break;
    case ccl::datatype::uint8: apply(static_cast<uint8_t*>(inout)); break;
    case ccl::datatype::int16: apply(static_cast<int16_t*>(inout)); break;
    case ccl::datatype::int32: apply(static_cast<int32_t*>(inout)); break;
    case ccl::datatype::int64: apply(static_cast<int64_t*>(inout)); break;
    default: break; // resolve_reduction admits integer types only
  }
  if (out_n) {
    *out_n = n;
  }
}

bool is_integer(at::ScalarType t) {
  return at::isIntegralType(t, /*includeBool=*/false);
}

} // namespace

std::string dtype_name(at::ScalarType t) {
  return "torch." + std::string(c10::getDtypeNames(t).first);
}

const char* reduce_op_name(c10d::ReduceOp::RedOpType op) {
  switch (op) {
    case c10d::ReduceOp::SUM: return "SUM";
    case c10d::ReduceOp::AVG: return "AVG";
    case c10d::ReduceOp::PRODUCT: return "PRODUCT";
    case c10d::ReduceOp::MIN: return "MIN";
    case c10d::ReduceOp::MAX: return "MAX";
    case c10d::ReduceOp::BAND: return "BAND";
    case c10d::ReduceOp::BOR: return "BOR";
    case c10d::ReduceOp::BXOR: return "BXOR";
    case c10d::ReduceOp::PREMUL_SUM: return "PREMUL_SUM";
    default: return "UNKNOWN";
  }
}

void Reduction::scale_inplace(at::Tensor& t) const {
  if (!premul) {
    return;
  }
  if (premul_tensor.defined()) {
    t.mul_(premul_tensor);
  } else {
    t.mul_(premul_scalar);
  }
}

void Reduction::finish(at::Tensor& t, int group_size) const {
  if (!average) {
    return;
  }
  if (at::isIntegralType(t.scalar_type(), /*includeBool=*/false)) {
    t.div_(group_size, "trunc");
  } else {
    t.div_(group_size);
  }
}

namespace {

Reduction make_reduction(
    const char* op_name,
    const c10d::ReduceOp& op,
    at::ScalarType dtype) {
  const auto kind = op.op_;
  const char* rop = reduce_op_name(kind);
  auto ccl_type = reduction_dtype(dtype);
  CCL_CHECK_TYPE(
      ccl_type.has_value(),
      "ccl ", op_name, ": cannot reduce tensors of dtype ", dtype_name(dtype),
      "; reductions accept ", kReducibleDtypes);

  Reduction r;
  r.scalar_type = dtype;
  r.kind = kind;
  r.dtype = *ccl_type;
  r.kernel = reduce_kernel(dtype, kind);
  const bool is_bool = dtype == at::kBool;
  const bool is_complex = at::isComplexType(dtype);
  const bool is_float = at::isFloatingType(dtype);

  auto reject = [&](const char* accepted) {
    CCL_CHECK_ARG(
        false, "ccl ", op_name, ": ReduceOp.", rop, " is not supported for ",
        dtype_name(dtype), " tensors; ", accepted);
  };

  if (is_complex) {
    r.items_per_element = 2;
    if (kind != c10d::ReduceOp::SUM && kind != c10d::ReduceOp::AVG &&
        kind != c10d::ReduceOp::PREMUL_SUM) {
      reject("complex tensors accept SUM, AVG and PREMUL_SUM");
    }
  }

  switch (kind) {
    case c10d::ReduceOp::SUM:
      r.op = is_bool ? ccl::reduction::max : ccl::reduction::sum; // bool: logical or
      break;
    case c10d::ReduceOp::PRODUCT:
      r.op = is_bool ? ccl::reduction::min : ccl::reduction::prod; // bool: logical and
      break;
    case c10d::ReduceOp::MIN:
      r.op = ccl::reduction::min;
      break;
    case c10d::ReduceOp::MAX:
      r.op = ccl::reduction::max;
      break;
    case c10d::ReduceOp::AVG:
      if (is_bool) {
        reject("AVG accepts floating point, complex and integer tensors");
      }
      r.op = ccl::reduction::sum;
      r.average = true;
      break;
    case c10d::ReduceOp::PREMUL_SUM: {
      if (!is_float && !is_complex) {
        reject("PREMUL_SUM accepts floating point and complex tensors");
      }
      auto* supplement =
          dynamic_cast<compat::PreMulSumSupplement*>(op.supplement_.get());
      CCL_CHECK_ARG(
          supplement != nullptr, "ccl ", op_name,
          ": ReduceOp.PREMUL_SUM carries no factor; build it with "
          "torch.distributed._make_nccl_premul_sum(factor)");
      r.op = ccl::reduction::sum;
      r.premul = true;
      if (supplement->tensor_factor.defined()) {
        r.premul_tensor = supplement->tensor_factor;
      } else {
        r.premul_scalar = supplement->double_factor;
      }
      break;
    }
    case c10d::ReduceOp::BAND:
    case c10d::ReduceOp::BOR:
    case c10d::ReduceOp::BXOR:
      if (!is_integer(dtype) && !is_bool) {
        // gloo's wording: "Cannot use ReduceOp.BAND with non-integral dtype".
        reject("BAND, BOR and BXOR accept integer and bool tensors (cannot use them with non-integral dtype)");
      }
      r.op = ccl::reduction::custom;
      r.custom_fn = kind == c10d::ReduceOp::BAND ? &bitwise_kernel<std::bit_and>
          : kind == c10d::ReduceOp::BOR          ? &bitwise_kernel<std::bit_or>
                                                 : &bitwise_kernel<std::bit_xor>;
      r.custom_attr_ = ccl::create_operation_attr<ccl::allreduce_attr>();
      r.custom_attr_.set<ccl::allreduce_attr_id::reduction_fn>(r.custom_fn);
      break;
    default:
      CCL_CHECK_ARG(
          false, "ccl ", op_name, ": unsupported reduce op ", rop,
          "; expected one of SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR, PREMUL_SUM");
  }
  return r;
}

} // namespace

std::shared_ptr<const Reduction> resolve_reduction(
    const char* op_name,
    const c10d::ReduceOp& op,
    at::ScalarType dtype,
    int group_size) {
  if (op.op_ == c10d::ReduceOp::PREMUL_SUM) {
    return std::make_shared<const Reduction>(make_reduction(op_name, op, dtype));
  }
  if (op.op_ == c10d::ReduceOp::AVG && dtype == at::kHalf) {
    // float16's sum passes its largest value (65504) long before the average does: each
    // input is scaled by 1/n first, as NCCL does for floating types. (The other types keep
    // sum-then-divide: their range makes the sum's overflow moot, and reduce_scatter would
    // otherwise copy its whole input to scale it.)
    Reduction r = make_reduction(op_name, op, dtype);
    r.average = false;
    r.premul = true;
    r.premul_scalar = 1.0 / group_size;
    return std::make_shared<const Reduction>(std::move(r));
  }
  // Every collective with a reduce op comes here: a lock-free read of a table by
  // (op, dtype). Building an entry copies a oneCCL attribute and allocates, so it
  // is made once and kept for the process (at most kOps x kTypes). No lock: one a
  // thread held when the process forked would stay held in the child.
  constexpr size_t kOps = 16;
  constexpr size_t kTypes = 64;
  static std::array<std::atomic<const Reduction*>, kOps * kTypes> made{};
  const auto o = static_cast<size_t>(op.op_);
  const auto d = static_cast<size_t>(dtype);
  if (o >= kOps || d >= kTypes) { // not a reduce op or dtype of this torch: the refusal
    return std::make_shared<const Reduction>(make_reduction(op_name, op, dtype));
  }
  auto& slot = made[o * kTypes + d];
  const Reduction* r = slot.load(std::memory_order_acquire);
  if (!r) {
    auto fresh = std::make_unique<const Reduction>(make_reduction(op_name, op, dtype)); // throws if refused
    if (slot.compare_exchange_strong(r, fresh.get(), std::memory_order_acq_rel)) {
      r = fresh.release();
    } // else r is the entry another thread made first, and ours goes
  }
  // Not owned: the entry lives as long as the process.
  return std::shared_ptr<const Reduction>(std::shared_ptr<const Reduction>(), r);
}

} // namespace oneccl_bind_pt

#include "checks.hpp"

#include "dtypes.hpp"
#include "errors.hpp"
#include "reduce_ops.hpp"

#include <string>

namespace oneccl_bind_pt {

void check_tensor(const char* op, const at::Tensor& t, const std::string& what, bool dense_ok) {
  CCL_CHECK_ARG(t.defined(), "ccl ", op, ": ", what, " is undefined");
  CCL_CHECK_ARG(
      t.device().is_cpu(), "ccl ", op, ": ", what, " is on device '", t.device(),
      "'; the ccl backend works on CPU tensors (move it with .cpu())");
  CCL_CHECK_ARG(
      t.layout() == at::kStrided, "ccl ", op, ": ", what, " has layout ", t.layout(),
      "; expected a dense (strided) tensor");
  const bool ok = dense_ok ? t.is_non_overlapping_and_dense() : t.is_contiguous();
  CCL_CHECK_ARG(
      ok, "ccl ", op, ": ", what, " is not contiguous (sizes ", t.sizes(), ", strides ",
      t.strides(), "); pass tensor.contiguous()");
}

void check_p2p_layout(const char* op, const at::Tensor& t) {
  // As gloo (channels_last refused too): the bytes go as they lie in memory, and the other
  // side's tensor may lie otherwise (a transposed view or channels_last activation against a
  // fresh tensor): values would land permuted.
  CCL_CHECK_ARG(t.is_contiguous(), "ccl ", op, ": tensor is not contiguous (sizes ",
                t.sizes(), ", strides ", t.strides(), "); the peer's tensor may lie otherwise in memory: pass "
                "tensor.contiguous()");
}

const at::Tensor& single(const char* op, const std::vector<at::Tensor>& tensors, bool dense_ok) {
  CCL_CHECK_ARG(
      tensors.size() == 1, "ccl ", op, ": expected exactly one tensor, got ", tensors.size(),
      " (one process drives one CPU device)");
  check_tensor(op, tensors[0], "tensor", dense_ok);
  return tensors[0];
}

void check_rank(const char* op, const char* what, int64_t r, int size) {
  CCL_CHECK_ARG(
      r >= 0 && r < size, "ccl ", op, ": invalid ", what, ": ", r,
      " is out of range for a process group of size ", size, " (expected 0..", size - 1,
      "; unexpected rank)");
}

void check_same_dtype(const char* op, const at::Tensor& t, const at::Tensor& ref, const std::string& what) {
  CCL_CHECK_TYPE(
      // "Tensors are not equal in data type": torch-ccl's wording, which its users match on.
      t.scalar_type() == ref.scalar_type(), "ccl ", op, ": Tensors are not equal in data type: ", what, " has dtype ",
      dtype_name(t.scalar_type()), " but the input has ", dtype_name(ref.scalar_type()),
      "; all tensors of one call must share a dtype");
}

void check_list(
    const char* op,
    const std::vector<at::Tensor>& list,
    const at::Tensor& ref,
    int size,
    const char* what) {
  CCL_CHECK_ARG(
      static_cast<int>(list.size()) == size, "ccl ", op, ": ", what, " has ", list.size(),
      " tensors; expected one per rank (", size, ")");
  for (size_t i = 0; i < list.size(); ++i) {
    const auto name = std::string(what) + "[" + std::to_string(i) + "]";
    check_tensor(op, list[i], name);
    check_same_dtype(op, list[i], ref, name);
  }
}

void check_pairs(
    const char* op,
    const std::vector<at::Tensor>& outputs,
    const std::vector<at::Tensor>& inputs,
    int size,
    bool output_is_larger) {
  CCL_CHECK_ARG(
      !inputs.empty() && outputs.size() == inputs.size(), "ccl ", op, ": got ", outputs.size(),
      " outputs and ", inputs.size(), " inputs; expected the same non-zero number");
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_tensor(op, inputs[i], "input");
    check_tensor(op, outputs[i], "output");
    check_same_dtype(op, outputs[i], inputs[i], "output");
    const auto& small = output_is_larger ? inputs[i] : outputs[i];
    const auto& large = output_is_larger ? outputs[i] : inputs[i];
    // The clause after ';' is gloo's wording for the same mistake.
    CCL_CHECK_ARG(
        large.numel() == small.numel() * size, "ccl ", op, ": output has ", outputs[i].numel(),
        " elements and input ", inputs[i].numel(), "; expected the ",
        output_is_larger ? "output" : "input", " to hold group size (", size, ") x ",
        output_is_larger ? "input" : "output", " = ", small.numel() * size, " elements (",
        output_is_larger ? "output tensor size must be equal to world_size times input tensor size"
                         : "input tensor must be the same size as output size times world size",
        ")");
  }
}

std::vector<at::Tensor> root_list(
    const char* op,
    const std::vector<std::vector<at::Tensor>>& lists,
    const at::Tensor& own,
    int root,
    int rank,
    int size,
    const char* what) {
  if (rank != root) {
    CCL_CHECK_ARG(
        lists.empty() || (lists.size() == 1 && lists[0].empty()), "ccl ", op,
        ": only the root (rank ", root, ") passes a ", what);
    return {};
  }
  CCL_CHECK_ARG(
      lists.size() == 1, "ccl ", op, ": the root expects one ", what, ", got ", lists.size());
  check_list(op, lists[0], own, size, what);
  CCL_CHECK_ARG(
      lists[0][root].numel() == own.numel(), "ccl ", op, ": ", what, "[", root, "] has ",
      lists[0][root].numel(), " elements but this rank's tensor has ", own.numel());
  return lists[0];
}

} // namespace oneccl_bind_pt

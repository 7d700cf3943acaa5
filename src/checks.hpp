// Argument checks of the backend's ops: each throws oneccl_bind_pt's
// ArgumentError (a ValueError) or ArgumentTypeError (a TypeError), as gloo
// raises for the same mistake, with a message that names the op, what was
// wrong and what is expected (torch-ccl's and gloo's phrases kept where users
// match on them). Nothing is sent before they pass.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace oneccl_bind_pt {

// `dense_ok`: element-wise ops accept any non-overlapping dense layout, as
// every rank holds the same layout; ops that slice need row-major order.
void check_tensor(const char* op, const at::Tensor& t, const std::string& what, bool dense_ok = false);
// send/recv: contiguous (row-major; channels_last is refused too), as gloo checks.
void check_p2p_layout(const char* op, const at::Tensor& t);

// The one tensor of a list-taking op (one process drives one CPU device).
const at::Tensor& single(const char* op, const std::vector<at::Tensor>& tensors, bool dense_ok = false);

// A root or peer rank within the group.
void check_rank(const char* op, const char* what, int64_t r, int size);

void check_same_dtype(const char* op, const at::Tensor& t, const at::Tensor& ref, const std::string& what);

// One tensor per rank, each valid and of ref's dtype.
void check_list(const char* op, const std::vector<at::Tensor>& list, const at::Tensor& ref, int size, const char* what);

// The tensor-pair ops (all_gather_into_tensor, reduce_scatter_tensor and their
// coalesced forms): lists pair up, and the larger tensor of every pair holds
// one share per rank.
void check_pairs(
    const char* op,
    const std::vector<at::Tensor>& outputs,
    const std::vector<at::Tensor>& inputs,
    int size,
    bool output_is_larger);

// gather's gather_list / scatter's scatter_list: checked on the root (one
// tensor per rank, its own slot the size of `own`), absent everywhere else.
// Returns the list on the root, nothing elsewhere.
std::vector<at::Tensor> root_list(
    const char* op,
    const std::vector<std::vector<at::Tensor>>& lists,
    const at::Tensor& own,
    int root,
    int rank,
    int size,
    const char* what);

} // namespace oneccl_bind_pt

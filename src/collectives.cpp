// The collectives of ProcessGroupCCL: each checks its arguments (checks.hpp),
// describes its bytes as Prims and hands them to run(), the one dispatch path
// (process_group_ccl.cpp).
#include "checks.hpp"
#include "errors.hpp"
#include "dtypes.hpp"
#include "ops.hpp"
#include "reduce_ops.hpp"
#include "tensor_bytes.hpp"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstring>

namespace oneccl_bind_pt {

// ---- reductions ------------------------------------------------------------

c10::intrusive_ptr<c10d::Work> ProcessGroupCCL::allreduce(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceOptions& opts) {
  const char* op = kAllreduce.name;
  if (tensors.size() == 1 && tensors[0].defined() && tensors[0].is_sparse()) {
    return allreduce_sparse(tensors[0], opts);
  }
  at::Tensor t = single(op, tensors, /*dense_ok=*/true);
  auto red = resolve_reduction(op, opts.reduceOp, t.scalar_type(), getSize());
  const int size = getSize();
  Call call{kAllreduce, pick_timeout(opts.timeout, timeout_), {t}, {t}};
  if (red->premul) {
    call.prepare = [red, t]() mutable { red->scale_inplace(t); };
  }
  if (red->needs_finish()) {
    call.on_success = [red, t, size]() mutable { red->finish(t, size); };
  }
  call.prims.push_back(reduction(K::Allreduce, ptr(t), ptr(t), red, red->count(t)));
  return run(std::move(call));
}

// Sparse COO tensors, SUM only, as gloo does them: gather every rank's
// indices and values, then add them up locally. The receive sizes are only
// known once every rank's number of non-zeros is, so that is gathered first
// (and waited for here); the Work returned is the gather of the entries.
c10::intrusive_ptr<c10d::Work> ProcessGroupCCL::allreduce_sparse(
    at::Tensor& t,
    const c10d::AllreduceOptions& opts) {
  const char* op = kAllreduce.name;
  CCL_CHECK_ARG(
      t.device().is_cpu(), "ccl ", op, ": tensor is on device '", t.device(),
      "'; the ccl backend works on CPU tensors (move it with .cpu())");
  CCL_CHECK_ARG(
      opts.reduceOp == c10d::ReduceOp::SUM, "ccl ", op, ": sparse tensors reduce with SUM only, got ",
      reduce_op_name(opts.reduceOp.op_));
  const auto timeout = pick_timeout(opts.timeout, timeout_);
  const int size = getSize();
  const at::Tensor input = t.coalesce();
  const at::Tensor indices = input._indices().contiguous(); // [sparse dims, nnz]
  const at::Tensor values = input._values().contiguous();   // [nnz, dense sizes...]
  const int64_t sparse_dims = input.sparse_dim();

  at::Tensor mine = at::full({1}, input._nnz(), at::kLong);
  at::Tensor all_nnz = at::empty({size}, at::kLong);
  Call counts{kSparseCounts, timeout, {mine}, {all_nnz}};
  Prim count_prim = bytes(K::Allgatherv, ptr(mine), ptr(all_nnz), nbytes(mine));
  count_prim.recv_counts.assign(size, nbytes(mine));
  counts.prims.push_back(std::move(count_prim));
  run(std::move(counts))->wait();

  std::vector<int64_t> nnz(all_nnz.data_ptr<int64_t>(), all_nnz.data_ptr<int64_t>() + size);
  const int64_t total_nnz = std::accumulate(nnz.begin(), nnz.end(), int64_t{0});
  std::vector<int64_t> value_shape = values.sizes().vec();
  value_shape[0] = total_nnz;
  const size_t value_bytes = values.element_size() * c10::multiply_integers(value_shape.begin() + 1, value_shape.end());
  at::Tensor all_indices = at::empty({sparse_dims * total_nnz}, at::kLong);
  at::Tensor all_values = at::empty(value_shape, values.options());
  Prim idx = bytes(K::Allgatherv, ptr(indices), ptr(all_indices), nbytes(indices));
  Prim val = bytes(K::Allgatherv, ptr(values), ptr(all_values), nbytes(values));
  for (int r = 0; r < size; ++r) {
    idx.recv_counts.push_back(sizeof(int64_t) * sparse_dims * nnz[r]);
    val.recv_counts.push_back(value_bytes * nnz[r]);
  }
  Call call{kAllreduce, timeout, {t}, {t}, {indices, values, all_indices, all_values}};
  call.on_success = [t, nnz, sparse_dims, all_indices, all_values]() mutable {
    // Rank r's indices arrive as one [sparse dims, nnz_r] block: side by side.
    std::vector<at::Tensor> blocks;
    int64_t offset = 0;
    for (const int64_t n : nnz) {
      blocks.push_back(all_indices.narrow(0, offset, sparse_dims * n).view({sparse_dims, n}));
      offset += sparse_dims * n;
    }
    auto sum = at::sparse_coo_tensor(at::cat(blocks, 1), all_values, t.sizes()).coalesce();
    t.copy_(sum);
  };
  call.prims.push_back(std::move(idx));
  call.prims.push_back(std::move(val));
  return run(std::move(call));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCCL::allreduce_coalesced(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceCoalescedOptions& opts) {
  const char* op = kAllreduceCoalesced.name;
  CCL_CHECK_ARG(!tensors.empty(), "ccl ", op, ": got no tensors");
  for (size_t i = 0; i < tensors.size(); ++i) {
    check_tensor(op, tensors[i], "tensors[" + std::to_string(i) + "]");
    check_same_dtype(op, tensors[i], tensors[0], "tensors[" + std::to_string(i) + "]");
  }
  auto red = resolve_reduction(op, opts.reduceOp, tensors[0].scalar_type(), getSize());
  // One call on a flat copy: one latency instead of one per tensor.
  at::Tensor flat = flat_like(tensors);
  const int size = getSize();
  Call call{kAllreduceCoalesced, pick_timeout(opts.timeout, timeout_), tensors, tensors, {flat}};
  call.prepare = [red, flat, ins = tensors]() mutable {
    flatten_into(ins, flat);
    red->scale_inplace(flat);
  };
  call.on_success = [red, flat, outs = tensors, size]() mutable {
    red->finish(flat, size);
    unflatten_into(flat, outs);
  };
  call.prims.push_back(reduction(K::Allreduce, ptr(flat), ptr(flat), red, red->count(flat)));
  return run(std::move(call));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCCL::reduce(
    std::vector<at::Tensor>& tensors,
    const c10d::ReduceOptions& opts) {
  const char* op = kReduce.name;
  at::Tensor t = single(op, tensors, /*dense_ok=*/true);
  check_rank(op, "root rank", opts.rootRank, getSize());
  auto red = resolve_reduction(op, opts.reduceOp, t.scalar_type(), getSize());
  const int root = static_cast<int>(opts.rootRank);
  const bool is_root = getRank() == root;
  const int size = getSize();
  // Non-roots keep their input intact: oneCCL writes partial sums into the
  // receive buffer of every rank, so they reduce from and into scratch.
  const bool copy = !is_root && (red->premul || red->allreduce_only());
  at::Tensor src = copy ? at::empty_like(t) : t;
  at::Tensor dst = is_root ? t : (red->allreduce_only() ? src : at::empty_like(t));
  Call call{kReduce, pick_timeout(opts.timeout, timeout_), {t}, {t}, {src, dst}};
  call.writes_outputs = is_root;
  if (copy || red->premul) {
    call.prepare = [red, t, src, copy]() mutable {
      if (copy) {
        src.copy_(t);
      }
      red->scale_inplace(src);
    };
  }
  if (is_root && red->needs_finish()) {
    call.on_success = [red, t, size]() mutable { red->finish(t, size); };
  }
  call.prims.push_back(
      red->allreduce_only() ? reduction(K::Allreduce, ptr(dst), ptr(dst), red, red->count(dst))
                            : reduction(K::Reduce, ptr(src), ptr(dst), red, red->count(t), root));
  return run(std::move(call));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCCL::_reduce_scatter_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::ReduceScatterOptions& opts) {
  std::vector<at::Tensor> outputs{output}, inputs{input};
  return reduce_scatter_tensor_coalesced(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCCL::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  const int size = getSize();
  const int rank = getRank();
  const OpInfo& info = inputs.size() == 1 ? kReduceScatterBase : kReduceScatterTensorCoalesced;
  check_pairs(info.name, outputs, inputs, size, /*output_is_larger=*/false);
  const char* op = info.name;
  std::vector<std::shared_ptr<const Reduction>> reds;
  std::vector<at::Tensor> sends;
  bool copies = false;
  for (const auto& in : inputs) {
    auto red = resolve_reduction(op, opts.reduceOp, in.scalar_type(), getSize());
    const bool copy = red->premul || red->allreduce_only(); // the caller's input stays untouched
    sends.push_back(copy ? at::empty_like(in) : in);
    copies = copies || copy;
    reds.push_back(std::move(red));
  }
  Call call{info, pick_timeout(opts.timeout, timeout_), inputs, outputs, sends};
  if (copies) {
    call.prepare = [reds, sends, ins = inputs]() mutable {
      for (size_t i = 0; i < ins.size(); ++i) {
        if (!sends[i].is_same(ins[i])) {
          sends[i].copy_(ins[i]);
          reds[i]->scale_inplace(sends[i]);
        }
      }
    };
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    call.prims.push_back(
        reds[i]->allreduce_only()
            ? reduction(K::Allreduce, ptr(sends[i]), ptr(sends[i]), reds[i], reds[i]->count(sends[i]))
            : reduction(K::ReduceScatter, ptr(sends[i]), ptr(outputs[i]), reds[i], reds[i]->count(outputs[i])));
  }
  call.on_success = [reds, sends, outs = outputs, size, rank]() mutable {
    for (size_t i = 0; i < outs.size(); ++i) {
      if (reds[i]->allreduce_only()) {
        const auto n = outs[i].numel();
        outs[i].view({-1}).copy_(sends[i].reshape({-1}).narrow(0, rank * n, n));
      }
      reds[i]->finish(outs[i], size);
    }
  };
  return run(std::move(call));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCCL::reduce_scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  const char* op = kReduceScatter.name;
  at::Tensor out = single(op, outputs);
  CCL_CHECK_ARG(
      inputs.size() == 1, "ccl ", op, ": expected one input list, got ", inputs.size());
  check_list(op, inputs[0], out, getSize(), "input_list");
  const int size = getSize();
  const int rank = getRank();
  auto red = resolve_reduction(op, opts.reduceOp, out.scalar_type(), getSize());
  bool even = true;
  for (const auto& t : inputs[0]) {
    even = even && t.numel() == inputs[0][0].numel();
  }
  CCL_CHECK_ARG(
      inputs[0][rank].numel() == out.numel(), "ccl ", op, ": output has ", out.numel(),
      " elements but input_list[", rank, "] (this rank's share) has ", inputs[0][rank].numel());
  at::Tensor flat = flat_like(inputs[0]);
  // Uneven shares have no oneCCL primitive: reduce everything, keep ours.
  const bool via_allreduce = red->allreduce_only() || !even;
  int64_t offset = 0;
  for (int r = 0; r < rank; ++r) {
    offset += inputs[0][r].numel();
  }
  Call call{kReduceScatter, pick_timeout(opts.timeout, timeout_), inputs[0], {out}, {flat}};
  call.prepare = [red, flat, ins = inputs[0]]() mutable {
    flatten_into(ins, flat);
    red->scale_inplace(flat);
  };
  call.on_success = [red, flat, out, size, offset, via_allreduce]() mutable {
    if (via_allreduce) {
      out.view({-1}).copy_(flat.narrow(0, offset, out.numel()));
    }
    red->finish(out, size);
  };
  call.prims.push_back(
      via_allreduce ? reduction(K::Allreduce, ptr(flat), ptr(flat), red, red->count(flat))
                    : reduction(K::ReduceScatter, ptr(flat), ptr(out), red, red->count(out)));
  return run(std::move(call));
}

// ---- data movement (bytes, so every dtype works) ----------------------------

c10::intrusive_ptr<c10d::Work> ProcessGroupCCL::broadcast(
    std::vector<at::Tensor>& tensors,
    const c10d::BroadcastOptions& opts) {
  const char* op = kBroadcast.name;
  at::Tensor t = single(op, tensors, /*dense_ok=*/true);
  check_rank(op, "root rank", opts.rootRank, getSize());
  const int root = static_cast<int>(opts.rootRank);
  Call call{kBroadcast, pick_timeout(opts.timeout, timeout_), {t}, {t}};
  call.writes_outputs = root != getRank();
  call.prims.push_back(bytes(K::Broadcast, ptr(t), ptr(t), nbytes(t), root));
  return run(std::move(call));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCCL::allgather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const char* op = kAllgather.name;
  const at::Tensor& in = single(op, inputs);
  CCL_CHECK_ARG(
      outputs.size() == 1, "ccl ", op, ": expected one output list, got ", outputs.size());
  const int rank = getRank();
  check_list(op, outputs[0], in, getSize(), "output_tensor_list");
  CCL_CHECK_ARG(
      outputs[0][rank].numel() == in.numel(), "ccl ", op, ": output_tensor_list[", rank,
      "] (this rank's slot) has ", outputs[0][rank].numel(), " elements but the input has ",
      in.numel(), " (invalid tensor size)");
  Call call{kAllgather, pick_timeout(opts.timeout, timeout_), inputs, outputs[0]};
  // Per-rank counts: uneven sizes gather straight into each output.
  Prim p = bytes(K::Allgatherv, ptr(in), nullptr, nbytes(in));
  p.recv_counts = byte_counts(outputs[0]);
  for (const auto& t : outputs[0]) {
    p.dst_list.push_back(ptr(t));
  }
  call.prims.push_back(std::move(p));
  return run(std::move(call));
}

// output_lists[r][i] receives rank r's inputs[i] (PyTorch's layout, as gloo).
c10::intrusive_ptr<c10d::Work> ProcessGroupCCL::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& output_lists,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const char* op = kAllgatherCoalesced.name;
  const int size = getSize();
  CCL_CHECK_ARG(!inputs.empty(), "ccl ", op, ": requires non-empty input tensor list");
  CCL_CHECK_ARG(
      static_cast<int>(output_lists.size()) == size, "ccl ", op, ": got ", output_lists.size(),
      " output lists; output lists should be equal to world size (", size,
      "), one per rank, each with one tensor per input");
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_tensor(op, inputs[i], "input_tensor_list[" + std::to_string(i) + "]");
  }
  std::vector<at::Tensor> flat_outputs;
  for (int r = 0; r < size; ++r) {
    const auto& list = output_lists[r];
    CCL_CHECK_ARG(
        list.size() == inputs.size(), "ccl ", op, ": output_tensor_lists[", r, "] has ",
        list.size(), " tensors; invalid output size: (expected length ", inputs.size(),
        ", got ", list.size(), ")");
    for (size_t i = 0; i < inputs.size(); ++i) {
      const auto name = "output_tensor_lists[" + std::to_string(r) + "][" + std::to_string(i) + "]";
      check_tensor(op, list[i], name);
      check_same_dtype(op, list[i], inputs[i], name);
      CCL_CHECK_ARG(
          list[i].sizes() == inputs[i].sizes(), "ccl ", op, ": ", name, " has shape ",
          list[i].sizes(), " but input_tensor_list[", i, "] has ", inputs[i].sizes(),
          " (invalid tensor size)");
    }
    flat_outputs.insert(flat_outputs.end(), list.begin(), list.end());
  }
  // One call for all inputs: pack them, gather, unpack per rank.
  at::Tensor send = bytes_like(inputs, inputs[0].options());
  at::Tensor recv = at::empty({send.numel() * size}, send.options());
  Call call{kAllgatherCoalesced, pick_timeout(opts.timeout, timeout_), inputs, flat_outputs, {send, recv}};
  call.prepare = [send, ins = inputs]() mutable { pack_into(ins, send); };
  call.on_success = [recv, outs = flat_outputs]() mutable { unpack_bytes(recv, outs); };
  call.nested_outputs = output_lists;
  Prim p = bytes(K::Allgatherv, ptr(send), ptr(recv), nbytes(send));
  p.recv_counts.assign(size, nbytes(send));
  call.prims.push_back(std::move(p));
  return run(std::move(call));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCCL::_allgather_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::AllgatherOptions& opts) {
  std::vector<at::Tensor> outputs{output}, inputs{input};
  return allgather_into_tensor_coalesced(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCCL::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const int size = getSize();
  const OpInfo& info = inputs.size() == 1 ? kAllgatherBase : kAllgatherIntoTensorCoalesced;
  check_pairs(info.name, outputs, inputs, size, /*output_is_larger=*/true);
  Call call{info, pick_timeout(opts.timeout, timeout_), inputs, outputs};
  for (size_t i = 0; i < inputs.size(); ++i) {
    Prim p = bytes(K::Allgatherv, ptr(inputs[i]), ptr(outputs[i]), nbytes(inputs[i]));
    p.recv_counts.assign(size, nbytes(inputs[i]));
    call.prims.push_back(std::move(p));
  }
  return run(std::move(call));
}

// gather, scatter and the list alltoall all run as one alltoallv: a
// collective, so they never match a user's pending send/recv by mistake.
c10::intrusive_ptr<c10d::Work> ProcessGroupCCL::gather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  const char* op = kGather.name;
  const at::Tensor& in = single(op, inputs);
  const int size = getSize();
  check_rank(op, "root rank", opts.rootRank, size);
  const int root = static_cast<int>(opts.rootRank);
  auto outs = root_list(op, outputs, in, root, getRank(), size, "gather_list");
  std::vector<size_t> send_counts(size, 0);
  send_counts[root] = nbytes(in);
  auto recv_counts = outs.empty() ? std::vector<size_t>(size, 0) : byte_counts(outs);
  at::Tensor flat = at::empty({static_cast<int64_t>(total(recv_counts))}, in.options().dtype(at::kByte));
  Call call{kGather, pick_timeout(opts.timeout, timeout_), {in}, outs, {flat}};
  if (!outs.empty()) {
    call.on_success = [flat, outs]() mutable { unpack_bytes(flat, outs); };
  }
  call.prims.push_back(alltoallv(ptr(in), std::move(send_counts), ptr(flat), std::move(recv_counts)));
  return run(std::move(call));
}

#if OBPT_HAS_GATHER_SINGLE
// Into one flat tensor on the root (world size x input); others pass an empty one.
c10::intrusive_ptr<c10d::Work> ProcessGroupCCL::gather_single(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::GatherOptions& opts) {
  const char* op = kGatherSingle.name;
  const int size = getSize();
  check_rank(op, "root rank", opts.rootRank, size);
  const int root = static_cast<int>(opts.rootRank);
  check_tensor(op, input, "input");
  std::vector<size_t> send_counts(size, 0), recv_counts(size, 0);
  send_counts[root] = nbytes(input);
  if (getRank() == root) {
    check_tensor(op, output, "output");
    check_same_dtype(op, output, input, "output");
    CCL_CHECK_ARG(
        output.numel() == input.numel() * size, "ccl ", op, ": output has ", output.numel(),
        " elements; expected world size (", size, ") x input = ", input.numel() * size,
        " (output tensor size must be equal to world_size times input tensor size)");
    recv_counts.assign(size, nbytes(input));
  }
  Call call{kGatherSingle, pick_timeout(opts.timeout, timeout_), {input}, {output}};
  call.prims.push_back(alltoallv(ptr(input), std::move(send_counts), ptr(output), std::move(recv_counts)));
  return run(std::move(call));
}
#endif

c10::intrusive_ptr<c10d::Work> ProcessGroupCCL::scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  const char* op = kScatter.name;
  at::Tensor out = single(op, outputs);
  const int size = getSize();
  check_rank(op, "root rank", opts.rootRank, size);
  const int root = static_cast<int>(opts.rootRank);
  auto ins = root_list(op, inputs, out, root, getRank(), size, "scatter_list");
  auto send_counts = ins.empty() ? std::vector<size_t>(size, 0) : byte_counts(ins);
  std::vector<size_t> recv_counts(size, 0);
  recv_counts[root] = nbytes(out);
  at::Tensor flat = bytes_like(ins, out.options());
  Call call{kScatter, pick_timeout(opts.timeout, timeout_), ins, {out}, {flat}};
  if (!ins.empty()) {
    call.prepare = [flat, ins]() mutable { pack_into(ins, flat); };
  }
  call.prims.push_back(alltoallv(ptr(flat), std::move(send_counts), ptr(out), std::move(recv_counts)));
  return run(std::move(call));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCCL::alltoall_base(
    at::Tensor& output,
    at::Tensor& input,
    std::vector<int64_t>& output_split_sizes,
    std::vector<int64_t>& input_split_sizes,
    const c10d::AllToAllOptions& opts) {
  const char* op = kAlltoallBase.name;
  check_tensor(op, input, "input");
  check_tensor(op, output, "output");
  check_same_dtype(op, output, input, "output");
  const int size = getSize();
  // Splits count rows along dim 0; the transports count bytes.
  auto counts = [&](const at::Tensor& t, const std::vector<int64_t>& splits, const char* what) {
    const int64_t rows = t.dim() > 0 ? t.size(0) : 1;
    const size_t row_bytes = rows > 0 ? nbytes(t) / rows : 0;
    std::vector<size_t> out(size);
    if (splits.empty()) {
      CCL_CHECK_ARG(
          rows % size == 0, "ccl ", op, ": ", what, " has ", rows,
          " rows in dim 0, not divisible by the group size ", size, "; pass split sizes");
      std::fill(out.begin(), out.end(), row_bytes * (rows / size));
      return out;
    }
    CCL_CHECK_ARG(
        static_cast<int>(splits.size()) == size, "ccl ", op, ": ", what, " split sizes have ",
        splits.size(), " entries; expected one per rank (", size, ")");
    int64_t total = 0;
    for (int r = 0; r < size; ++r) {
      CCL_CHECK_ARG(splits[r] >= 0, "ccl ", op, ": ", what, " split size ", splits[r], " is negative");
      total += splits[r];
      out[r] = row_bytes * splits[r];
    }
    CCL_CHECK_ARG(
        total == rows, "ccl ", op, ": ", what, " split sizes add up to ", total, " but dim 0 has ",
        rows, " rows (split sizes doesn't match total dim 0 size)");
    return out;
  };
  auto send_counts = counts(input, input_split_sizes, "input");
  auto recv_counts = counts(output, output_split_sizes, "output");
  // In place (the output's bytes overlap the input's): each rank would overwrite its parts
  // while its peers still read them (single copy reads them from its tensor). So it sends a
  // copy, made at the op's start.
  const auto* in_at = static_cast<const char*>(input.data_ptr());
  const auto* out_at = static_cast<const char*>(output.data_ptr());
  const bool in_place = nbytes(input) > 0 && nbytes(output) > 0 && in_at < out_at + nbytes(output) &&
      out_at < in_at + nbytes(input);
  at::Tensor send = in_place ? at::empty_like(input) : input;
  Call call{kAlltoallBase, pick_timeout(opts.timeout, timeout_), {input}, {output}};
  if (in_place) {
    call.buffers = {send};
    // The bytes as they are (copy_ would resolve a conjugate or negative view bit).
    call.prepare = [send, input]() mutable { std::memcpy(send.data_ptr(), input.data_ptr(), nbytes(input)); };
  }
  call.prims.push_back(alltoallv(ptr(send), std::move(send_counts), ptr(output), std::move(recv_counts)));
  return run(std::move(call));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCCL::alltoall(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllToAllOptions& opts) {
  const char* op = kAlltoall.name;
  const int size = getSize();
  CCL_CHECK_ARG(
      static_cast<int>(inputs.size()) == size, "ccl ", op, ": input_tensor_list has ",
      inputs.size(), " tensors; expected one per rank (", size, ")");
  check_list(op, inputs, inputs[0], size, "input_tensor_list");
  check_list(op, outputs, inputs[0], size, "output_tensor_list");
  auto send_counts = byte_counts(inputs);
  auto recv_counts = byte_counts(outputs);
  at::Tensor send = bytes_like(inputs, inputs[0].options());
  at::Tensor recv = at::empty({static_cast<int64_t>(total(recv_counts))}, send.options());
  Call call{kAlltoall, pick_timeout(opts.timeout, timeout_), inputs, outputs, {send, recv}};
  call.prepare = [send, ins = inputs]() mutable { pack_into(ins, send); };
  call.on_success = [recv, outs = outputs]() mutable { unpack_bytes(recv, outs); };
  call.prims.push_back(alltoallv(ptr(send), std::move(send_counts), ptr(recv), std::move(recv_counts)));
  return run(std::move(call));
}

} // namespace oneccl_bind_pt

// Tensors as the byte buffers a Prim points at: the backend moves bytes
// (every dtype works the same) and packs lists of tensors into one buffer
// where an op moves a list at once.
#pragma once

#include <ATen/ATen.h>

#include <cstddef>
#include <numeric>
#include <vector>

namespace oneccl_bind_pt {

// oneCCL rejects null buffers even for zero counts; empty tensors may have one.
inline void* ptr(const at::Tensor& t) {
  static char dummy;
  void* p = t.numel() > 0 ? t.data_ptr() : nullptr;
  return p ? p : &dummy;
}

inline size_t nbytes(const at::Tensor& t) {
  return t.numel() * t.element_size();
}

// Views any contiguous tensor as a flat byte tensor sharing its memory.
inline at::Tensor as_bytes(const at::Tensor& t) {
  return t.reshape({-1}).view(at::kByte);
}

// Room for `tensors`' elements, one after the other (of the first one's dtype), and
// the copy into it; made apart, so that the copy runs when the op is started (run()'s
// `prepare`, after earlier ops on the same tensors).
inline at::Tensor flat_like(const std::vector<at::Tensor>& tensors) {
  int64_t n = 0;
  for (const auto& t : tensors) {
    n += t.numel();
  }
  return at::empty({n}, tensors.at(0).options().memory_format(at::MemoryFormat::Contiguous));
}
inline void flatten_into(const std::vector<at::Tensor>& tensors, at::Tensor& flat) {
  std::vector<at::Tensor> views;
  views.reserve(tensors.size());
  for (const auto& t : tensors) {
    views.push_back(t.reshape({-1}));
  }
  at::cat_out(flat, views); // one kernel for the list
}

// Copies consecutive slices of `flat` back into `tensors`.
inline void unflatten_into(const at::Tensor& flat, std::vector<at::Tensor>& tensors) {
  int64_t offset = 0;
  for (auto& t : tensors) {
    const auto n = t.numel();
    t.view({-1}).copy_(flat.narrow(0, offset, n));
    offset += n;
  }
}

inline size_t total(const std::vector<size_t>& counts) {
  return std::accumulate(counts.begin(), counts.end(), size_t{0});
}

// Room for the bytes of `tensors`, one after the other, and the copy into it (made apart,
// as flat_like's).
inline at::Tensor bytes_like(const std::vector<at::Tensor>& tensors, const at::TensorOptions& like) {
  size_t n = 0;
  for (const auto& t : tensors) {
    n += t.numel() * t.element_size();
  }
  return at::empty({static_cast<int64_t>(n)}, like.dtype(at::kByte).memory_format(at::MemoryFormat::Contiguous));
}
inline void pack_into(const std::vector<at::Tensor>& tensors, at::Tensor& flat) {
  std::vector<at::Tensor> bytes;
  bytes.reserve(tensors.size());
  for (const auto& t : tensors) {
    bytes.push_back(as_bytes(t));
  }
  if (!bytes.empty()) {
    at::cat_out(flat, bytes);
  }
}

// Copies consecutive byte ranges of `flat` back into `tensors`.
inline void unpack_bytes(const at::Tensor& flat, std::vector<at::Tensor>& tensors) {
  int64_t offset = 0;
  for (auto& t : tensors) {
    const auto n = static_cast<int64_t>(nbytes(t));
    as_bytes(t).copy_(flat.narrow(0, offset, n));
    offset += n;
  }
}

inline std::vector<size_t> byte_counts(const std::vector<at::Tensor>& tensors) {
  std::vector<size_t> counts;
  counts.reserve(tensors.size());
  for (const auto& t : tensors) {
    counts.push_back(nbytes(t));
  }
  return counts;
}

} // namespace oneccl_bind_pt

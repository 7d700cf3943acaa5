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

// A flat copy of `tensors`, one after the other.
inline at::Tensor flatten_copy(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> flat;
  flat.reserve(tensors.size());
  for (const auto& t : tensors) {
    flat.push_back(t.reshape({-1}));
  }
  return at::cat(flat);
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

// The bytes of `tensors`, one after the other, in a new flat buffer.
inline at::Tensor pack_bytes(const std::vector<at::Tensor>& tensors, const at::TensorOptions& like) {
  std::vector<at::Tensor> bytes;
  for (const auto& t : tensors) {
    bytes.push_back(as_bytes(t));
  }
  return bytes.empty() ? at::empty({0}, like.dtype(at::kByte)) : at::cat(bytes);
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

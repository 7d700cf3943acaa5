#include "kernels.hpp"

#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace oneccl_bind_pt {

namespace {

// ---- element types: how a stored value becomes the accumulator and back ----

struct BF16 {
  uint16_t bits;
};

template <typename T>
struct Elem {
  using Acc = T;
  static Acc load(T v) { return v; }
  static T store(Acc v) { return v; }
};

template <>
struct Elem<BF16> {
  using Acc = float;
  static float load(BF16 v) {
    const uint32_t u = static_cast<uint32_t>(v.bits) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
  static BF16 store(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      return BF16{0x7fc0}; // NaN stays NaN
    }
    u += 0x7fffu + ((u >> 16) & 1u); // round to nearest even
    return BF16{static_cast<uint16_t>(u >> 16)};
  }
};

template <>
struct Elem<c10::Half> {
  using Acc = float;
  static float load(c10::Half v) { return c10::detail::fp16_ieee_to_fp32_value(v.x); }
  static c10::Half store(float f) {
    return c10::Half(c10::detail::fp16_ieee_from_fp32_value(f), c10::Half::from_bits());
  }
};

// ---- operations, on the accumulator type ----

struct Sum {
  template <typename A>
  static A apply(A a, A b) { return a + b; }
};
struct Prod {
  template <typename A>
  static A apply(A a, A b) { return a * b; }
};
struct Min {
  // NaN propagates, as torch.minimum does.
  template <typename A>
  static A apply(A a, A b) { return (a < b || a != a) ? a : b; }
};
struct Max {
  template <typename A>
  static A apply(A a, A b) { return (a > b || a != a) ? a : b; }
};
struct BitAnd {
  template <typename A>
  static A apply(A a, A b) { return a & b; }
};
struct BitOr {
  template <typename A>
  static A apply(A a, A b) { return a | b; }
};
struct BitXor {
  template <typename A>
  static A apply(A a, A b) { return a ^ b; }
};

// Blocks keep the accumulator in L1 while every input is folded in.
constexpr size_t kBlock = 512;

template <typename T, typename Op>
void reduce(void* out_ptr, const void* const* in, int n, size_t count) {
  using E = Elem<T>;
  using Acc = typename E::Acc;
  T* out = static_cast<T*>(out_ptr);
  if (n == 1) {
    if (out_ptr != in[0]) {
      std::memmove(out, in[0], count * sizeof(T));
    }
    return;
  }
  for (size_t base = 0; base < count; base += kBlock) {
    const size_t m = std::min(kBlock, count - base);
    Acc acc[kBlock];
    const T* a = static_cast<const T*>(in[0]) + base;
    const T* b = static_cast<const T*>(in[1]) + base;
    for (size_t i = 0; i < m; ++i) {
      acc[i] = Op::apply(E::load(a[i]), E::load(b[i]));
    }
    for (int r = 2; r < n; ++r) {
      const T* c = static_cast<const T*>(in[r]) + base;
      for (size_t i = 0; i < m; ++i) {
        acc[i] = Op::apply(acc[i], E::load(c[i]));
      }
    }
    T* o = out + base;
    for (size_t i = 0; i < m; ++i) {
      o[i] = E::store(acc[i]);
    }
  }
}

template <typename T>
ReduceKernel arithmetic(c10d::ReduceOp::RedOpType op) {
  switch (op) {
    case c10d::ReduceOp::SUM:
    case c10d::ReduceOp::AVG:
    case c10d::ReduceOp::PREMUL_SUM:
      return &reduce<T, Sum>;
    case c10d::ReduceOp::PRODUCT: return &reduce<T, Prod>;
    case c10d::ReduceOp::MIN: return &reduce<T, Min>;
    case c10d::ReduceOp::MAX: return &reduce<T, Max>;
    default: return nullptr;
  }
}

template <typename T>
ReduceKernel integer(c10d::ReduceOp::RedOpType op) {
  switch (op) {
    case c10d::ReduceOp::BAND: return &reduce<T, BitAnd>;
    case c10d::ReduceOp::BOR: return &reduce<T, BitOr>;
    case c10d::ReduceOp::BXOR: return &reduce<T, BitXor>;
    default: return arithmetic<T>(op);
  }
}

ReduceKernel boolean(c10d::ReduceOp::RedOpType op) {
  switch (op) {
    case c10d::ReduceOp::SUM:
    case c10d::ReduceOp::MAX:
      return &reduce<uint8_t, Max>; // logical or
    case c10d::ReduceOp::PRODUCT:
    case c10d::ReduceOp::MIN:
      return &reduce<uint8_t, Min>; // logical and
    case c10d::ReduceOp::BAND: return &reduce<uint8_t, BitAnd>;
    case c10d::ReduceOp::BOR: return &reduce<uint8_t, BitOr>;
    case c10d::ReduceOp::BXOR: return &reduce<uint8_t, BitXor>;
    default: return nullptr;
  }
}

} // namespace

at::ScalarType kernel_dtype(at::ScalarType dtype) {
  if (dtype == at::kComplexFloat) {
    return at::kFloat;
  }
  if (dtype == at::kComplexDouble) {
    return at::kDouble;
  }
  return dtype;
}

ReduceKernel reduce_kernel(at::ScalarType dtype, c10d::ReduceOp::RedOpType op) {
  switch (kernel_dtype(dtype)) {
    case at::kFloat: return arithmetic<float>(op);
    case at::kDouble: return arithmetic<double>(op);
    case at::kBFloat16: return arithmetic<BF16>(op);
    case at::kHalf: return arithmetic<c10::Half>(op);
    case at::kChar: return integer<int8_t>(op);
    case at::kByte: return integer<uint8_t>(op);
    case at::kShort: return integer<int16_t>(op);
    case at::kInt: return integer<int32_t>(op);
    case at::kLong: return integer<int64_t>(op);
    case at::kBool: return boolean(op);
    default: return nullptr;
  }
}

} // namespace oneccl_bind_pt

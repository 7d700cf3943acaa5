#include "kernels.hpp"

#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace oneccl_bind_pt {

// The same loops twice: for CPUs with AVX2 (every Xeon since 2013; 8 floats per
// instruction, F16C for float16) and for any x86-64. -O3 here because the
// project's -O2 does not vectorize loops that need a remainder loop.
namespace avx2 {
#pragma GCC push_options
#pragma GCC target("avx2,f16c")
#pragma GCC optimize("O3")
#include "kernels_body.inc"
#pragma GCC pop_options
} // namespace avx2

namespace baseline {
#pragma GCC push_options
#pragma GCC optimize("O3")
#include "kernels_body.inc"
#pragma GCC pop_options
} // namespace baseline

at::ScalarType kernel_dtype(at::ScalarType dtype) {
  if (dtype == at::kComplexFloat) {
    return at::kFloat;
  }
  if (dtype == at::kComplexDouble) {
    return at::kDouble;
  }
  return dtype;
}

namespace {
bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return yes;
}
} // namespace

ReduceKernel reduce_kernel(at::ScalarType dtype, c10d::ReduceOp::RedOpType op) {
  return has_avx2() ? avx2::table(kernel_dtype(dtype), op) : baseline::table(kernel_dtype(dtype), op);
}

void copy_bytes(void* dst, const void* src, size_t n) {
  if (n < 4096) {
    std::memcpy(dst, src, n); // below glibc's rep movsb sizes: its vector moves
  } else if (has_avx2()) {
    avx2::copy(dst, src, n);
  } else {
    baseline::copy(dst, src, n);
  }
}

} // namespace oneccl_bind_pt

#include "kernels.hpp"

#include "helpers.hpp"

#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cpuid.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

namespace oneccl_bind_pt {

// The same loops three times: for CPUs with AVX-512 (Skylake-SP and later
// Xeons; 16 floats per instruction; used when asked, see choose()), with AVX2 (every Xeon since 2013; F16C for
// float16) and for any x86-64; a fourth time, bfloat16's only, with AVX512_BF16. -O3 here because the project's -O2 does not
// vectorize loops that need a remainder loop.
namespace avx512 {
#define OBPT_VECTOR_BYTES 64
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c,fma,prefer-vector-width=512")
#pragma GCC optimize("O3")
#include "kernels_body.inc"
#pragma GCC pop_options
#undef OBPT_VECTOR_BYTES
} // namespace avx512

// bfloat16 only, for CPUs with AVX512_BF16 (Sapphire Rapids and later Xeons): the
// avx512 loops with the conversion instruction (store_block in kernels_body.inc).
namespace avx512bf16 {
#define OBPT_VECTOR_BYTES 64
#define OBPT_BF16_INSTRUCTIONS
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,f16c,fma,prefer-vector-width=512")
#pragma GCC optimize("O3")
#include "kernels_body.inc"
#pragma GCC pop_options
#undef OBPT_BF16_INSTRUCTIONS
#undef OBPT_VECTOR_BYTES
} // namespace avx512bf16

namespace avx2 {
#define OBPT_VECTOR_BYTES 32
#pragma GCC push_options
#pragma GCC target("avx2,f16c")
#pragma GCC optimize("O3")
#include "kernels_body.inc"
#pragma GCC pop_options
#undef OBPT_VECTOR_BYTES
} // namespace avx2

namespace baseline {
#define OBPT_VECTOR_BYTES 16
#pragma GCC push_options
#pragma GCC optimize("O3")
#include "kernels_body.inc"
#pragma GCC pop_options
#undef OBPT_VECTOR_BYTES
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

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Avx512Bf16: return "avx512bf16";
    case Isa::Avx512: return "avx512";
    case Isa::Avx2: return "avx2";
    default: return "baseline";
  }
}

Isa best_isa() {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
  if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    return __builtin_cpu_supports("avx512bf16") ? Isa::Avx512Bf16 : Isa::Avx512;
  }
  return avx2 ? Isa::Avx2 : Isa::Baseline;
}

// Whether glibc's memcpy (`rep movsb` from a few KiB) is the faster copy. On Intel
// CPUs with ERMS it was: 20-45% faster than the vector loop at 16-64 MiB on a
// 16-core Xeon, 0-40% at 64 KiB-4 MiB on a 2-core one. On the AMD EPYC this
// backend was first tuned on, `rep movsb` ran 4-5x slower at some source/destination offsets (kernels.hpp),
// so the loop stays the choice there and wherever the vendor is not known.
bool glibc_copy_is_faster() {
  __builtin_cpu_init();
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __builtin_cpu_is("intel") && __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) && ((ebx >> 9) & 1u);
}

Kernels choose() {
  Kernels k;
  k.best = best_isa();
  // AVX-512 only when asked: on a 2-core Xeon with AVX-512 its kernels were no faster
  // than AVX2's, and reduce_scatter of 256 KiB-1 MiB was 10-12% slower (docs/performance.md).
  // bfloat16 is the exception: with AVX512_BF16's conversion its allreduce was 7-14% and its
  // reduce_scatter 11-30% faster on 2 ranks (docs/performance.md).
  k.isa = std::min(k.best, Isa::Avx2);
  k.bf16_isa = k.best == Isa::Avx512Bf16 ? Isa::Avx512Bf16 : k.isa;
  k.why = k.best == Isa::Avx512Bf16
      ? "AVX-512 measured no faster but for bfloat16 with AVX512_BF16; ONECCL_BIND_PT_KERNELS=avx512bf16 uses it for all"
      : k.best == Isa::Avx512 ? "AVX-512 measured no faster; ONECCL_BIND_PT_KERNELS=avx512 uses it"
                              : "the best this CPU runs";
  if (const char* want = std::getenv("ONECCL_BIND_PT_KERNELS"); want && *want) {
    const std::string w(want);
    const Isa asked = w == "avx512bf16" ? Isa::Avx512Bf16
        : w == "avx512"                 ? Isa::Avx512
        : w == "avx2"                   ? Isa::Avx2
        : w == "baseline"               ? Isa::Baseline
                                        : Isa::Invalid;
    TORCH_CHECK_VALUE(
        asked != Isa::Invalid, "ONECCL_BIND_PT_KERNELS=", w, " is not one of avx512bf16, avx512, avx2, baseline");
    // A path the CPU lacks would crash: the best it has instead.
    k.isa = k.bf16_isa = std::min(asked, k.best);
    k.why = asked <= k.best ? "ONECCL_BIND_PT_KERNELS" : "ONECCL_BIND_PT_KERNELS asks for more than this CPU has";
  }
  k.glibc_copy = glibc_copy_is_faster();
  k.copy_why = k.glibc_copy ? "Intel CPU with ERMS: glibc's rep movsb" : "not an Intel CPU with ERMS: rep movsb avoided";
  if (const char* want = std::getenv("ONECCL_BIND_PT_COPY"); want && *want) {
    const std::string w(want);
    TORCH_CHECK_VALUE(w == "glibc" || w == "loop", "ONECCL_BIND_PT_COPY=", w, " is not one of glibc, loop");
    k.glibc_copy = w == "glibc";
    k.copy_why = "ONECCL_BIND_PT_COPY";
  }
  // avx512bf16 is avx512 but for bfloat16: the loop and the other kernels say avx512.
  const Isa other = std::min(k.isa, Isa::Avx512);
  k.description = std::string("kernels ") + isa_name(other) +
      (k.bf16_isa != other ? std::string(", bfloat16 ") + isa_name(k.bf16_isa) : std::string()) + " (" + k.why +
      "; CPU has " + isa_name(k.best) + "), copy " + (k.glibc_copy ? "glibc" : std::string("loop ") + isa_name(other)) +
      " (" + k.copy_why + ")";
  return k;
}

using CopyFn = void (*)(void*, const void*, size_t);

void glibc_copy(void* dst, const void* src, size_t n) {
  std::memcpy(dst, src, n);
}

CopyFn loop_copy(Isa isa) {
  switch (isa) {
    case Isa::Avx512Bf16:
    case Isa::Avx512: return &avx512::copy;
    case Isa::Avx2: return &avx2::copy;
    default: return &baseline::copy;
  }
}

} // namespace

const Kernels& kernels() {
  static const Kernels chosen = choose();
  return chosen;
}

ReduceKernel reduce_kernel(at::ScalarType dtype, c10d::ReduceOp::RedOpType op) {
  const at::ScalarType t = kernel_dtype(dtype);
  switch (t == at::kBFloat16 ? kernels().bf16_isa : kernels().isa) {
    case Isa::Avx512Bf16: return t == at::kBFloat16 ? avx512bf16::table(t, op) : avx512::table(t, op);
    case Isa::Avx512: return avx512::table(kernel_dtype(dtype), op);
    case Isa::Avx2: return avx2::table(kernel_dtype(dtype), op);
    default: return baseline::table(kernel_dtype(dtype), op);
  }
}

namespace {

// Work this large is split across the helper threads (helpers.hpp), in pieces of at
// least kMinPiece bytes on cache-line boundaries: below, waking a helper costs about
// what it saves.
constexpr size_t kSplitFrom = size_t{256} << 10;
constexpr size_t kMinPiece = size_t{64} << 10;

void copy_here(void* dst, const void* src, size_t n) {
  if (n < 4096) {
    std::memcpy(dst, src, n); // below glibc's rep movsb sizes: its vector moves
  } else {
    // Chosen once per process (a guard check per call after that).
    static const CopyFn large_copy = kernels().glibc_copy ? &glibc_copy : loop_copy(kernels().isa);
    large_copy(dst, src, n);
  }
}

struct CopyJob {
  char* dst;
  const char* src;
};

struct ReduceJob {
  ReduceKernel kernel;
  size_t unit;
  char* out;
  const void* const* in;
  int n;
  char* also; // or nullptr
};

// The result's second copy is made a block at a time, right after the block is reduced,
// while it is still in the core's cache: memory sees its writes, not a second read.
constexpr size_t kAlsoBlock = size_t{32} << 10;

// [lo, hi) of a reduction, in elements.
void reduce_range(const ReduceJob& j, size_t lo, size_t hi) {
  const size_t step = j.also ? std::max<size_t>(1, kAlsoBlock / j.unit) : std::max<size_t>(1, hi - lo);
  const void* in_at[kMaxReduceInputs];
  for (size_t a = lo; a < hi; a += step) {
    const size_t b = std::min(hi, a + step);
    for (int q = 0; q < j.n; ++q) {
      in_at[q] = static_cast<const char*>(j.in[q]) + a * j.unit;
    }
    j.kernel(j.out + a * j.unit, in_at, j.n, b - a);
    if (j.also) {
      copy_here(j.also + a * j.unit, j.out + a * j.unit, (b - a) * j.unit);
    }
  }
}

} // namespace

void copy_bytes(void* dst, const void* src, size_t n) {
  if (n < kSplitFrom || !may_split()) {
    copy_here(dst, src, n);
    return;
  }
  CopyJob job{static_cast<char*>(dst), static_cast<const char*>(src)};
  split(n, 64, kMinPiece, [](void* ctx, size_t lo, size_t hi) {
    auto* j = static_cast<CopyJob*>(ctx);
    copy_here(j->dst + lo, j->src + lo, hi - lo);
  }, &job);
}

bool copies_split() {
  // The helpers a split always has: send/recv's batches of ring slots are sized for them,
  // not for idle helpers that may or may not be there.
  return helper_plan().count > 0;
}

void copy_ranges(const CopyRange* ranges, size_t count) {
  size_t total = 0;
  for (size_t i = 0; i < count; ++i) {
    total += ranges[i].n;
  }
  if (total < kSplitFrom || !may_split()) {
    for (size_t i = 0; i < count; ++i) {
      copy_here(ranges[i].dst, ranges[i].src, ranges[i].n);
    }
    return;
  }
  struct Job {
    const CopyRange* ranges;
    size_t count;
  } job{ranges, count};
  // [lo, hi) of the ranges laid end to end.
  split(total, 64, kMinPiece, [](void* ctx, size_t lo, size_t hi) {
    auto* j = static_cast<Job*>(ctx);
    size_t at = 0;
    for (size_t i = 0; i < j->count && at < hi; at += j->ranges[i].n, ++i) {
      const CopyRange& r = j->ranges[i];
      const size_t a = std::max(lo, at);
      const size_t b = std::min(hi, at + r.n);
      if (a < b) {
        copy_here(static_cast<char*>(r.dst) + (a - at), static_cast<const char*>(r.src) + (a - at), b - a);
      }
    }
  }, &job);
}

void reduce(ReduceKernel kernel, size_t unit, void* out, const void* const* in, int n, size_t count, void* also) {
  const bool here = count * unit < kSplitFrom || !may_split();
  if (here && !also) {
    kernel(out, in, n, count); // small ones, as they come: the latency path
    return;
  }
  TORCH_INTERNAL_ASSERT(n <= kMaxReduceInputs, "ccl: a reduction of ", n, " inputs; at most ", kMaxReduceInputs);
  ReduceJob job{kernel, unit, static_cast<char*>(out), in, n, static_cast<char*>(also)};
  if (here) {
    reduce_range(job, 0, count);
    return;
  }
  split(count, std::max<size_t>(1, 64 / unit), kMinPiece / unit, [](void* ctx, size_t lo, size_t hi) {
    reduce_range(*static_cast<const ReduceJob*>(ctx), lo, hi);
  }, &job);
}

} // namespace oneccl_bind_pt

// Reduction kernels for the shared-memory transport: one table for every
// reduce op x dtype the backend accepts.
//
// A kernel combines n inputs element-wise, always in rank order
// (((in[0] op in[1]) op in[2]) ...), so every rank that reduces the same
// buffers gets bit-identical output. bfloat16 and float16 accumulate in
// float32 and round once at the end.
#pragma once

#include <c10/core/ScalarType.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <cstddef>
#include <string>

namespace oneccl_bind_pt {

// out[i] = in[0][i] op ... op in[n-1][i] for i < count. `out` may alias one
// of the inputs. `count` is in elements of the kernel's type (complex types
// are handled as pairs of their real type by the caller).
using ReduceKernel = void (*)(void* out, const void* const* in, int n, size_t count);

// The instruction sets the kernels and the copy loop are compiled for, in order.
// Avx512Bf16 is Avx512 plus AVX512_BF16's conversion, for bfloat16 kernels.
enum class Isa { Baseline, Avx2, Avx512, Avx512Bf16, Invalid };

// What this process uses: chosen once from the CPU (AVX2 where it has it, AVX-512
// only when asked, except bfloat16's with AVX512_BF16), then ONECCL_BIND_PT_KERNELS
// (avx512bf16, avx512, avx2, baseline: every kernel at most that) and
// ONECCL_BIND_PT_COPY (glibc, loop). The first call throws
// c10::ValueError for a value it does not know; the group's constructor makes it.
struct Kernels {
  Isa isa = Isa::Baseline;  // the reduce kernels' and the copy loop's
  Isa bf16_isa = Isa::Baseline; // bfloat16's kernels
  Isa best = Isa::Baseline; // the best this CPU runs
  bool glibc_copy = false;  // copies of 4 KiB and more through glibc's memcpy
  const char* why = "";
  const char* copy_why = "";
  std::string description;  // one line, for the doctor
};
const Kernels& kernels();

// The kernel for `op` on `dtype`, or nullptr when there is none.
// AVG and PREMUL_SUM use the SUM kernel (the caller scales); bool uses
// logical or (SUM, MAX) and logical and (PRODUCT, MIN).
ReduceKernel reduce_kernel(at::ScalarType dtype, c10d::ReduceOp::RedOpType op);

// The element type a kernel sees for `dtype` (complex -> its real type).
at::ScalarType kernel_dtype(at::ScalarType dtype);

// memcpy for the transport's copies of tensors and staging buffers (no overlap).
// glibc's memcpy moves sizes from a few KiB up to its non-temporal threshold with
// `rep movsb`, which on some CPUs (AMD EPYC here) runs 4-5x slower for some offsets
// between source and destination: a 1 MiB all-to-all took 50 us or 280-300 us from
// one process start to the next (the tensors' page offsets change), and 52-54 us
// every time with GLIBC_TUNABLES=glibc.cpu.x86_rep_movsb_threshold raised; in the
// benchmark broadcast from 64 KiB to 4 MiB took 3-5x raw oneCCL's time. A plain
// forward loop of vector moves takes the same time whatever the offsets.
// Copies of kSplitFrom (256 KiB) and more are split across the helper threads
// (helpers.hpp).
void copy_bytes(void* dst, const void* src, size_t n);

// Several copies as one (a run of a send's ring slots; a staged step's copies to or from
// every peer): split across the helper threads by their total bytes from kSplitFrom on, a
// piece possibly spanning two copies, so a step wakes and joins the helpers once.
struct CopyRange {
  void* dst;
  const void* src;
  size_t n;
};
void copy_ranges(const CopyRange* ranges, size_t count);
// Whether copies of kSplitFrom bytes and more are split (this process has helper threads).
bool copies_split();

// kernel(out, in, n, count), split across the helper threads from 256 KiB of output;
// `unit` is the bytes of one element the kernel counts. At most kMaxReduceInputs inputs;
// `out` may be one of them exactly (not overlap one at another offset). `also`, if given,
// gets a copy of the result, each block copied right after it is reduced; it too may be
// one of the inputs exactly (a block's inputs are read before its copy is written).
inline constexpr int kMaxReduceInputs = 128;
void reduce(ReduceKernel kernel, size_t unit, void* out, const void* const* in, int n, size_t count,
            void* also = nullptr);

} // namespace oneccl_bind_pt

// What the shared-memory transport's three files share: the segment's layout
// and constants, the accessors into it, and the atomics every step uses.
// shm.cpp makes and maps the segments; shm_collectives.cpp runs collective
// steps through them; shm_p2p.cpp streams send/recv through their rings.
#pragma once

#include "shm.hpp"

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace oneccl_bind_pt {

using Clock = std::chrono::steady_clock;

inline constexpr uint64_t kMagic = 0x34766d6873747062ull; // "bptshmv4": the header has a chunk and a window
inline constexpr size_t kLine = 64;
inline constexpr size_t kPage = 4096;
inline constexpr size_t kSlots = 8;              // message slots per (sender, receiver)
inline constexpr size_t kSlotBytes = 64 << 10;   // payload per slot
inline constexpr int kMaxRanks = 128;            // larger groups use oneCCL
// Each staging buffer (two per rank); a staged step moves a chunk of at most this
// (ShmLimits::chunk_bytes, agreed in Shm::connect).
inline constexpr size_t kBufferBytes = kStagingBufferBytes;
// Allreduce up to this size: every rank folds all buffers (one meeting).
// Above: each rank reduces its slice, then everyone gathers (two meetings).
// Above it the split wins even for two ranks: each rank then reduces only its
// half, so the two cores share the arithmetic (measured: 256 KiB float32,
// 46 us split vs 74 us when both reduce everything).
inline constexpr size_t kOneMeetingBytes = 32 << 10;
// Waiting this long on peers, check that they are still alive.
inline constexpr auto kLivenessAfter = std::chrono::milliseconds(500);

inline uint64_t load_acquire(const uint64_t* p) {
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
inline void store_release(uint64_t* p, uint64_t v) {
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
}


inline std::string human(size_t bytes) {
  return std::to_string(bytes) + " B";
}

// A Pending's moved(): whether the transport's count of moves changed since it last looked.
struct MoveWatch {
  uint64_t seen = ~uint64_t{0};
  bool moved(uint64_t moves) {
    const bool m = moves != seen;
    seen = moves;
    return m;
  }
};

struct Shm::Sig {
  uint64_t step;
  char op[40];
  uint8_t kind;
  int8_t dtype;  // at::ScalarType of reductions, -1 otherwise
  int8_t redop;  // c10d RedOpType, -1 otherwise
  uint8_t fits;  // this rank can run the step here: kStaged or kSingleCopy (else 0)
  int32_t root;
  uint64_t count;
  uint64_t staged;
  uint64_t src;  // this rank's tensors, in its address space: what single-copy peers read
  uint64_t dst;
};

// Sig::fits: staged into this rank's buffer, or left in its tensor for peers to read.
inline constexpr uint8_t kStaged = 1;
inline constexpr uint8_t kSingleCopy = 2;

struct Shm::SlotHeader {
  uint64_t msg;    // per (sender, receiver), from 1
  int32_t tag;
  uint32_t last;   // the message's final chunk
  uint64_t total;  // bytes of the whole message
  uint64_t offset; // of this chunk
  uint64_t bytes;  // in this chunk
  uint64_t addr;   // 0, or the whole message left in the sender's tensor, at this address in its
                   // memory, for the receiver to read (single copy; the only slot of the message)
};
static_assert(sizeof(Shm::SlotHeader) <= kLine, "a slot's header fits its cache line");

struct Shm::Layout {
  size_t arrived, reduced, done, sigs, counts, heads, tails, rings, buffers, buffer_bytes, total;
  int n;
  Layout(int ranks, size_t buffer) : buffer_bytes(buffer), n(ranks) {
    size_t at = 0;
    auto take = [&](size_t bytes, size_t align) {
      at = (at + align - 1) / align * align;
      const size_t here = at;
      at += bytes;
      return here;
    };
    take(kLine, kLine); // header: magic, rank, pid, sizes
    arrived = take(kLine, kLine);
    reduced = take(kLine, kLine);
    done = take(kLine, kLine);
    sigs = take(2 * ((sizeof(Sig) + kLine - 1) / kLine * kLine), kLine);
    counts = take(2 * 2 * n * sizeof(uint64_t), kLine);
    heads = take(n * kLine, kLine);
    tails = take(n * kLine, kLine);
    rings = take(n * kSlots * (kLine + kSlotBytes), kPage);
    buffers = take(2 * buffer, kPage);
    total = (at + kPage - 1) / kPage * kPage;
  }
  size_t sig_stride() const { return (sizeof(Sig) + kLine - 1) / kLine * kLine; }
};

struct Header {
  uint64_t magic;
  int32_t rank;
  int32_t size;
  int32_t pid;
  uint64_t total;
  uint64_t self; // where the owner mapped it: the probe of single-copy reads reads it there
  uint64_t chunk; // the owner's staging chunk (ShmLimits::chunk_bytes): the group takes the smallest
  uint64_t window; // the owner's single-copy reduce window (ShmLimits::window_bytes): the smallest too
};
static_assert(sizeof(Header) <= kLine, "the header fits its cache line");

inline uint64_t* Shm::arrived(int q) const {
  return reinterpret_cast<uint64_t*>(bases_[q] + layout_->arrived);
}
inline uint64_t* Shm::reduced(int q) const {
  return reinterpret_cast<uint64_t*>(bases_[q] + layout_->reduced);
}
inline uint64_t* Shm::done(int q) const {
  return reinterpret_cast<uint64_t*>(bases_[q] + layout_->done);
}
inline Shm::Sig* Shm::sig(int q, uint64_t step) const {
  return reinterpret_cast<Sig*>(bases_[q] + layout_->sigs + (step & 1) * layout_->sig_stride());
}
inline uint64_t* Shm::counts(int q, uint64_t step) const {
  return reinterpret_cast<uint64_t*>(bases_[q] + layout_->counts) + (step & 1) * 2 * size_;
}
inline char* Shm::buffer(int q, uint64_t step) const {
  return bases_[q] + layout_->buffers + (step & 1) * layout_->buffer_bytes;
}
inline uint64_t* Shm::ring_head(int src, int dst) const {
  return reinterpret_cast<uint64_t*>(bases_[src] + layout_->heads + dst * kLine);
}
inline uint64_t* Shm::ring_tail(int dst, int src) const {
  return reinterpret_cast<uint64_t*>(bases_[dst] + layout_->tails + src * kLine);
}
inline Shm::SlotHeader* Shm::slot(int src, int dst, uint64_t index) const {
  const size_t i = dst * kSlots + index % kSlots;
  return reinterpret_cast<SlotHeader*>(bases_[src] + layout_->rings + i * (kLine + kSlotBytes));
}

// A message being received, or waiting for its recv (shm_p2p.cpp).
struct Shm::Incoming {
  int source;
  int tag;
  uint64_t total;
  uint64_t received = 0;
  bool complete = false;
  ShmRecv* recv = nullptr;    // bound receive, if posted
  std::vector<char> held;      // unexpected: the bytes, until a recv takes them
  std::string error;           // reading the sender's tensor failed: what the recv raises
};

} // namespace oneccl_bind_pt

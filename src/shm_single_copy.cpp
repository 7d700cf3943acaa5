// Single copy (Route::Cma): each rank reads what it needs straight from its peers'
// tensors with process_vm_readv (Shm::read_peer), instead of every rank copying its
// data into its staging buffer first. Peers publish their tensors' addresses in their
// step signature; a step ends with one more meeting (Shm::done), since a rank may reuse
// its tensors only once no peer reads them any more.
#include "shm_pending.hpp"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <numeric>

namespace oneccl_bind_pt {

bool ShmPending::move_single_copy(const Prim& p) {
  const int n = shm_.size_;
  const int me = shm_.rank_;
  const size_t unit = element_bytes(p);
  const size_t lo = chunk_ * capacity(p);
  const size_t hi = std::min(total(p), lo + capacity(p));
  const size_t w = hi - lo;
  const char* src = static_cast<const char*>(p.src);
  char* dst = static_cast<char*>(p.dst);
  char* scratch = shm_.buffer(me, step_); // nobody reads it in this mode
  auto peer_src = [&](int q) { return shm_.sig(q, step_)->src; };
  // A reduction's inputs in rank order (every rank's result bit-identical): ours in
  // place, each peer's `count` elements at element `at` of its input read into scratch.
  const void* in[kMaxRanks];
  auto read_shares = [&](size_t at, size_t count) {
    size_t k = 0;
    for (int q = 0; q < n; ++q) {
      if (q == me) {
        in[q] = src + at * unit;
      } else {
        char* to = scratch + k++ * count * unit;
        shm_.read_peer(q, to, peer_src(q) + at * unit, count * unit, op_);
        in[q] = to;
      }
    }
  };
  switch (p.kind) {
    case Prim::Kind::Allreduce: {
      // Reduce our slice into our output, publish it, then read the others' slices.
      const auto [slo, shi] = slice(w, me);
      read_shares(lo + slo, shi - slo);
      if (shi > slo) {
        reduce(p.red->kernel, unit, dst + (lo + slo) * unit, in, n, shi - slo);
      }
      store_release(shm_.reduced(me), step_);
      phase_ = Phase::Reduced;
      return finish_two_meetings(p);
    }
    case Prim::Kind::Reduce:
      if (p.peer == me && w > 0) {
        read_shares(lo, w);
        reduce(p.red->kernel, unit, dst + lo * unit, in, n, w);
      }
      return true;
    case Prim::Kind::ReduceScatter:
      if (w > 0) {
        read_shares(me * p.count + lo, w);
        reduce(p.red->kernel, unit, dst + lo * unit, in, n, w);
      }
      return true;
    case Prim::Kind::Broadcast:
      if (p.peer != me && w > 0) {
        shm_.read_peer(p.peer, dst + lo, peer_src(p.peer) + lo, w, op_);
      }
      return true;
    case Prim::Kind::Allgatherv: {
      size_t offset = 0;
      for (int q = 0; q < n; ++q) {
        const size_t theirs = p.recv_counts[q];
        char* to = p.dst_list.empty() ? dst + offset : static_cast<char*>(p.dst_list[q]);
        if (theirs > lo) {
          const size_t len = std::min(theirs, hi) - lo;
          if (q != me) {
            shm_.read_peer(q, to + lo, peer_src(q) + lo, len, op_);
          } else if (to + lo != src + lo) {
            std::memmove(to + lo, src + lo, len);
          }
        }
        offset += theirs;
      }
      return true;
    }
    case Prim::Kind::Alltoallv: {
      // One step: what q sends us starts after what it sends the ranks before us. Our own
      // part first: an input inside the output (a root's gather_single in place) is read
      // before the peers' parts land on it.
      const size_t own_to = std::accumulate(p.recv_counts.begin(), p.recv_counts.begin() + me, size_t{0});
      const size_t own_at = std::accumulate(p.send_counts.begin(), p.send_counts.begin() + me, size_t{0});
      if (p.recv_counts[me] > 0 && dst + own_to != src + own_at) {
        std::memmove(dst + own_to, src + own_at, p.recv_counts[me]);
      }
      size_t offset = 0;
      for (int q = 0; q < n; ++q) {
        const uint64_t* sent = shm_.counts(q, step_);
        const size_t at = std::accumulate(sent, sent + me, size_t{0});
        const size_t len = p.recv_counts[q];
        if (len > 0 && q != me) {
          shm_.read_peer(q, dst + offset, peer_src(q) + at, len, op_);
        }
        offset += len;
      }
      return true;
    }
    default:
      TORCH_INTERNAL_ASSERT(false, "ccl: ", prim_name(p.kind), " has no single-copy step");
  }
}

} // namespace oneccl_bind_pt

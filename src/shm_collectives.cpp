#include "shm_pending.hpp"

#include "errors.hpp"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <sstream>
#include <tuple>

namespace oneccl_bind_pt {

// ---- collectives ----------------------------------------------------------------

// Steps of a Prim: large ones go through the staging buffer in chunks.
// Units are elements for reductions, bytes otherwise; every rank computes
// the same chunks from values the signatures check.
size_t ShmPending::capacity(const Prim& p) const {
  const size_t buffer = shm_.layout_->buffer_bytes;
  const size_t unit = element_bytes(p);
  const size_t others = shm_.size_ - 1;
  if (route_ == Route::Cma) {
    // Single copy: a reduction reads the peers' shares of a window into this rank's
    // buffer (n - 1 of them: allreduce's slices start on whole lines); the rest read
    // straight into the output, the whole Prim in one step. Reduce and reduce_scatter read
    // a window (ShmLimits::window_bytes: the chunk, but the whole buffer where ranks outnumber
    // CPUs), which the reduction then finds in cache: on a 2-core Intel Xeon VM, 2 ranks,
    // reduce_scatter of 1-16 MiB took 0.73-0.82x with 256 KiB against 2 MiB (two runs).
    // Allreduce keeps the whole buffer: it took 1.26-1.36x at
    // 4-8 MiB with 256-512 KiB windows, each a reduction, a gather and three meetings.
    switch (p.kind) {
      case Prim::Kind::Allreduce:
        return shm_.size_ * (buffer / unit / others / 16 * 16);
      case Prim::Kind::Reduce:
      case Prim::Kind::ReduceScatter:
        return std::min(buffer, std::max(shm_.window_bytes_, 64 * unit * others)) / unit / others / 64 * 64;
      default:
        return std::max<size_t>(1, total(p));
    }
  }
  // reduce_scatter stages every rank's share, alltoallv a window per peer.
  const bool per_rank = p.kind == Prim::Kind::ReduceScatter || p.kind == Prim::Kind::Alltoallv;
  // A chunk of the group's size (ShmLimits::chunk_bytes), but broadcast's, which only
  // copies, fills the buffer; a window per rank keeps at least 64 elements.
  const size_t chunk = p.kind == Prim::Kind::Broadcast
      ? buffer
      : std::min(buffer, std::max(shm_.chunk_bytes_, per_rank ? 64 * unit * shm_.size_ : 64 * unit));
  return per_rank ? chunk / (unit * shm_.size_) / 64 * 64 : chunk / unit;
}

size_t ShmPending::total(const Prim& p) const {
  switch (p.kind) {
    case Prim::Kind::Allreduce:
    case Prim::Kind::Reduce:
    case Prim::Kind::ReduceScatter:
    case Prim::Kind::Broadcast:
      return p.count;
    case Prim::Kind::Allgatherv:
      return p.recv_counts.empty() ? 0 : *std::max_element(p.recv_counts.begin(), p.recv_counts.end());
    case Prim::Kind::Alltoallv:
      return largest_pair_; // what every pair moves, known after the first meeting
    default:
      return 0; // one step
  }
}

size_t ShmPending::chunks(const Prim& p) const {
  const size_t cap = capacity(p);
  return std::max<size_t>(1, (total(p) + cap - 1) / cap);
}

void ShmPending::learn_pairs(const Prim& p) {
  largest_pair_ = 0;
  if (p.kind == Prim::Kind::Alltoallv) {
    for (int q = 0; q < shm_.size_; ++q) {
      const uint64_t* sent = shm_.counts(q, step_);
      largest_pair_ = std::max<size_t>(largest_pair_, *std::max_element(sent, sent + shm_.size_));
    }
  }
}

ShmPending::OwnPart ShmPending::own_part(const Prim& p) const {
  const int me = shm_.rank_;
  OwnPart own;
  for (int q = 0; q < me; ++q) {
    own.from += p.send_counts[q];
    own.to += p.recv_counts[q];
  }
  // The signatures agree that what this rank sends itself is what it expects from itself.
  // Straight across only where the part is its own slot of the output already, or lies
  // outside the output: the peers' parts land in the output in the same step.
  const size_t n = p.send_counts[me];
  const auto* a = static_cast<const char*>(p.src) + own.from;
  const auto* out = static_cast<const char*>(p.dst);
  const size_t out_bytes = std::accumulate(p.recv_counts.begin(), p.recv_counts.end(), size_t{0});
  own.direct = a == out + own.to || a + n <= out || out + out_bytes <= a;
  return own;
}

void ShmPending::stage(const Prim& p) {
  step_ = ++shm_.next_step_;
  if (chunk_ == 0) {
    route_ = Route::Shm; // until the meeting decides: the window below is a staging one
  }
  const int me = shm_.rank_;
  const int n = shm_.size_;
  const size_t unit = element_bytes(p);
  const size_t lo = chunk_ * capacity(p);
  const size_t hi = std::min(total(p), lo + capacity(p));
  auto* s = shm_.sig(me, step_);
  char* buf = shm_.buffer(me, step_);
  uint64_t* counts = shm_.counts(me, step_);
  bool fits = true;
  bool single = false; // this rank leaves its data in its tensor (chunk 0 decides)
  if (chunk_ == 0) {
    // Whether this rank can take the shared-memory path: the op is within
    // the measured crossover.
    size_t bytes = 0;
    switch (p.kind) {
      case Prim::Kind::Allreduce:
      case Prim::Kind::Reduce:
      case Prim::Kind::Broadcast:
      case Prim::Kind::Allgatherv:
        bytes = p.count * unit;
        break;
      case Prim::Kind::ReduceScatter:
        bytes = p.count * unit * n;
        break;
      case Prim::Kind::Alltoallv:
        bytes = std::accumulate(p.send_counts.begin(), p.send_counts.end(), size_t{0});
        break;
      default:
        break;
    }
    const bool kernel_ok = !p.red || p.red->kernel != nullptr;
    const Route r = shm_.limits_.route(p.kind, bytes, shm_.single_copy_);
    fits = kernel_ok && r != Route::OneCCL;
    single = fits && r == Route::Cma;
  }
  if (chunk_ == 0 ? fits && !single : route_ == Route::Shm) {
    const char* src = static_cast<const char*>(p.src);
    switch (p.kind) {
      case Prim::Kind::Allreduce:
        if ((hi - lo) * unit > kOneMeetingBytes) {
          // Two meetings: each peer reads from this buffer only the slice it reduces, and this
          // rank reduces its own slice from its tensor, into that slice of the buffer and its
          // output. So the slice is not staged, nor gathered: at 2 ranks a step moves 4 times
          // the chunk's bytes, not 5.5.
          const auto [slo, shi] = slice(hi - lo, me);
          CopyRange ranges[2] = {{buf, src + lo * unit, slo * unit},
                                 {buf + shi * unit, src + (lo + shi) * unit, (hi - lo - shi) * unit}};
          copy_ranges(ranges, 2);
          break;
        }
        [[fallthrough]];
      case Prim::Kind::Reduce:
        copy_bytes(buf, src + lo * unit, (hi - lo) * unit);
        break;
      case Prim::Kind::ReduceScatter: {
        // Every peer's share; this rank reduces its own from its tensor (move()).
        CopyRange ranges[kMaxRanks];
        size_t k = 0;
        for (int q = 0; q < n; ++q) {
          if (q != me) {
            ranges[k++] = {buf + q * (hi - lo) * unit, src + (q * p.count + lo) * unit, (hi - lo) * unit};
          }
        }
        copy_ranges(ranges, k);
        break;
      }
      case Prim::Kind::Broadcast:
        if (p.peer == me) {
          copy_bytes(buf, src + lo, hi - lo);
        }
        break;
      case Prim::Kind::Allgatherv:
        if (p.count > lo) {
          copy_bytes(buf, src + lo, std::min(p.count, hi) - lo);
        }
        break;
      case Prim::Kind::Alltoallv: {
        // Window [lo, lo + capacity) of what goes to each peer, at slot q; this rank's own
        // part goes straight to its output in move() (own_part()).
        const size_t cap = capacity(p);
        const size_t from = chunk_ * cap;
        const bool direct = own_part(p).direct;
        size_t offset = 0;
        CopyRange ranges[kMaxRanks];
        size_t k = 0;
        for (int q = 0; q < n; ++q) {
          if (p.send_counts[q] > from && !(q == me && direct)) {
            ranges[k++] = {buf + q * cap, src + offset + from, std::min(cap, p.send_counts[q] - from)};
          }
          offset += p.send_counts[q];
        }
        copy_ranges(ranges, k);
        break;
      }
      default:
        break;
    }
  }
  for (int q = 0; q < n; ++q) {
    counts[q] = q < static_cast<int>(p.send_counts.size()) ? p.send_counts[q] : 0;
    counts[n + q] = q < static_cast<int>(p.recv_counts.size()) ? p.recv_counts[q] : 0;
  }
  s->step = step_;
  std::strncpy(s->op, op_, sizeof s->op - 1);
  s->op[sizeof s->op - 1] = 0;
  s->kind = static_cast<uint8_t>(p.kind);
  s->dtype = p.red ? static_cast<int8_t>(p.red->scalar_type) : -1;
  s->redop = p.red ? static_cast<int8_t>(p.red->kind) : -1;
  s->fits = !fits ? 0 : single ? kSingleCopy : kStaged;
  s->src = reinterpret_cast<uint64_t>(p.src);
  s->dst = reinterpret_cast<uint64_t>(p.dst);
  s->root = p.peer;
  s->count = p.count;
  s->staged = 0;
  store_release(shm_.arrived(me), step_);
  waiting_since_ = Clock::now();
  next_check_ = waiting_since_ + kLivenessAfter;
}

bool ShmPending::all_reached(uint64_t* (Shm::*counter)(int) const) {
  for (int q = 0; q < shm_.size_; ++q) {
    if (load_acquire((shm_.*counter)(q)) < step_) {
      check_liveness();
      return false;
    }
  }
  return true;
}

bool ShmPending::met() {
  return all_reached(&Shm::arrived);
}

bool ShmPending::drained() {
  return all_reached(&Shm::done);
}

bool ShmPending::end_step() {
  if (route_ != Route::Cma) {
    return true;
  }
  store_release(shm_.done(shm_.rank_), step_);
  phase_ = Phase::Draining;
  return drained();
}

void ShmPending::check_liveness() {
  const auto now = Clock::now();
  if (now < next_check_) {
    return;
  }
  next_check_ = now + std::chrono::milliseconds(100);
  for (int q = 0; q < shm_.size_; ++q) {
    if (q != shm_.rank_) {
      shm_.check_peer_alive(q, op_);
    }
  }
}

std::string ShmPending::describe(int q) const {
  const auto* s = shm_.sig(q, step_);
  std::ostringstream out;
  out << "rank " << q << ": " << s->op << " (" << prim_name(static_cast<Prim::Kind>(s->kind));
  const auto kind = static_cast<Prim::Kind>(s->kind);
  if (s->dtype >= 0) {
    out << " of " << s->count << " x " << dtype_name(static_cast<at::ScalarType>(s->dtype)) << ", "
        << reduce_op_name(static_cast<c10d::ReduceOp::RedOpType>(s->redop));
  } else if (kind == Prim::Kind::Alltoallv || kind == Prim::Kind::Allgatherv) {
    const uint64_t* c = shm_.counts(q, step_);
    out << ", sends [";
    for (int r = 0; r < shm_.size_; ++r) {
      out << (r ? ", " : "") << (kind == Prim::Kind::Allgatherv ? s->count : c[r]);
    }
    out << "] B, expects [";
    for (int r = 0; r < shm_.size_; ++r) {
      out << (r ? ", " : "") << c[shm_.size_ + r];
    }
    out << "] B";
  } else if (kind != Prim::Kind::Barrier) {
    out << " of " << human(s->count);
  }
  if (kind == Prim::Kind::Broadcast || kind == Prim::Kind::Reduce) {
    out << ", root " << s->root;
  }
  out << ")";
  return out.str();
}

void ShmPending::check_signatures(const Prim& p) {
  const int n = shm_.size_;
  const auto* mine = shm_.sig(shm_.rank_, step_);
  bool same = true;
  for (int q = 0; q < n && same; ++q) {
    const auto* s = shm_.sig(q, step_);
    same = s->step == step_ && s->kind == mine->kind && s->dtype == mine->dtype &&
        s->redop == mine->redop && s->root == mine->root;
    if (same && p.kind != Prim::Kind::Allgatherv && p.kind != Prim::Kind::Alltoallv) {
      same = s->count == mine->count;
    }
  }
  // The v-collectives: what each rank sends to each must be what that one expects.
  for (int from = 0; from < n && same; ++from) {
    const auto* s = shm_.sig(from, step_);
    const uint64_t* sent = shm_.counts(from, step_);
    for (int to = 0; to < n && same; ++to) {
      const uint64_t expected = shm_.counts(to, step_)[n + from];
      if (p.kind == Prim::Kind::Allgatherv) {
        same = s->count == expected;
      } else if (p.kind == Prim::Kind::Alltoallv) {
        same = sent[to] == expected;
      }
    }
  }
  if (same) {
    return;
  }
  std::ostringstream msg;
  msg << "ccl " << op_ << ": the ranks of this process group called different collectives, or the "
      << "same one with different sizes, types or roots, at the same point: ";
  for (int q = 0; q < n; ++q) {
    msg << (q ? "; " : "") << describe(q);
  }
  if (next_ == 0) {
    msg << ". Nothing was exchanged; the process group remains usable.";
  } else {
    // An op of several parts (a sparse tensor's indices and values, several outputs): the
    // earlier parts were exchanged, and may have written their outputs.
    msg << ". Its first " << next_ << " of " << prims_.size()
        << " parts were exchanged before this one and may have written their outputs; the rest was not. "
        << "The process group remains usable.";
  }
  throw CollectiveMismatch({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, msg.str());
}

bool ShmPending::move(const Prim& p) {
  if (route_ == Route::Cma) {
    return move_single_copy(p);
  }
  const int n = shm_.size_;
  const int me = shm_.rank_;
  const size_t unit = element_bytes(p);
  const size_t lo = chunk_ * capacity(p);
  const size_t hi = std::min(total(p), lo + capacity(p));
  const size_t w = hi - lo;
  const void* in[kMaxRanks];
  for (int q = 0; q < n; ++q) {
    in[q] = shm_.buffer(q, step_);
  }
  char* dst = static_cast<char*>(p.dst);
  switch (p.kind) {
    case Prim::Kind::Barrier:
      return true;
    case Prim::Kind::Allreduce: {
      if (w * unit <= kOneMeetingBytes) {
        reduce(p.red->kernel, unit, dst + lo * unit, in, n, w);
        return true;
      }
      // Reduce our slice, from our tensor and the peers' buffers, into our own buffer
      // (peers only read other slices of it now), publish it, then gather every slice.
      const auto [slo, shi] = slice(w, me);
      const void* slice_in[kMaxRanks];
      for (int q = 0; q < n; ++q) {
        slice_in[q] = static_cast<const char*>(in[q]) + slo * unit;
      }
      slice_in[me] = static_cast<const char*>(p.src) + (lo + slo) * unit; // not staged (stage())
      // Into the buffer for the peers, and into our output while each block is in cache.
      reduce(p.red->kernel, unit, shm_.buffer(me, step_) + slo * unit, slice_in, n, shi - slo,
             dst + (lo + slo) * unit);
      store_release(shm_.reduced(me), step_);
      phase_ = Phase::Reduced;
      return finish_two_meetings(p);
    }
    case Prim::Kind::Reduce:
      if (p.peer == me) {
        reduce(p.red->kernel, unit, dst + lo * unit, in, n, w);
      }
      return true;
    case Prim::Kind::ReduceScatter: {
      const void* share_in[kMaxRanks];
      for (int q = 0; q < n; ++q) {
        share_in[q] = static_cast<const char*>(in[q]) + me * w * unit;
      }
      share_in[me] = static_cast<const char*>(p.src) + (me * p.count + lo) * unit; // not staged (stage())
      reduce(p.red->kernel, unit, dst + lo * unit, share_in, n, w);
      return true;
    }
    case Prim::Kind::Broadcast:
      if (p.peer != me && w > 0) {
        copy_bytes(dst + lo, in[p.peer], w);
      }
      return true;
    case Prim::Kind::Allgatherv: {
      size_t offset = 0;
      CopyRange ranges[kMaxRanks];
      size_t k = 0;
      for (int q = 0; q < n; ++q) {
        const size_t theirs = p.recv_counts[q];
        char* to = p.dst_list.empty() ? dst + offset : static_cast<char*>(p.dst_list[q]);
        if (theirs > lo) {
          ranges[k++] = {to + lo, in[q], std::min(theirs, hi) - lo};
        }
        offset += theirs;
      }
      copy_ranges(ranges, k); // one split across the helpers for all of them
      return true;
    }
    case Prim::Kind::Alltoallv: {
      const size_t cap = capacity(p);
      const size_t from = chunk_ * cap;
      const OwnPart own = own_part(p);
      size_t offset = 0;
      CopyRange ranges[kMaxRanks];
      size_t k = 0;
      for (int q = 0; q < n; ++q) {
        if (p.recv_counts[q] > from) {
          const char* at = q == me && own.direct ? static_cast<const char*>(p.src) + own.from + from
                                                 : static_cast<const char*>(in[q]) + me * cap;
          if (dst + offset + from != at) { // in place: the part is where it goes already
            ranges[k++] = {dst + offset + from, at, std::min(cap, p.recv_counts[q] - from)};
          }
        }
        offset += p.recv_counts[q];
      }
      copy_ranges(ranges, k);
      return true;
    }
    default:
      TORCH_INTERNAL_ASSERT(false, "ccl: ", prim_name(p.kind), " is not a collective step");
  }
}

std::pair<size_t, size_t> ShmPending::slice(size_t w, int q) const {
  // Slices start on cache lines (of elements of any size up to 16 bytes).
  const size_t per = ((w + shm_.size_ - 1) / shm_.size_ + 15) / 16 * 16;
  const size_t lo = std::min(w, per * q);
  return {lo, std::min(w, lo + per)};
}

bool ShmPending::finish_two_meetings(const Prim& p) {
  const int n = shm_.size_;
  if (!all_reached(&Shm::reduced)) {
    return false;
  }
  const size_t unit = element_bytes(p);
  const size_t lo = chunk_ * capacity(p);
  const size_t w = std::min(total(p), lo + capacity(p)) - lo;
  char* dst = static_cast<char*>(p.dst) + lo * unit;
  CopyRange ranges[kMaxRanks];
  size_t k = 0;
  for (int q = 0; q < n; ++q) {
    const auto [slo, shi] = slice(w, q);
    if (shi <= slo || q == shm_.rank_) {
      continue; // this rank's own slice went into its output as it was reduced (move())
    }
    if (route_ == Route::Cma) {
      // Each rank reduced its slice into its own output: read the others' there.
      shm_.read_peer(q, dst + slo * unit, shm_.sig(q, step_)->dst + (lo + slo) * unit, (shi - slo) * unit, op_);
    } else {
      ranges[k++] = {dst + slo * unit, shm_.buffer(q, step_) + slo * unit, (shi - slo) * unit};
    }
  }
  copy_ranges(ranges, k); // the staged slices, as one split across the helpers
  return true;
}

void ShmPending::leave_fifo() {
  auto& fifo = shm_.fifo_;
  fifo.erase(std::remove(fifo.begin(), fifo.end(), this), fifo.end());
}

bool ShmPending::poll() {
  const auto at = std::make_tuple(next_, chunk_, phase_);
  const bool done = advance();
  if (std::make_tuple(next_, chunk_, phase_) != at || done) {
    ++shm_.moves_;
  }
  return done;
}

bool ShmPending::advance() {
  while (next_ < prims_.size()) {
    const Prim& p = prims_[next_];
    switch (phase_) {
      case Phase::Queued:
        if (shm_.fifo_.front() != this) {
          return false; // an earlier op of this group is still running
        }
        stage(p);
        phase_ = Phase::Staged;
        [[fallthrough]];
      case Phase::Staged: {
        if (!met()) {
          return false;
        }
        try {
          check_signatures(p);
        } catch (...) {
          // Every rank saw the same signatures and gives up this op alike.
          next_ = prims_.size();
          leave_fifo();
          throw;
        }
        if (chunk_ == 0) {
          learn_pairs(p);
          bool all = true;
          bool any_single = false;
          for (int q = 0; q < shm_.size_; ++q) {
            all = all && shm_.sig(q, step_)->fits != 0;
            any_single = any_single || shm_.sig(q, step_)->fits == kSingleCopy;
          }
          // A rank whose share is above the single-copy size makes the step single copy
          // for all (peers' data is read from their tensors whatever they staged).
          route_ = !all ? Route::OneCCL : any_single ? Route::Cma : Route::Shm;
        }
        if (route_ != Route::OneCCL) {
          if (!move(p)) {
            return false; // phase_ is Reduced: waiting for peers' slices
          }
          if (!end_step()) {
            return false;
          }
          break;
        }
        ccl_ = shm_.fallback_->start(op_, {p});
        phase_ = Phase::OneCCL;
        [[fallthrough]];
      }
      case Phase::OneCCL:
        if (!ccl_->poll()) {
          return false;
        }
        ccl_.reset();
        break;
      case Phase::Reduced:
        if (!finish_two_meetings(p) || !end_step()) {
          return false;
        }
        break;
      case Phase::Draining:
        if (!drained()) {
          return false;
        }
        break;
    }
    phase_ = Phase::Queued;
    if (route_ != Route::OneCCL && ++chunk_ < chunks(p)) {
      continue; // the next chunk of this Prim
    }
    chunk_ = 0;
    ++next_;
    phase_ = Phase::Queued;
  }
  leave_fifo();
  return true;
}

std::unique_ptr<Pending> Shm::start_collective(const char* op, std::vector<Prim> prims) {
  return std::make_unique<ShmPending>(*this, op, std::move(prims));
}

} // namespace oneccl_bind_pt

#include "shm_internal.hpp"

#include "errors.hpp"
#include "kernels.hpp"
#include "reduce_ops.hpp"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <sstream>

namespace oneccl_bind_pt {

namespace {

size_t element_bytes(const Prim& p) {
  return p.red ? c10::elementSize(kernel_dtype(p.red->scalar_type)) : 1;
}

} // namespace

// ---- collectives ----------------------------------------------------------------

class ShmPending final : public Pending {
 public:
  ShmPending(Shm& shm, const char* op, std::vector<Prim> prims)
      : shm_(shm), op_(op), prims_(std::move(prims)) {
    shm_.fifo_.push_back(this);
  }
  ~ShmPending() override { leave_fifo(); }

  bool poll() override;
  bool buffers_in_use_after_abort() const override { return ccl_ != nullptr; }

 private:
  enum class Phase { Queued, Staged, Reduced, OneCCL };

  size_t capacity(const Prim& p) const; // units per step
  size_t total(const Prim& p) const;    // units to move
  size_t chunks(const Prim& p) const;   // steps
  std::pair<size_t, size_t> slice(size_t w, int q) const; // rank q's part of a w-unit window
  void learn_pairs(const Prim& p); // alltoallv: the largest pair, from every rank's counts
  void stage(const Prim& p);
  bool met(); // every peer staged this step
  void check_signatures(const Prim& p);
  // Runs the step from the staged buffers; false if a second meeting is pending.
  bool move(const Prim& p);
  bool finish_two_meetings(const Prim& p);
  void check_liveness();
  void leave_fifo();
  std::string describe(int q) const;

  Shm& shm_;
  const char* op_;
  std::vector<Prim> prims_;
  size_t next_ = 0;   // Prim
  size_t chunk_ = 0;  // step within it
  bool use_shm_ = false; // decided at a Prim's first step
  size_t largest_pair_ = 0;
  Phase phase_ = Phase::Queued;
  uint64_t step_ = 0;
  Clock::time_point waiting_since_{};
  Clock::time_point next_check_{};
  std::unique_ptr<Pending> ccl_;
};

// Steps of a Prim: large ones go through the staging buffer in chunks.
// Units are elements for reductions, bytes otherwise; every rank computes
// the same chunks from values the signatures check.
size_t ShmPending::capacity(const Prim& p) const {
  const size_t buffer = shm_.layout_->buffer_bytes;
  const size_t unit = element_bytes(p);
  // reduce_scatter stages every rank's share, alltoallv a window per peer.
  const bool per_rank = p.kind == Prim::Kind::ReduceScatter || p.kind == Prim::Kind::Alltoallv;
  return per_rank ? buffer / (unit * shm_.size_) / 64 * 64 : buffer / unit;
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

void ShmPending::stage(const Prim& p) {
  step_ = ++shm_.next_step_;
  const int me = shm_.rank_;
  const int n = shm_.size_;
  const size_t unit = element_bytes(p);
  const size_t lo = chunk_ * capacity(p);
  const size_t hi = std::min(total(p), lo + capacity(p));
  auto* s = shm_.sig(me, step_);
  char* buf = shm_.buffer(me, step_);
  uint64_t* counts = shm_.counts(me, step_);
  bool fits = true;
  if (chunk_ == 0) {
    // Whether this rank can take the shared-memory path: the op is within
    // the measured crossover (and alltoallv, which is not chunked, fits the buffer).
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
    const bool kernel_ok = !p.red || reduce_kernel(p.red->scalar_type, p.red->kind) != nullptr;
    fits = fits && kernel_ok && shm_.limits_.route(p.kind, bytes) == Route::Shm;
  }
  if (fits) {
    const char* src = static_cast<const char*>(p.src);
    switch (p.kind) {
      case Prim::Kind::Allreduce:
      case Prim::Kind::Reduce:
        std::memcpy(buf, src + lo * unit, (hi - lo) * unit);
        break;
      case Prim::Kind::ReduceScatter:
        for (int q = 0; q < n; ++q) {
          std::memcpy(buf + q * (hi - lo) * unit, src + (q * p.count + lo) * unit, (hi - lo) * unit);
        }
        break;
      case Prim::Kind::Broadcast:
        if (p.peer == me) {
          std::memcpy(buf, src + lo, hi - lo);
        }
        break;
      case Prim::Kind::Allgatherv:
        if (p.count > lo) {
          std::memcpy(buf, src + lo, std::min(p.count, hi) - lo);
        }
        break;
      case Prim::Kind::Alltoallv: {
        // Window [lo, lo + capacity) of what goes to each peer, at slot q.
        const size_t cap = capacity(p);
        const size_t from = chunk_ * cap;
        size_t offset = 0;
        for (int q = 0; q < n; ++q) {
          if (p.send_counts[q] > from) {
            std::memcpy(buf + q * cap, src + offset + from, std::min(cap, p.send_counts[q] - from));
          }
          offset += p.send_counts[q];
        }
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
  s->fits = fits ? 1 : 0;
  s->root = p.peer;
  s->count = p.count;
  s->staged = 0;
  store_release(shm_.arrived(me), step_);
  waiting_since_ = Clock::now();
  next_check_ = waiting_since_ + kLivenessAfter;
}

bool ShmPending::met() {
  for (int q = 0; q < shm_.size_; ++q) {
    if (load_acquire(shm_.arrived(q)) < step_) {
      check_liveness();
      return false;
    }
  }
  return true;
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
  msg << ". Nothing was exchanged; the process group remains usable.";
  throw CollectiveMismatch({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, msg.str());
}

bool ShmPending::move(const Prim& p) {
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
        reduce_kernel(p.red->scalar_type, p.red->kind)(dst + lo * unit, in, n, w);
        return true;
      }
      // Reduce our slice in place in our own buffer (peers only read other
      // slices of it now), publish it, then gather every slice.
      const auto [slo, shi] = slice(w, me);
      const void* slice_in[kMaxRanks];
      for (int q = 0; q < n; ++q) {
        slice_in[q] = static_cast<const char*>(in[q]) + slo * unit;
      }
      reduce_kernel(p.red->scalar_type, p.red->kind)(shm_.buffer(me, step_) + slo * unit, slice_in, n, shi - slo);
      store_release(shm_.reduced(me), step_);
      phase_ = Phase::Reduced;
      return finish_two_meetings(p);
    }
    case Prim::Kind::Reduce:
      if (p.peer == me) {
        reduce_kernel(p.red->scalar_type, p.red->kind)(dst + lo * unit, in, n, w);
      }
      return true;
    case Prim::Kind::ReduceScatter: {
      const void* share_in[kMaxRanks];
      for (int q = 0; q < n; ++q) {
        share_in[q] = static_cast<const char*>(in[q]) + me * w * unit;
      }
      reduce_kernel(p.red->scalar_type, p.red->kind)(dst + lo * unit, share_in, n, w);
      return true;
    }
    case Prim::Kind::Broadcast:
      if (p.peer != me && w > 0) {
        std::memcpy(dst + lo, in[p.peer], w);
      }
      return true;
    case Prim::Kind::Allgatherv: {
      size_t offset = 0;
      for (int q = 0; q < n; ++q) {
        const size_t theirs = p.recv_counts[q];
        char* to = p.dst_list.empty() ? dst + offset : static_cast<char*>(p.dst_list[q]);
        if (theirs > lo) {
          std::memcpy(to + lo, in[q], std::min(theirs, hi) - lo);
        }
        offset += theirs;
      }
      return true;
    }
    case Prim::Kind::Alltoallv: {
      const size_t cap = capacity(p);
      const size_t from = chunk_ * cap;
      size_t offset = 0;
      for (int q = 0; q < n; ++q) {
        if (p.recv_counts[q] > from) {
          std::memcpy(dst + offset + from, static_cast<const char*>(in[q]) + me * cap,
                      std::min(cap, p.recv_counts[q] - from));
        }
        offset += p.recv_counts[q];
      }
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
  for (int q = 0; q < n; ++q) {
    if (load_acquire(shm_.reduced(q)) < step_) {
      check_liveness();
      return false;
    }
  }
  const size_t unit = element_bytes(p);
  const size_t lo = chunk_ * capacity(p);
  const size_t w = std::min(total(p), lo + capacity(p)) - lo;
  char* dst = static_cast<char*>(p.dst) + lo * unit;
  for (int q = 0; q < n; ++q) {
    const auto [slo, shi] = slice(w, q);
    if (shi > slo) {
      std::memcpy(dst + slo * unit, shm_.buffer(q, step_) + slo * unit, (shi - slo) * unit);
    }
  }
  return true;
}

void ShmPending::leave_fifo() {
  auto& fifo = shm_.fifo_;
  fifo.erase(std::remove(fifo.begin(), fifo.end(), this), fifo.end());
}

bool ShmPending::poll() {
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
          use_shm_ = true;
          for (int q = 0; q < shm_.size_; ++q) {
            use_shm_ = use_shm_ && shm_.sig(q, step_)->fits;
          }
        }
        if (use_shm_) {
          if (!move(p)) {
            return false; // phase_ is Reduced: waiting for peers' slices
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
        if (!finish_two_meetings(p)) {
          return false;
        }
        break;
    }
    phase_ = Phase::Queued;
    if (use_shm_ && ++chunk_ < chunks(p)) {
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

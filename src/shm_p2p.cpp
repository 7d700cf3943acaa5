#include "shm_internal.hpp"

#include "errors.hpp"
#include "kernels.hpp"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>

namespace oneccl_bind_pt {

// ---- send / recv ----------------------------------------------------------------


class ShmSend final : public Pending {
 public:
  ShmSend(Shm& shm, const Prim& p)
      : shm_(shm),
        peer_(p.peer),
        tag_(p.tag),
        src_(static_cast<const char*>(p.src)),
        bytes_(p.count),
        single_copy_(shm.limits_.route(Prim::Kind::Send, p.count, shm.single_copy_) == Route::Cma) {
    shm_.sends_[peer_].push_back(this);
  }
  ~ShmSend() override {
    auto& q = shm_.sends_[peer_];
    q.erase(std::remove(q.begin(), q.end(), this), q.end());
  }
  bool poll() override {
    shm_.progress_p2p();
    if (!done_ && read_by_ > 0 && load_acquire(shm_.ring_tail(peer_, shm_.rank_)) >= read_by_) {
      done_ = true; // the receiver moved past our slot: it has read our tensor
    }
    if (!done_ && Clock::now() > next_check_) {
      next_check_ = Clock::now() + std::chrono::milliseconds(100);
      shm_.check_peer_alive(peer_, "send");
    }
    return done_;
  }
  bool moved() override { return watch_.moved(shm_.moves_); }
  bool buffers_in_use_after_abort() const override { return false; }

 private:
  friend class Shm;
  Shm& shm_;
  int peer_;
  int tag_;
  const char* src_;
  size_t bytes_;
  const bool single_copy_; // the receiver reads src_ itself
  size_t sent_ = 0;
  uint64_t msg_ = 0;
  uint64_t read_by_ = 0; // single copy: done once the receiver's tail reaches this
  bool done_ = false;
  Clock::time_point next_check_ = Clock::now() + kLivenessAfter;
  MoveWatch watch_;
};

class ShmRecv final : public Pending {
 public:
  ShmRecv(Shm& shm, const Prim& p) : shm_(shm), peer_(p.peer), tag_(p.tag), dst_(static_cast<char*>(p.dst)), bytes_(p.count) {}
  ~ShmRecv() override {
    shm_.posted_.remove(this);
    if (in_) {
      in_->recv = nullptr; // still streaming: the rest is read and dropped
    }
  }
  bool poll() override {
    if (!done_) {
      shm_.progress_p2p();
    }
    if (!done_ && peer_ >= 0 && Clock::now() > next_check_) {
      next_check_ = Clock::now() + std::chrono::milliseconds(100);
      shm_.check_peer_alive(peer_, "recv");
    }
    if (done_ && !error_.empty()) {
      if (peer_failed_) {
        C10_THROW_ERROR(DistBackendError, error_);
      }
      throw CollectiveMismatch({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, error_);
    }
    return done_;
  }
  int source_rank() const override { return source_; }
  bool moved() override { return watch_.moved(shm_.moves_); }
  bool buffers_in_use_after_abort() const override { return false; }

  bool matches(int source, int tag) const { return (peer_ < 0 || peer_ == source) && tag_ == tag; }

  // Takes a message: checks its size, then it is copied in as it streams.
  void bind(Shm::Incoming& in) {
    in_ = &in;
    in.recv = this;
    source_ = in.source;
    if (in.total != bytes_) {
      error_ = "ccl recv: the message from rank " + std::to_string(in.source) + " (tag " +
          std::to_string(in.tag) + ") has " + std::to_string(in.total) + " bytes but the receive tensor holds " +
          std::to_string(bytes_) + "; the message was consumed and dropped";
    }
  }
  void write(uint64_t offset, const char* data, uint64_t n) {
    if (error_.empty() && n > 0) {
      copy_bytes(dst_ + offset, data, n);
    }
  }
  // Where a single-copy message goes: our tensor, unless its size was refused.
  char* destination() const { return error_.empty() ? dst_ : nullptr; }
  // Reading the sender's tensor failed (it died, or freed it after an abort).
  void fail(const std::string& why) {
    error_ = why;
    peer_failed_ = true;
  }
  void finish() {
    in_ = nullptr;
    done_ = true;
  }

 private:
  Shm& shm_;
  int peer_;
  int tag_;
  char* dst_;
  size_t bytes_;
  int source_ = -1;
  bool done_ = false;
  std::string error_;
  bool peer_failed_ = false; // error_ is a DistBackendError, not a mismatch
  Shm::Incoming* in_ = nullptr;
  Clock::time_point next_check_ = Clock::now() + kLivenessAfter;
  MoveWatch watch_;
};



// With helper threads a run of half the ring (256 KiB, where copies start to split) moves
// as one split copy and is published at once, while the other side drains or fills the
// other half; a shorter run (a message's tail, a ring less free) and every run without
// helpers go a slot at a time, so that sender and receiver still overlap.
static size_t slots_per_run() {
  return copies_split() ? kSlots / 2 : 1;
}

void Shm::pump_sends(int dst) {
  auto& queue = sends_[dst];
  uint64_t* head = ring_head(rank_, dst);
  const uint64_t* tail = ring_tail(dst, rank_);
  const size_t run = slots_per_run();
  while (!queue.empty()) {
    ShmSend* s = queue.front();
    if (s->msg_ == 0) {
      s->msg_ = ++next_msg_[dst];
    }
    while (true) {
      const uint64_t h = *head; // only we write it
      const uint64_t free = kSlots - (h - load_acquire(tail));
      if (free == 0) {
        return; // ring full: the receiver has not caught up
      }
      // Single copy: one slot with the tensor's address, and the send is done once
      // the receiver has moved past that slot. Else the bytes, a slot each.
      const size_t left = s->single_copy_ ? 1 : (s->bytes_ - s->sent_ + kSlotBytes - 1) / kSlotBytes;
      const uint64_t slots = free >= run && left >= run ? run : 1; // a short run: slot by slot
      CopyRange copies[kSlots];
      size_t k = 0;
      uint64_t at = h;
      bool last = false;
      do {
        const size_t n = s->single_copy_ ? 0 : std::min(kSlotBytes, s->bytes_ - s->sent_);
        SlotHeader* hdr = slot(rank_, dst, at++);
        hdr->msg = s->msg_;
        hdr->tag = s->tag_;
        hdr->total = s->bytes_;
        hdr->offset = s->sent_;
        hdr->bytes = n;
        hdr->addr = s->single_copy_ ? reinterpret_cast<uint64_t>(s->src_) : 0;
        last = s->single_copy_ || s->sent_ + n == s->bytes_;
        hdr->last = last ? 1 : 0;
        if (n > 0) {
          copies[k++] = {reinterpret_cast<char*>(hdr) + kLine, s->src_ + s->sent_, n};
        }
        s->sent_ += n;
      } while (!last && at - h < slots);
      copy_ranges(copies, k);
      store_release(head, at);
      ++moves_;
      if (last) {
        if (s->single_copy_) {
          s->read_by_ = at;
        } else {
          s->done_ = true;
        }
        queue.pop_front();
        break;
      }
    }
  }
}

void Shm::pump_incoming(int src) {
  const uint64_t* head = ring_head(src, rank_);
  uint64_t* tail = ring_tail(rank_, src);
  const size_t run = slots_per_run();
  while (true) {
    const uint64_t t = *tail; // only we write it
    const uint64_t ready = load_acquire(head) - t;
    if (ready == 0) {
      return;
    }
    const SlotHeader* hdr = slot(src, rank_, t);
    if (hdr->offset == 0) {
      // A new message: the earliest posted recv that matches takes it.
      auto in = std::make_unique<Incoming>(Incoming{src, hdr->tag, hdr->total});
      for (ShmRecv* r : posted_) {
        if (r->matches(src, hdr->tag)) {
          posted_.remove(r);
          r->bind(*in);
          break;
        }
      }
      if (!in->recv) {
        in->held.resize(hdr->total);
        unexpected_.push_back(std::move(in));
        current_in_[src] = nullptr;
      } else {
        current_in_[src] = std::move(in);
      }
    }
    // The message mid-stream from src: a bound one, or the last unexpected one.
    Incoming* in = current_in_[src].get();
    if (!in) {
      for (auto it = unexpected_.rbegin(); it != unexpected_.rend(); ++it) {
        if ((*it)->source == src && !(*it)->complete) {
          in = it->get();
          break;
        }
      }
    }
    // This slot and those after it of the same message (a sender streams one message
    // to a peer at a time, so they follow each other until the last).
    uint64_t n = 1;
    if (in && hdr->addr != 0) {
      read_message(*in, hdr->addr); // single copy: the whole message, from the sender's tensor
    } else {
      while (n < std::min<uint64_t>(ready, run) && !slot(src, rank_, t + n - 1)->last) {
        ++n;
      }
      n = n == run ? n : 1; // a short run: slot by slot (slots_per_run)
      // Into the recv's tensor (unless its size was refused), or held until a recv comes.
      char* to = !in ? nullptr : in->recv ? in->recv->destination() : in->held.empty() ? nullptr : in->held.data();
      CopyRange copies[kSlots];
      size_t k = 0;
      for (uint64_t i = 0; i < n; ++i) {
        const SlotHeader* h = slot(src, rank_, t + i);
        if (to && h->bytes > 0) {
          copies[k++] = {to + h->offset, reinterpret_cast<const char*>(h) + kLine, h->bytes};
        }
        if (in) {
          in->received += h->bytes;
        }
      }
      copy_ranges(copies, k);
    }
    const bool last = slot(src, rank_, t + n - 1)->last != 0;
    store_release(tail, t + n);
    ++moves_;
    if (last && in) {
      in->complete = true;
      if (in->recv) {
        in->recv->finish();
      }
      if (current_in_[src].get() == in) {
        current_in_[src].reset();
      } else if (in->recv) {
        // An unexpected message a recv claimed while it streamed: the recv
        // has read the chunks as they came; drop the entry.
        unexpected_.remove_if([in](const std::unique_ptr<Incoming>& u) { return u.get() == in; });
      }
    }
  }
}

void Shm::read_message(Incoming& in, uint64_t addr) {
  char* to = in.recv ? in.recv->destination() : in.held.data();
  if (to) {
    try {
      read_peer(in.source, to, addr, in.total, "recv");
    } catch (const c10::DistBackendError& e) {
      in.error = e.what_without_backtrace();
      if (in.recv) {
        in.recv->fail(in.error);
      }
    }
  }
  in.received = in.total;
}

void Shm::progress_p2p() {
  for (int q = 0; q < size_; ++q) {
    if (q == rank_) {
      continue;
    }
    if (!sends_[q].empty()) {
      pump_sends(q);
    }
    pump_incoming(q);
  }
}

// One send or recv; a recv first takes a message that came before it, from a
// matching source and tag, in arrival order.
std::unique_ptr<Pending> Shm::start_p2p(const Prim& p) {
  if (p.kind == Prim::Kind::Send) {
    return std::make_unique<ShmSend>(*this, p);
  }
  auto recv = std::make_unique<ShmRecv>(*this, p);
  for (auto it = unexpected_.begin(); it != unexpected_.end(); ++it) {
    Incoming& in = **it;
    if (in.recv || !recv->matches(in.source, in.tag)) {
      continue;
    }
    recv->bind(in);
    if (in.complete) {
      if (!in.error.empty()) {
        recv->fail(in.error);
      }
      recv->write(0, in.held.data(), in.held.size());
      recv->finish();
      unexpected_.erase(it);
    } else {
      // Still streaming: copy what has come; pump_incoming writes the rest.
      recv->write(0, in.held.data(), in.received);
    }
    return recv;
  }
  posted_.push_back(recv.get());
  return recv;
}

} // namespace oneccl_bind_pt

// The collective steps of the shared-memory transport (see shm.hpp for the protocol).
#pragma once

#include "shm_internal.hpp"

#include "kernels.hpp"
#include "reduce_ops.hpp"

#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace oneccl_bind_pt {

static_assert(kMaxRanks <= kMaxReduceInputs, "a reduction takes one input per rank");

// Bytes per unit a collective step counts in: elements of reductions, else bytes.
inline size_t element_bytes(const Prim& p) {
  return p.red ? c10::elementSize(kernel_dtype(p.red->scalar_type)) : 1;
}

// One collective op on the shared-memory transport: its Prims, step by step, in the
// group's FIFO. shm_collectives.cpp stages, meets and moves through the staging
// buffers; shm_single_copy.cpp moves by reading the peers' tensors (Route::Cma).
class ShmPending final : public Pending {
 public:
  ShmPending(Shm& shm, const char* op, std::vector<Prim> prims)
      : shm_(shm), op_(op), prims_(std::move(prims)) {
    shm_.fifo_.push_back(this);
  }
  ~ShmPending() override { leave_fifo(); }

  bool poll() override;
  // Through oneCCL (a step above the limits): cannot tell, so true.
  bool moved() override { return ccl_ != nullptr || watch_.moved(shm_.moves_); }
  bool buffers_in_use_after_abort() const override { return ccl_ != nullptr; }

 private:
  // Reduced: waiting for peers' reduced slices. Draining (single copy): waiting until
  // no peer reads this rank's tensors any more, which the caller may then reuse.
  enum class Phase { Queued, Staged, Reduced, Draining, OneCCL };

  size_t capacity(const Prim& p) const; // units per step
  size_t total(const Prim& p) const;    // units to move
  size_t chunks(const Prim& p) const;   // steps
  std::pair<size_t, size_t> slice(size_t w, int q) const; // rank q's part of a w-unit window
  void learn_pairs(const Prim& p); // alltoallv: the largest pair, from every rank's counts
  // Alltoallv: where this rank's part for itself starts in its input and in its output.
  // It goes straight from one to the other (not through the staging buffer) unless the
  // two overlap without being the same bytes.
  struct OwnPart {
    size_t from = 0, to = 0;
    bool direct = false;
  };
  OwnPart own_part(const Prim& p) const;
  void stage(const Prim& p);
  bool met(); // every peer staged this step
  void check_signatures(const Prim& p);
  // Runs the step from the staged buffers; false if a second meeting is pending.
  bool move(const Prim& p);
  // The same from the peers' tensors (Route::Cma).
  bool move_single_copy(const Prim& p);
  bool finish_two_meetings(const Prim& p);
  bool drained(); // every peer is done reading this rank's tensors
  // Every rank's `counter` has reached this step (else checks the peers are alive).
  bool all_reached(uint64_t* (Shm::*counter)(int) const);
  // After a step's moves: true when the step is over; single copy first waits (Draining).
  bool end_step();
  void check_liveness();
  void leave_fifo();
  bool advance(); // poll()'s work; poll() counts its moves
  std::string describe(int q) const;

  Shm& shm_;
  const char* op_;
  std::vector<Prim> prims_;
  size_t next_ = 0;   // Prim
  size_t chunk_ = 0;  // step within it
  Route route_ = Route::Shm; // decided at a Prim's first step, alike on every rank
  size_t largest_pair_ = 0;
  Phase phase_ = Phase::Queued;
  uint64_t step_ = 0;
  Clock::time_point waiting_since_{};
  Clock::time_point next_check_{};
  std::unique_ptr<Pending> ccl_;
  MoveWatch watch_;
};

} // namespace oneccl_bind_pt

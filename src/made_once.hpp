// Process-wide state made at first use: the progress thread's, the callback runners', the
// helper pool, the counts the exit waits on. Each lives in an atomic slot that a child forked
// after its making clears (module.cpp registers the handler), so the child makes its own: it
// has none of the parent's threads, and one of them may have held the old object's lock at
// the fork. The parent's object is left in the child, never freed.
#pragma once

#include <atomic>

namespace oneccl_bind_pt {

// Forks between the process that loaded the module and this one: 0 there, counted up in each
// child by the same handler. An object that records it at its making can tell whether it is
// a forked child's copy (Communicator::inherited).
inline std::atomic<unsigned> g_forks{0};

// The object in `slot`, made by `make()` (a new T) at first use and never freed: threads
// and in-flight work may outlive every static destructor.
template <class T, class Make>
T& made_once(std::atomic<T*>& slot, Make make) {
  T* made = slot.load(std::memory_order_acquire);
  if (!made) {
    T* fresh = make();
    if (slot.compare_exchange_strong(made, fresh, std::memory_order_acq_rel)) {
      made = fresh;
    } else {
      delete fresh; // another thread's came first
    }
  }
  return *made;
}

} // namespace oneccl_bind_pt

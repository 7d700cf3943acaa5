// Store rendezvous: the only code that talks to the c10d Store.
//
// Rank 0 creates oneCCL's main key-value store (KVS) and publishes its
// address; the other ranks read it and attach. The Store handed to a backend
// is already prefixed per process group, so every group has its own keys.
#pragma once

#include <oneapi/ccl.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace oneccl_bind_pt {

// Returns this rank's handle on the group's KVS once every rank of the group
// has arrived; throws DistBackendError naming the missing ranks on timeout.
// `whoami` is what this rank announces itself as (announced() reads it back).
std::shared_ptr<ccl::kvs> rendezvous(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    std::chrono::milliseconds timeout,
    const std::string& whoami);

// What rank `rank` announced at rendezvous; throws if the store does not answer.
std::string announced(c10d::Store& store, int rank);

// Every rank contributes `mine` under `key`; returns all ranks' values, by
// rank. Throws DistBackendError naming the missing ranks on timeout.
std::vector<std::string> exchange(
    const c10::intrusive_ptr<c10d::Store>& store,
    const std::string& key,
    const std::string& mine,
    int rank,
    int size,
    std::chrono::milliseconds timeout);

} // namespace oneccl_bind_pt

#include "shm_internal.hpp"

#include "errors.hpp"
#include "rendezvous.hpp"

#include <c10/util/Exception.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

namespace oneccl_bind_pt {

namespace {

std::string read_first_line(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

std::string link_target(const char* path) {
  char buf[256];
  const ssize_t n = readlink(path, buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

} // namespace

std::string host_identity() {
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  return read_first_line("/proc/sys/kernel/random/boot_id") + "|" + link_target("/proc/self/ns/pid") +
      "|" + link_target("/proc/self/ns/net") + "|" + host;
}

char process_state(int pid) {
  if (kill(pid, 0) != 0 && errno == ESRCH) {
    return 'X';
  }
  const std::string stat = read_first_line(("/proc/" + std::to_string(pid) + "/stat").c_str());
  const auto close = stat.rfind(')');
  if (close == std::string::npos || close + 2 >= stat.size()) {
    return '?';
  }
  // After the state: ppid pgrp session tty_nr tpgid flags. A SIGKILLed process
  // with a large address space (a CUDA build of torch) can take hundreds of ms
  // to unmap it, with its sockets already closed; it is PF_EXITING from the
  // start, which counts as dead (else its peers saw the failure, looked, found
  // it running and left its segments in /dev/shm).
  std::istringstream fields(stat.substr(close + 2));
  char state = '?';
  long long skip = 0;
  unsigned long long flags = 0;
  fields >> state >> skip >> skip >> skip >> skip >> skip >> flags;
  constexpr unsigned long long kPfExiting = 0x4;
  return fields && (flags & kPfExiting) ? 'X' : state;
}

bool process_gone(int pid) {
  const char state = process_state(pid);
  return state == 'X' || state == 'Z';
}

const char* Shm::path(Prim::Kind kind, size_t bytes) const {
  return route_name(limits_.route(kind, bytes, single_copy_));
}

// ---- setup ------------------------------------------------------------------------

Shm::Shm(int rank, int size, Transport* fallback)
    : rank_(rank),
      size_(size),
      fallback_(fallback),
      limits_(ShmLimits::from_env()),
      layout_(std::make_unique<Layout>(size, kBufferBytes)),
      bases_(size, nullptr),
      pids_(size, 0),
      sends_(size),
      next_msg_(size, 0),
      current_in_(size) {
  chunk_bytes_ = limits_.chunk_bytes;
  chunk_from_ = rank;
  window_bytes_ = limits_.window_bytes;
}

std::string Shm::chunk_status() const {
  const std::string mine = std::to_string(limits_.chunk_bytes >> 10) + " KiB: " + limits_.chunk_why;
  if (chunk_from_ == rank_ || chunk_bytes_ == limits_.chunk_bytes) {
    return mine;
  }
  return std::to_string(chunk_bytes_ >> 10) + " KiB, rank " + std::to_string(chunk_from_) +
      "'s (the smallest of the group's; this rank's: " + mine + ")";
}

std::string Shm::window_status() const {
  return std::to_string(window_bytes_ >> 10) + " KiB" +
      (window_bytes_ == limits_.window_bytes ? ": " + limits_.window_why
                                             : " (the smallest of the group's; this rank's: " +
               std::to_string(limits_.window_bytes >> 10) + " KiB, " + limits_.window_why + ")");
}

Shm::~Shm() {
  for (char* base : bases_) {
    if (base) {
      munmap(base, layout_->total);
    }
  }
}

std::unique_ptr<Shm> Shm::connect(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    std::chrono::milliseconds timeout,
    Transport* fallback) {
  if (size < 2 || size > kMaxRanks) {
    return nullptr;
  }
  // 1. Same host, and shared memory on? Every rank sees every identity, so all decide
  // alike. A rank with ONECCL_BIND_PT_SHM=0 joins too, so that the setting on some ranks
  // only sends the whole group to oneCCL instead of leaving the others waiting here.
  const bool on = shm_enabled();
  const auto hosts = exchange(store, "oneccl/shm/host", on ? host_identity() : "off", rank, size, timeout);
  if (!on) {
    return nullptr;
  }
  if (const auto off = std::find(hosts.begin(), hosts.end(), "off"); off != hosts.end()) {
    TORCH_WARN_ONCE("ccl: rank ", off - hosts.begin(), " has ONECCL_BIND_PT_SHM=0 and this rank has not: "
                    "this process group's collectives run through oneCCL on all its ranks");
    return nullptr;
  }
  if (std::any_of(hosts.begin(), hosts.end(), [&](const std::string& h) { return h != hosts[0]; })) {
    return nullptr;
  }
  std::unique_ptr<Shm> shm(new Shm(rank, size, fallback));
  const size_t total = shm->layout_->total;

  // 2. Our segment: anonymous, owner-only, sized up front (pages appear on first touch).
  std::string mine = "fail";
  // Closed however this returns: an exchange that times out throws past step 5.
  struct OwnFd {
    int fd;
    ~OwnFd() {
      if (fd >= 0) {
        close(fd);
      }
    }
  } own{memfd_create("oneccl_bind_pt", MFD_CLOEXEC)};
  const int fd = own.fd;
  if (fd >= 0 && fchmod(fd, 0600) == 0 && ftruncate(fd, static_cast<off_t>(total)) == 0) {
    void* base = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base != MAP_FAILED) {
      shm->bases_[rank] = static_cast<char*>(base);
      auto* h = reinterpret_cast<Header*>(base);
      h->rank = rank;
      h->size = size;
      h->pid = getpid();
      h->total = total;
      h->self = reinterpret_cast<uint64_t>(base);
      h->chunk = shm->limits_.chunk_bytes;
      h->window = shm->limits_.window_bytes;
      store_release(&h->magic, kMagic);
      mine = std::to_string(getpid()) + ":" + std::to_string(fd);
    }
  }
  const auto where = exchange(store, "oneccl/shm/segment", mine, rank, size, timeout);

  // 3. Map every peer's segment through its owner's fd.
  std::string problem;
  for (int q = 0; q < size && problem.empty(); ++q) {
    if (where[q] == "fail") {
      problem = "rank " + std::to_string(q) + " could not create its segment";
      break;
    }
    const auto colon = where[q].find(':');
    shm->pids_[q] = std::stoi(where[q].substr(0, colon));
    if (q == rank) {
      continue;
    }
    const std::string path = "/proc/" + where[q].substr(0, colon) + "/fd/" + where[q].substr(colon + 1);
    const int peer_fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
    struct stat st {};
    if (peer_fd < 0 || fstat(peer_fd, &st) != 0 || st.st_uid != geteuid() ||
        static_cast<size_t>(st.st_size) != total) {
      problem = "cannot open rank " + std::to_string(q) + "'s segment (" + path + "): " +
          (peer_fd < 0 ? std::strerror(errno) : "owner or size differ");
    } else {
      void* base = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, peer_fd, 0);
      if (base == MAP_FAILED) {
        problem = std::string("mmap of rank ") + std::to_string(q) + "'s segment failed: " + std::strerror(errno);
      } else {
        shm->bases_[q] = static_cast<char*>(base);
        auto* h = reinterpret_cast<Header*>(base);
        if (load_acquire(&h->magic) != kMagic || h->rank != q || h->size != size ||
            h->chunk < kMinStagingChunk || h->chunk > kBufferBytes || h->window < kMinStagingChunk ||
            h->window > kBufferBytes) {
          problem = "rank " + std::to_string(q) + "'s segment is not what it published";
        } else {
          // Every rank must cut a Prim into the same chunks: the smallest choice wins.
          if (h->chunk < shm->chunk_bytes_) {
            shm->chunk_bytes_ = h->chunk;
            shm->chunk_from_ = q;
          }
          shm->window_bytes_ = std::min<size_t>(shm->window_bytes_, h->window);
        }
      }
    }
    if (peer_fd >= 0) {
      close(peer_fd);
    }
  }
  // 4. Single copy: can this rank read each peer's memory (ptrace rights: same user,
  // and Yama's ptrace_scope or a container's seccomp may forbid it)? Read each peer's
  // segment header where the peer mapped it, and compare with what we mapped.
  std::string reads = single_copy_enabled() ? "yes" : "off: ONECCL_BIND_PT_SHM_SINGLE_COPY=0";
  for (int q = 0; q < size && problem.empty() && reads == "yes"; ++q) {
    if (q == rank) {
      continue;
    }
    const auto* h = reinterpret_cast<const Header*>(shm->bases_[q]);
    Header got{};
    struct iovec local {&got, sizeof got};
    struct iovec remote {reinterpret_cast<void*>(h->self), sizeof got};
    const ssize_t n = process_vm_readv(shm->pids_[q], &local, 1, &remote, 1, 0);
    if (n != static_cast<ssize_t>(sizeof got) || got.magic != kMagic || got.rank != q) {
      reads = std::string("off: rank ") + std::to_string(rank) + " may not read rank " + std::to_string(q) +
          "'s memory (process_vm_readv: " + (n < 0 ? std::strerror(errno) : "read other bytes") +
          "; Yama's kernel.yama.ptrace_scope above 0, or a container without ptrace rights)";
    }
  }
  // 5. Everyone has mapped everyone (or someone could not): only now may
  // owners close their fd; the mappings keep the memory.
  const auto results = exchange(
      store, "oneccl/shm/mapped", problem.empty() ? "ok " + reads : problem, rank, size, timeout);
  if (fd >= 0) {
    close(fd);
    own.fd = -1;
  }
  shm->single_copy_ = true;
  shm->single_copy_status_ = "on";
  for (int q = 0; q < size; ++q) {
    if (results[q].rfind("ok ", 0) == 0 && results[q] != "ok yes" && shm->single_copy_) {
      // Every rank learns the first refusal: all take the same path.
      shm->single_copy_ = false;
      shm->single_copy_status_ = results[q].substr(3);
    }
  }
  for (int q = 0; q < size; ++q) {
    if (results[q].rfind("ok ", 0) != 0) {
      TORCH_WARN_ONCE(
          "ccl: no shared memory between the ranks of a process group on this host (rank ", q, ": ",
          results[q], "); its collectives run through oneCCL");
      return nullptr;
    }
  }
  return shm;
}

// ---- peers ----------------------------------------------------------------------

bool Shm::any_peer_gone() const {
  for (int q = 0; q < size_; ++q) {
    if (q != rank_ && process_gone(pids_[q])) {
      return true;
    }
  }
  return false;
}

int Shm::running_peer_pid(int peer) const {
  const char state = process_state(pids_[peer]);
  return state == 'X' || state == 'Z' || state == 'T' || state == 't' ? 0 : pids_[peer];
}

void Shm::check_peer_alive(int peer, const char* op) {
  if (peer >= 0 && peer != rank_ && process_gone(pids_[peer])) {
    C10_THROW_ERROR(
        DistBackendError,
        std::string("ccl ") + op + " (rank " + std::to_string(rank_) + " of " + std::to_string(size_) +
            "): rank " + std::to_string(peer) + " (pid " + std::to_string(pids_[peer]) +
            ") exited while this rank waited for it. The process group can no longer be used.");
  }
}

void Shm::read_peer(int q, void* to, uint64_t from, size_t bytes, const char* op) const {
  // One call moves at most ~2 GiB (the kernel's limit on one transfer).
  constexpr size_t kPiece = size_t{1} << 30;
  size_t done_bytes = 0;
  while (done_bytes < bytes) {
    const size_t piece = std::min(kPiece, bytes - done_bytes);
    struct iovec local {static_cast<char*>(to) + done_bytes, piece};
    struct iovec remote {reinterpret_cast<void*>(from + done_bytes), piece};
    const ssize_t n = process_vm_readv(pids_[q], &local, 1, &remote, 1, 0);
    if (n != static_cast<ssize_t>(piece)) {
      const int err = errno;
      const std::string who = std::string("ccl ") + op + " (rank " + std::to_string(rank_) + " of " +
          std::to_string(size_) + "): rank " + std::to_string(q) + " (pid " + std::to_string(pids_[q]) + ")";
      if (process_gone(pids_[q])) {
        C10_THROW_ERROR(DistBackendError, who + " exited while this rank read its tensor. The process group "
                        "can no longer be used.");
      }
      C10_THROW_ERROR(DistBackendError, who + ": reading its tensor directly failed after " +
                      std::to_string(done_bytes + (n > 0 ? n : 0)) + " of " + std::to_string(bytes) + " bytes (" +
                      (n < 0 ? std::strerror(err) : "short read") + ")");
    }
    done_bytes += piece;
  }
}

// ---- entry point --------------------------------------------------------------------

std::unique_ptr<Pending> Shm::start(const char* op, std::vector<Prim> prims) {
  if (prims.size() == 1 && (prims[0].kind == Prim::Kind::Send || prims[0].kind == Prim::Kind::Recv)) {
    return start_p2p(prims[0]); // shm_p2p.cpp
  }
  return start_collective(op, std::move(prims)); // shm_collectives.cpp
}

} // namespace oneccl_bind_pt

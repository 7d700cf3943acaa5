#include "shm.hpp"

#include "communicator.hpp"
#include "errors.hpp"
#include "kernels.hpp"
#include "rendezvous.hpp"

#include <c10/util/Exception.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <numeric>
#include <sstream>

namespace oneccl_bind_pt {

namespace {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kMagic = 0x31766d6873747062ull; // "bptshmv1"
constexpr size_t kLine = 64;
constexpr size_t kPage = 4096;
constexpr size_t kSlots = 8;              // message slots per (sender, receiver)
constexpr size_t kSlotBytes = 64 << 10;   // payload per slot
constexpr int kMaxRanks = 128;            // larger groups use oneCCL
// Each staging buffer (two per rank); larger messages move in chunks this size.
constexpr size_t kBufferBytes = 2 << 20;
// Allreduce up to this size: every rank folds all buffers (one meeting).
// Above: each rank reduces its slice, then everyone gathers (two meetings).
// Above it the split wins even for two ranks: each rank then reduces only its
// half, so the two cores share the arithmetic (measured: 256 KiB float32,
// 46 us split vs 74 us when both reduce everything).
constexpr size_t kOneMeetingBytes = 32 << 10;
// Waiting this long on peers, check that they are still alive.
constexpr auto kLivenessAfter = std::chrono::milliseconds(500);

uint64_t load_acquire(const uint64_t* p) {
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
void store_release(uint64_t* p, uint64_t v) {
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
}

size_t env_bytes(const char* name, size_t fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) {
    return fallback;
  }
  char* end = nullptr;
  const double x = std::strtod(v, &end);
  std::string unit = end ? std::string(end) : "";
  double scale = 1;
  if (unit == "K" || unit == "KiB" || unit == "k") {
    scale = 1024;
  } else if (unit == "M" || unit == "MiB") {
    scale = 1024.0 * 1024;
  } else if (unit == "G" || unit == "GiB") {
    scale = 1024.0 * 1024 * 1024;
  } else if (!unit.empty()) {
    TORCH_WARN("ccl: ", name, "=", v, " is not a size (e.g. 262144, 256K, 4M); using the default");
    return fallback;
  }
  return static_cast<size_t>(x * scale);
}

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

// Processes that can map each other's memory this way: same kernel boot,
// same PID namespace (to name the peer's /proc entry), and, to keep
// "hosts" in network namespaces apart, same network namespace and host name.
std::string host_identity() {
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  return read_first_line("/proc/sys/kernel/random/boot_id") + "|" + link_target("/proc/self/ns/pid") +
      "|" + link_target("/proc/self/ns/net") + "|" + host;
}

// Dead or a zombie (a killed child its launcher has not reaped yet).
bool process_gone(int pid) {
  if (kill(pid, 0) != 0 && errno == ESRCH) {
    return true;
  }
  const std::string stat = read_first_line(("/proc/" + std::to_string(pid) + "/stat").c_str());
  const auto close = stat.rfind(')');
  return close != std::string::npos && close + 2 < stat.size() && stat[close + 2] == 'Z';
}

size_t element_bytes(const Prim& p) {
  return p.red ? c10::elementSize(kernel_dtype(p.red->scalar_type)) : 1;
}

std::string human(size_t bytes) {
  return std::to_string(bytes) + " B";
}

// Spin on the cache line first; then give the core away so that ranks
// outnumbering cores keep moving (see docs/performance.md).
void relax(unsigned& spins) {
  if (++spins > 64) {
    std::this_thread::yield();
  }
}

} // namespace

// ---- layout -------------------------------------------------------------------

struct Shm::Sig {
  uint64_t step;
  char op[40];
  uint8_t kind;
  int8_t dtype;  // at::ScalarType of reductions, -1 otherwise
  int8_t redop;  // c10d RedOpType, -1 otherwise
  uint8_t fits;  // this rank staged its data: the step may run here
  int32_t root;
  uint64_t count;
  uint64_t staged;
};

struct Shm::SlotHeader {
  uint64_t msg;    // per (sender, receiver), from 1
  int32_t tag;
  uint32_t last;   // the message's final chunk
  uint64_t total;  // bytes of the whole message
  uint64_t offset; // of this chunk
  uint64_t bytes;  // in this chunk
};

struct Shm::Layout {
  size_t arrived, reduced, sigs, counts, heads, tails, rings, buffers, buffer_bytes, total;
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
};

uint64_t* Shm::arrived(int q) const {
  return reinterpret_cast<uint64_t*>(bases_[q] + layout_->arrived);
}
uint64_t* Shm::reduced(int q) const {
  return reinterpret_cast<uint64_t*>(bases_[q] + layout_->reduced);
}
Shm::Sig* Shm::sig(int q, uint64_t step) const {
  return reinterpret_cast<Sig*>(bases_[q] + layout_->sigs + (step & 1) * layout_->sig_stride());
}
uint64_t* Shm::counts(int q, uint64_t step) const {
  return reinterpret_cast<uint64_t*>(bases_[q] + layout_->counts) + (step & 1) * 2 * size_;
}
char* Shm::buffer(int q, uint64_t step) const {
  return bases_[q] + layout_->buffers + (step & 1) * layout_->buffer_bytes;
}
uint64_t* Shm::ring_head(int src, int dst) const {
  return reinterpret_cast<uint64_t*>(bases_[src] + layout_->heads + dst * kLine);
}
uint64_t* Shm::ring_tail(int dst, int src) const {
  return reinterpret_cast<uint64_t*>(bases_[dst] + layout_->tails + src * kLine);
}
Shm::SlotHeader* Shm::slot(int src, int dst, uint64_t index) const {
  const size_t i = dst * kSlots + index % kSlots;
  return reinterpret_cast<SlotHeader*>(bases_[src] + layout_->rings + i * (kLine + kSlotBytes));
}

// ---- configuration --------------------------------------------------------------

bool shm_enabled() {
  const char* v = std::getenv("ONECCL_BIND_PT_SHM");
  // Same reading as the Python side (_env.py), which decides CCL_ATL_SHM from it.
  std::string s = v ? v : "1";
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return !(s == "0" || s == "off" || s == "false");
}

ShmLimits ShmLimits::from_env() {
  // Measured crossovers (docs/performance.md). Only all-to-all has one, and only
  // against oneCCL's own shared-memory provider (CCL_ATL_SHM=1, which the user
  // chose: we set 0 on one host): above 1 MiB per rank it can be faster there
  // (2 MiB on 4 ranks: 789 us vs 1006 us here; 4 MiB on 2 ranks: 361 vs 403 us).
  // Over oneCCL's sockets (CCL_ATL_SHM=0) every kind stays faster here.
  constexpr size_t kAny = SIZE_MAX;
  const char* atl_shm = std::getenv("CCL_ATL_SHM");
  const bool ccl_has_shm = atl_shm && std::string(atl_shm) == "1";
  ShmLimits l{kAny, kAny, kAny, kAny, ccl_has_shm ? size_t{1} << 20 : kAny, kAny};
  const size_t all = env_bytes("ONECCL_BIND_PT_SHM_MAX_BYTES", 0);
  if (all > 0) {
    l = ShmLimits{all, all, all, all, all, all};
  }
  return l;
}

size_t ShmLimits::max() const {
  return std::max({allreduce, reduce, broadcast, allgather, alltoall, reduce_scatter});
}

size_t ShmLimits::of(Prim::Kind kind) const {
  switch (kind) {
    case Prim::Kind::Allreduce: return allreduce;
    case Prim::Kind::Reduce: return reduce;
    case Prim::Kind::Broadcast: return broadcast;
    case Prim::Kind::Allgatherv: return allgather;
    case Prim::Kind::Alltoallv: return alltoall;
    case Prim::Kind::ReduceScatter: return reduce_scatter;
    default: return max();
  }
}

const char* Shm::path(Prim::Kind kind, size_t bytes) const {
  return bytes <= limits_.of(kind) ? "shm" : "oneccl";
}

// ---- setup ------------------------------------------------------------------------

Shm::Shm(int rank, int size, ccl::communicator* ccl)
    : rank_(rank),
      size_(size),
      ccl_(ccl),
      limits_(ShmLimits::from_env()),
      layout_(std::make_unique<Layout>(size, kBufferBytes)),
      bases_(size, nullptr),
      pids_(size, 0),
      sends_(size),
      next_msg_(size, 0),
      current_in_(size) {}

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
    ccl::communicator* ccl) {
  if (!shm_enabled() || size < 2 || size > kMaxRanks) {
    return nullptr;
  }
  // 1. Same host? Every rank sees every identity, so all decide alike.
  const auto hosts = exchange(store, "oneccl/shm/host", host_identity(), rank, size, timeout);
  if (std::any_of(hosts.begin(), hosts.end(), [&](const std::string& h) { return h != hosts[0]; })) {
    return nullptr;
  }
  std::unique_ptr<Shm> shm(new Shm(rank, size, ccl));
  const size_t total = shm->layout_->total;

  // 2. Our segment: anonymous, owner-only, sized up front (pages appear on first touch).
  std::string mine = "fail";
  int fd = memfd_create("oneccl_bind_pt", MFD_CLOEXEC);
  if (fd >= 0 && fchmod(fd, 0600) == 0 && ftruncate(fd, static_cast<off_t>(total)) == 0) {
    void* base = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base != MAP_FAILED) {
      shm->bases_[rank] = static_cast<char*>(base);
      auto* h = reinterpret_cast<Header*>(base);
      h->rank = rank;
      h->size = size;
      h->pid = getpid();
      h->total = total;
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
        if (load_acquire(&h->magic) != kMagic || h->rank != q || h->size != size) {
          problem = "rank " + std::to_string(q) + "'s segment is not what it published";
        }
      }
    }
    if (peer_fd >= 0) {
      close(peer_fd);
    }
  }
  // 4. Everyone has mapped everyone (or someone could not): only now may
  // owners close their fd; the mappings keep the memory.
  const auto results = exchange(store, "oneccl/shm/mapped", problem.empty() ? "ok" : problem, rank, size, timeout);
  if (fd >= 0) {
    close(fd);
  }
  for (int q = 0; q < size; ++q) {
    if (results[q] != "ok") {
      TORCH_WARN_ONCE(
          "ccl: no shared memory between the ranks of a process group on this host (rank ", q, ": ",
          results[q], "); its collectives run through oneCCL");
      return nullptr;
    }
  }
  return shm;
}

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
    fits = fits && kernel_ok && bytes <= shm_.limits_.of(p.kind);
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
        ccl_ = start_oneccl(*shm_.ccl_, op_, {p});
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

// ---- send / recv ----------------------------------------------------------------

struct Shm::Incoming {
  int source;
  int tag;
  uint64_t total;
  uint64_t received = 0;
  bool complete = false;
  ShmRecv* recv = nullptr;    // bound receive, if posted
  std::vector<char> held;      // unexpected: the bytes, until a recv takes them
};

class ShmSend final : public Pending {
 public:
  ShmSend(Shm& shm, const Prim& p) : shm_(shm), peer_(p.peer), tag_(p.tag), src_(static_cast<const char*>(p.src)), bytes_(p.count) {
    shm_.sends_[peer_].push_back(this);
  }
  ~ShmSend() override {
    auto& q = shm_.sends_[peer_];
    q.erase(std::remove(q.begin(), q.end(), this), q.end());
  }
  bool poll() override {
    shm_.progress_p2p();
    if (!done_ && Clock::now() > next_check_) {
      next_check_ = Clock::now() + std::chrono::milliseconds(100);
      shm_.check_peer_alive(peer_, "send");
    }
    return done_;
  }
  bool buffers_in_use_after_abort() const override { return false; }

 private:
  friend class Shm;
  Shm& shm_;
  int peer_;
  int tag_;
  const char* src_;
  size_t bytes_;
  size_t sent_ = 0;
  uint64_t msg_ = 0;
  bool done_ = false;
  Clock::time_point next_check_ = Clock::now() + kLivenessAfter;
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
      throw CollectiveMismatch({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, error_);
    }
    return done_;
  }
  int source_rank() const override { return source_; }
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
      std::memcpy(dst_ + offset, data, n);
    }
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
  Shm::Incoming* in_ = nullptr;
  Clock::time_point next_check_ = Clock::now() + kLivenessAfter;
};

bool Shm::any_peer_gone() const {
  for (int q = 0; q < size_; ++q) {
    if (q != rank_ && process_gone(pids_[q])) {
      return true;
    }
  }
  return false;
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

void Shm::pump_sends(int dst) {
  auto& queue = sends_[dst];
  uint64_t* head = ring_head(rank_, dst);
  const uint64_t* tail = ring_tail(dst, rank_);
  while (!queue.empty()) {
    ShmSend* s = queue.front();
    if (s->msg_ == 0) {
      s->msg_ = ++next_msg_[dst];
    }
    while (true) {
      const uint64_t h = *head; // only we write it
      if (h - load_acquire(tail) >= kSlots) {
        return; // ring full: the receiver has not caught up
      }
      const size_t n = std::min(kSlotBytes, s->bytes_ - s->sent_);
      SlotHeader* hdr = slot(rank_, dst, h);
      hdr->msg = s->msg_;
      hdr->tag = s->tag_;
      hdr->total = s->bytes_;
      hdr->offset = s->sent_;
      hdr->bytes = n;
      hdr->last = s->sent_ + n == s->bytes_ ? 1 : 0;
      if (n > 0) {
        std::memcpy(reinterpret_cast<char*>(hdr) + kLine, s->src_ + s->sent_, n);
      }
      s->sent_ += n;
      store_release(head, h + 1);
      if (hdr->last) {
        s->done_ = true;
        queue.pop_front();
        break;
      }
    }
  }
}

void Shm::pump_incoming(int src) {
  const uint64_t* head = ring_head(src, rank_);
  uint64_t* tail = ring_tail(rank_, src);
  while (true) {
    const uint64_t t = *tail; // only we write it
    if (t == load_acquire(head)) {
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
    const char* data = reinterpret_cast<const char*>(hdr) + kLine;
    if (in) {
      if (in->recv) {
        in->recv->write(hdr->offset, data, hdr->bytes);
      } else if (!in->held.empty() || hdr->bytes == 0) {
        if (hdr->bytes > 0) {
          std::memcpy(in->held.data() + hdr->offset, data, hdr->bytes);
        }
      }
      in->received += hdr->bytes;
    }
    const bool last = hdr->last != 0;
    store_release(tail, t + 1);
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

// ---- entry point --------------------------------------------------------------------

std::unique_ptr<Pending> Shm::start(const char* op, std::vector<Prim> prims) {
  if (prims.size() == 1 && prims[0].kind == Prim::Kind::Send) {
    return std::make_unique<ShmSend>(*this, prims[0]);
  }
  if (prims.size() == 1 && prims[0].kind == Prim::Kind::Recv) {
    auto recv = std::make_unique<ShmRecv>(*this, prims[0]);
    // A message that came first, from a matching source and tag, in arrival order.
    for (auto it = unexpected_.begin(); it != unexpected_.end(); ++it) {
      Incoming& in = **it;
      if (in.recv || !recv->matches(in.source, in.tag)) {
        continue;
      }
      recv->bind(in);
      if (in.complete) {
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
  return std::make_unique<ShmPending>(*this, op, std::move(prims));
}

} // namespace oneccl_bind_pt

#include "communicator.hpp"

#include "dtypes.hpp"
#include "errors.hpp"
#include "made_once.hpp"
#include "rendezvous.hpp"
#include "shm.hpp"

#include <c10/util/Exception.h>

#include <dirent.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <condition_variable>
#include <functional>
#include <system_error>
#include <thread>

namespace oneccl_bind_pt {

namespace {

// libfabric's shared-memory provider (how oneCCL reaches ranks on the same
// host) names its segments /dev/shm/<pid>:<n>:<n> (and <pid>:<n>:<n>:<n>)
// and unlinks them when its endpoints close: a process killed, or one whose
// communicator is left unfreed, leaves them behind.
void unlink_fabric_segments(int pid) {
  DIR* dir = opendir("/dev/shm");
  if (!dir) {
    return;
  }
  const std::string prefix = std::to_string(pid) + ":";
  while (const dirent* entry = readdir(dir)) {
    const std::string name = entry->d_name;
    const auto colons = std::count(name.begin(), name.end(), ':');
    if (name.rfind(prefix, 0) == 0 && (colons == 2 || colons == 3) &&
        name.find_first_not_of("0123456789:") == std::string::npos) {
      unlink(("/dev/shm/" + name).c_str()); // another user's: refused, left alone
    }
  }
  closedir(dir);
}

constexpr const char* kAbandonedKey = "oneccl_bind_pt/abandoned_op";
constexpr std::chrono::milliseconds kStoreWait{5000};
constexpr const char* kTimedOutKey = "oneccl_bind_pt/timed_out"; // "0,2,": roll_call()
constexpr std::chrono::milliseconds kRollCallWait{500};
constexpr std::chrono::milliseconds kRollCallSlack{300};
constexpr std::chrono::milliseconds kHookWait{1000};

// A thread that carries a call which may never return (a store or a peer that is gone).
// One that has delivered is joined as its caller leaves, so neither it nor what its
// call held (the group's key-value store) outlives the caller: a group made and
// destroyed leaves no thread behind. One that has not is left to run.
class JoinIfDelivered {
 public:
  explicit JoinIfDelivered(std::function<bool()> delivered) : delivered_(std::move(delivered)) {}
  JoinIfDelivered(const JoinIfDelivered&) = delete;
  JoinIfDelivered& operator=(const JoinIfDelivered&) = delete;
  ~JoinIfDelivered() {
    if (thread.joinable()) {
      if (delivered_()) {
        thread.join();
      } else {
        thread.detach();
      }
    }
  }
  std::thread thread;

 private:
  std::function<bool()> delivered_;
};

// Abort hooks still running (process-wide): see run_abort_hooks().
struct HooksInFlight {
  std::mutex mutex;
  std::condition_variable cv;
  int running = 0;
};

std::atomic<HooksInFlight*> g_hooks{nullptr};

HooksInFlight& hooks_in_flight() {
  return made_once(g_hooks, [] { return new HooksInFlight(); });
}

// Whether rank 0's oneCCL key-value store still answers. Its server lives in
// rank 0's process; when that process is gone, a client's request fails here
// as an exception we can catch, while the same failure inside oneCCL's
// communicator teardown is thrown from a destructor and aborts the process.
bool kvs_answers(ccl::kvs& kvs, int rank) {
  try {
    const std::string key = "oneccl_bind_pt/teardown/" + std::to_string(rank);
    kvs.set(key, {'1', '\0'}); // oneCCL requires the terminating NUL
    return !kvs.get(key).empty();
  } catch (...) {
    return false;
  }
}

// Where a KVS address points ("127.0.0.1_4096" as oneCCL writes it) as "127.0.0.1:4096"
// ("[fe80::1%2]:4096" for IPv6); the text itself when it is not one.
std::string kvs_where(const ccl::kvs::address_type& address, std::string* host = nullptr, std::string* port = nullptr) {
  const std::string text(address.data(), strnlen(address.data(), address.size()));
  const auto cut = text.rfind('_');
  if (cut == std::string::npos || cut == 0 || cut + 1 == text.size()) {
    return text;
  }
  if (host && port) {
    *host = text.substr(0, cut);
    *port = text.substr(cut + 1);
  }
  const std::string ip = text.substr(0, cut);
  return (ip.find(':') == std::string::npos ? ip : "[" + ip + "]") + ":" + text.substr(cut + 1);
}

// What a connection from this host to rank 0's KVS meets within 1 s: "" when it is accepted,
// else the reason ("Connection refused"). oneCCL retries a refused connection silently for
// 120 s and then fails with "init transport failed", which names neither the address nor the
// cause. On a failure path only; oneCCL's server takes a client that connects and leaves
// (a group probed so went on working: measured).
std::string kvs_unreachable(const ccl::kvs::address_type& address) {
  std::string host, port;
  kvs_where(address, &host, &port);
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (host.empty() || getaddrinfo(host.c_str(), port.c_str(), &hints, &found) != 0 || !found) {
    return "";
  }
  int err = 0; // stays 0 where the probe itself fails: nothing is known then
  const int fd = socket(found->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd >= 0) {
    if (connect(fd, found->ai_addr, found->ai_addrlen) != 0) {
      err = errno;
      if (err == EINPROGRESS) {
        err = 0;
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(1);
        pollfd watch{fd, POLLOUT, 0};
        int ready = -1;
        for (auto left = std::chrono::milliseconds(1000); left.count() > 0;
             left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now())) {
          ready = poll(&watch, 1, static_cast<int>(left.count()));
          if (ready >= 0 || errno != EINTR) {
            break;
          }
        }
        if (ready == 0) {
          err = ETIMEDOUT;
        } else if (ready > 0) {
          socklen_t len = sizeof err;
          if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) {
            err = 0;
          }
        }
      }
    }
    close(fd);
  }
  freeaddrinfo(found);
  return err ? std::strerror(err) : "";
}

constexpr const char* kKvsHint =
    ": rank 0 may have died, or listen on an interface this host does not reach (CCL_KVS_IFACE on rank 0's "
    "host chooses it)";

// What a rank adds to oneCCL's "unexpected comm_id".
constexpr const char* kOutOfIds =
    " (oneCCL ran out of communicator ids: a process holds at most 128 oneCCL communicators at once (oneCCL "
    "2022.1.2, measured), one for each ccl process group it is a member of and each left behind by a failure; "
    "destroy groups no longer used, torch.distributed.destroy_process_group(group), before making others. After "
    "this failure the process's destroyed groups keep their ids: restart it to make more)";

// Set once a oneCCL communicator (or its key-value store) failed to be created in this process,
// or a creation or a teardown was left behind.
// Measured: after a creation that failed in libfabric's first send, freeing an earlier group's
// communicator crashed the process (SIGSEGV in atl_comm_id_storage::release, at exit).
std::atomic<bool> g_creation_failed{false};

// Threads left inside oneCCL (a creation abandoned, a teardown that outlived its bound; not
// yet returned). At the process's exit oneCCL's static objects are destroyed under them: one
// logging from inside a key-value store wait then died of SIGSEGV in the logger's freed stream
// (measured, 1 exit in 4 of a test's loop), or the exit hung. While any is left, the exit ends
// the process at once with its status, before those destructors (Python's own finalization
// has run by then).
std::atomic<int> g_oneccl_left_running{0};

void exit_before_oneccl_teardown(int status, void*) {
  if (g_oneccl_left_running.load() > 0) {
    std::fflush(nullptr);
    _exit(status);
  }
}

void leave_oneccl_running() {
  g_oneccl_left_running.fetch_add(1);
  // Registered after oneCCL's statics were made (it is initialized by now), so it runs
  // before their destructors.
  static const bool registered = on_exit(exit_before_oneccl_teardown, nullptr) == 0;
  (void)registered;
}

// oneCCL objects whose teardown is not safe (peers gone, an op of theirs left inside oneCCL, a
// failed creation): kept to the end of the process, a leak instead of a crash or a hang. (A
// key-value store's teardown tells rank 0's and waits for its answer with no time limit.)
void leave_behind(std::optional<ccl::communicator> comm, std::shared_ptr<ccl::kvs> kvs) {
  struct Left {
    std::optional<ccl::communicator> comm;
    std::shared_ptr<ccl::kvs> kvs;
  };
  static auto* mutex = new std::mutex(); // never freed: a group may be left as the process exits
  static auto* graveyard = new std::vector<Left>();
  std::lock_guard<std::mutex> lock(*mutex);
  graveyard->push_back(Left{std::move(comm), std::move(kvs)});
}

// Frees a healthy group's communicator, then its key-value store, on a thread of its own, and
// waits for that at most `limit`. The store's teardown has no time limit: on rank 0 it waits
// until every other rank has let go of the store, then for the thread serving it (`server`,
// 0 where not known) to answer. A rank that ended while one of its requests to that thread
// was in flight kills it (measured: a peer's process exited while its teardown ran on another
// of its threads; "Connection reset by peer" in the server, then rank 0 waited for good).
// Past the limit, or once the server is gone, the teardown is left to run (or not) on its own.
void tear_down(std::optional<ccl::communicator> comm, std::shared_ptr<ccl::kvs> kvs, pid_t server,
               std::chrono::milliseconds limit) {
  struct Teardown {
    std::mutex mutex;
    std::condition_variable cv;
    bool done = false;
    std::optional<ccl::communicator> comm;
    std::shared_ptr<ccl::kvs> kvs;
  };
  auto t = std::make_shared<Teardown>();
  t->comm = std::move(comm);
  t->kvs = std::move(kvs);
  // Counted while it runs, not only once left: an exit meanwhile (this is on another thread)
  // would destroy oneCCL's statics under it.
  leave_oneccl_running();
  const auto run = [t] {
    t->comm.reset();
    t->kvs.reset();
    g_oneccl_left_running.fetch_sub(1);
    std::lock_guard<std::mutex> lock(t->mutex);
    t->done = true;
    t->cv.notify_all();
  };
  std::thread worker;
  try {
    worker = std::thread([run] {
      pthread_setname_np(pthread_self(), "ccl-teardown");
      run();
    });
  } catch (const std::system_error&) {
    run(); // no thread to be had: unbounded, as oneCCL's own teardown is
    return;
  }
  const auto serving = [server] {
    return server == 0 || access(("/proc/self/task/" + std::to_string(server)).c_str(), F_OK) == 0;
  };
  using Clock = std::chrono::steady_clock;
  const auto until = Clock::now() + limit;
  // The server also ends on its own once it has answered the teardown, which then closes its
  // sockets: a while is left for that, however crowded the host.
  std::optional<Clock::time_point> gone;
  std::unique_lock<std::mutex> lock(t->mutex);
  while (!t->done) {
    const auto now = Clock::now();
    if (!gone && !serving()) {
      gone = now;
    }
    if (now >= until || (gone && now - *gone > std::chrono::seconds(2))) {
      lock.unlock();
      worker.detach();
      // Its communicator id and oneCCL's state may stay taken: later groups' objects are left
      // too, as after a failed creation, rather than freed beside it.
      g_creation_failed.store(true);
      TORCH_WARN("ccl: freeing a process group's oneCCL communicator and key-value store did not finish ",
                 gone ? "after the thread serving the store (rank 0's) had died, its client reset under it (a peer "
                        "that exited or was killed mid-request)"
                      : "within the group's timeout",
                 "; left to finish on its own (a leak), and the process's exit will not wait for it");
      return;
    }
    t->cv.wait_for(lock, std::chrono::milliseconds(10));
  }
  lock.unlock();
  worker.join();
}

struct Created {
  ccl::communicator comm;
  std::shared_ptr<ccl::kvs> kvs;
};

// oneCCL's communicator creation waits in its key-value store's barrier for every
// rank, with no time limit, and a rank other than 0 first attaches to rank 0's store,
// retrying a refused connection for 120 s: a rank that failed after the rendezvous
// (or died) would keep the others there. So both run on a thread of their own while
// this one watches the group's deadline and the store for a peer's announced failure;
// on either, this rank raises and leaves that thread, and what it makes, behind.
Created create_communicator(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    std::chrono::milliseconds timeout,
    const Rendezvous& met) {
  struct Creation {
    std::mutex mutex;
    std::condition_variable cv;
    bool done = false;
    bool abandoned = false;
    bool attached = false; // this rank has its handle on the group's KVS
    std::optional<ccl::communicator> comm;
    std::shared_ptr<ccl::kvs> kvs;
    std::string error;
  };
  auto c = std::make_shared<Creation>();
  c->kvs = met.kvs;
  c->attached = met.kvs != nullptr;
  auto create = [c, rank, size, address = met.address] {
    std::optional<ccl::communicator> comm;
    std::shared_ptr<ccl::kvs> kvs;
    std::string error;
    try {
      {
        std::lock_guard<std::mutex> lock(c->mutex);
        kvs = c->kvs;
      }
      if (!kvs) {
        kvs = ccl::create_kvs(address);
        std::lock_guard<std::mutex> lock(c->mutex);
        c->attached = true;
        if (c->abandoned) {
          new std::shared_ptr<ccl::kvs>(kvs); // as below: its teardown would call on a store gone
          g_oneccl_left_running.fetch_sub(1);
          return;
        }
      }
      comm.emplace(ccl::create_communicator(size, rank, kvs));
    } catch (const std::exception& e) {
      const bool failed_before = g_creation_failed.exchange(true);
      error = e.what();
      if (error.find("unexpected comm_id") != std::string::npos) {
        // oneCCL's own words name neither the cause nor the way out. (Groups freed after a
        // failed creation are left behind, so their ids stay taken: measured, freeing them
        // instead crashed the process.)
        error += std::string(kOutOfIds) +
            (failed_before ? " (this process had a failed creation before: the groups it destroyed since kept theirs)"
                           : "");
      }
      if (!kvs) {
        error = "it could not reach rank 0's oneCCL key-value store: " + error +
            " (CCL_KVS_IFACE / CCL_KVS_IP_EXCHANGE choose its network interface)";
      }
    } catch (...) {
      g_creation_failed.store(true);
      error = "an unknown exception";
    }
    std::lock_guard<std::mutex> lock(c->mutex);
    if (c->abandoned) {
      // Its peers are gone or failed: tearing it down would call on them (the teardown
      // that aborts the process, see kvs_answers), and so would the key-value store's.
      leave_behind(std::move(comm), std::move(kvs));
      g_oneccl_left_running.fetch_sub(1);
    } else {
      c->comm = std::move(comm);
      c->kvs = std::move(kvs);
      c->error = std::move(error);
    }
    c->done = true;
    c->cv.notify_all();
  };
  // oneCCL opens its sockets for the creation as it begins and uses them at once: they get
  // TCP_NODELAY from a sweep every millisecond in its first 200 ms (setting it sends what
  // Nagle's algorithm held back; a process with many descriptors, whose sweep takes longer,
  // sweeps less often), then at each look at the store, and after it for the teardown's
  // exchanges.
  NewTcpSockets opened = met.opened; // (rank 0's store may still be accepting its own connections)
  constexpr auto kSweepEvery = std::chrono::milliseconds(1);
  constexpr auto kSweepFor = std::chrono::milliseconds(200);
  JoinIfDelivered creator([c] {
    std::lock_guard<std::mutex> lock(c->mutex);
    return c->done;
  });
  try {
    creator.thread = std::thread(create);
  } catch (const std::system_error&) {
    create(); // no thread to be had (a pids limit): unwatched, as oneCCL makes it
  }
  const std::string who = "ccl: creating the oneCCL communicator (rank " + std::to_string(rank) + " of " +
      std::to_string(size) + ")";
  const std::string gives_up = " (rank " + std::to_string(rank) + " gives up on this process group with it)";
  const std::string kvs_at = "rank 0's oneCCL key-value store at " + kvs_where(met.address);
  using Clock = std::chrono::steady_clock;
  const auto started = Clock::now();
  const auto deadline = started + timeout;
  auto look = std::chrono::milliseconds(50); // between looks at the store: up to 1 s, for large groups
  auto next_look = started + look;
  Clock::duration sweep_every = kSweepEvery;
  const auto until_next = [&] {
    const auto now = Clock::now();
    const auto wait = now < started + kSweepFor ? std::min(sweep_every, next_look - now) : next_look - now;
    return std::max(wait, Clock::duration::zero());
  };
  std::unique_lock<std::mutex> lock(c->mutex);
  while (!c->cv.wait_for(lock, until_next(), [&] { return c->done; })) {
    lock.unlock();
    const auto swept = Clock::now();
    opened.no_delay();
    sweep_every = std::max<Clock::duration>(kSweepEvery, 10 * (Clock::now() - swept));
    if (Clock::now() < next_look) {
      lock.lock();
      continue;
    }
    std::string failed = announced_failure(store);
    const bool late = Clock::now() >= deadline;
    lock.lock();
    if (c->done) {
      break;
    }
    if (!failed.empty() || late) {
      c->abandoned = true;
      g_creation_failed.store(true); // its thread may still be inside oneCCL
      leave_oneccl_running();
      const bool attached = c->attached;
      lock.unlock();
      if (!failed.empty()) {
        C10_THROW_ERROR(DistBackendError, who + ": " + failed + gives_up);
      }
      const std::string ms = std::to_string(timeout.count()) + " ms";
      std::string why, told;
      if (attached) {
        why = "did not complete within " + ms + ": a rank of the group may have died, or be unable to reach "
              "the others (CCL_KVS_IFACE / FI_TCP_IFACE choose the network interface)";
        told = "it gave up waiting for oneCCL's communicator after " + ms;
      } else {
        const std::string cause = kvs_unreachable(met.address);
        const std::string because = cause.empty() ? "" : " (" + cause + ")";
        told = "it could not reach " + kvs_at + " within " + ms + because;
        why = "did not complete within " + ms + ": it could not reach " + kvs_at + because + kKvsHint;
      }
      // Those still waiting should not find out later, from a straggler, that this rank left.
      announce_failure(store, rank, told);
      C10_THROW_ERROR(DistBackendError, who + " " + why);
    }
    look = std::min<std::chrono::milliseconds>(look * 2, std::chrono::milliseconds(1000));
    next_look = Clock::now() + look;
  }
  lock.unlock();
  opened.no_delay();
  if (!c->comm) {
    // A peer that failed first is the cause: its leaving can make this rank's creation fail too.
    if (const std::string failed = announced_failure(store); !failed.empty()) {
      leave_behind(std::nullopt, c->kvs);
      std::string own = c->error;
      if (const auto at = own.find(kOutOfIds); at != std::string::npos && failed.find(kOutOfIds) != std::string::npos) {
        own.erase(at); // said once, in the other rank's words below
      }
      C10_THROW_ERROR(DistBackendError, who + " failed (" + own + "): " + failed + gives_up);
    }
    std::string why = c->error;
    if (rank != 0) {
      // oneCCL's own words after a refused attach are "init transport failed".
      if (const std::string cause = kvs_unreachable(met.address); !cause.empty()) {
        why += "; " + kvs_at + " does not accept connections from this host (" + cause + ")" + kKvsHint;
      }
    }
    announce_failure(store, rank, "creating its oneCCL communicator failed: " + why);
    leave_behind(std::nullopt, c->kvs); // measured: its teardown waited for rank 0's store for good
    C10_THROW_ERROR(DistBackendError, who + " failed: " + why);
  }
  return {std::move(*c->comm), std::move(c->kvs)};
}

} // namespace

Communicator::Communicator(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    std::chrono::milliseconds timeout)
    : store_(store), rank_(rank), size_(size), timeout_(timeout) {
  CCL_CHECK_ARG(
      size > 0 && rank >= 0 && rank < size, "ccl: invalid rank ", rank,
      " for a process group of size ", size);
  ensure_ccl_initialized();
  auto met = rendezvous(store, rank, size, timeout, host_identity());
  host_peers_ = std::move(met.host_peers);
  std::optional<Created> made;
  try {
    made.emplace(create_communicator(store, rank, size, timeout, met));
  } catch (...) {
    leave_behind(std::nullopt, met.kvs); // rank 0's store, made at the rendezvous (see leave_behind)
    throw;
  }
  Created& created = *made;
  if (created.kvs == met.kvs) {
    kvs_server_ = met.kvs_server; // rank 0's, which it serves
  }
  kvs_ = std::move(created.kvs);
  comm_.emplace(std::move(created.comm));
  ccl_ = std::make_unique<CclTransport>(*comm_, [this] { return broken() ? broken_reason() : std::string(); });
  try {
    shm_ = Shm::connect(store, rank, size, timeout, ccl_.get());
  } catch (...) {
    // A peer failed or left while the segments were set up: the communicator's teardown would
    // call on it (see ~Communicator). The members are freed without the destructor's checks.
    ccl_.reset();
    leave_behind(std::move(comm_), kvs_);
    throw;
  }
}

void unlink_own_fabric_segments() {
  unlink_fabric_segments(getpid());
}

template <class Fn>
std::optional<std::invoke_result_t<Fn>> Communicator::bounded(
    Fn fn,
    std::optional<std::chrono::milliseconds> limit,
    Inline fallback) const {
  using T = std::invoke_result_t<Fn>;
  if (stores_silent_.load(std::memory_order_acquire)) {
    return std::nullopt;
  }
  // (A mutex and condition variable, not std::future: its timed wait needs a
  // libstdc++ newer than manylinux_2_28's.)
  struct Call {
    std::mutex mutex;
    std::condition_variable cv;
    bool done = false;
    std::optional<T> value;
  };
  auto call = std::make_shared<Call>();
  auto run = [call, fn = std::move(fn)]() mutable {
    std::optional<T> value;
    try {
      value = fn();
    } catch (...) {
    }
    std::lock_guard<std::mutex> lock(call->mutex);
    call->value = std::move(value);
    call->done = true;
    call->cv.notify_all();
  };
  JoinIfDelivered worker([call] {
    std::lock_guard<std::mutex> lock(call->mutex);
    return call->done;
  });
  try {
    worker.thread = std::thread([run]() mutable {
      pthread_setname_np(pthread_self(), "ccl-store");
      run();
    });
  } catch (const std::system_error&) {
    if (fallback == Inline::kNever) {
      return std::nullopt;
    }
    run(); // no thread to be had: bounded by the store's own timeout
  }
  std::unique_lock<std::mutex> lock(call->mutex);
  if (!call->cv.wait_for(lock, limit.value_or(std::min<std::chrono::milliseconds>(timeout_, kStoreWait)),
                         [&] { return call->done; })) {
    if (!limit) {
      stores_silent_.store(true, std::memory_order_release);
    }
    return std::nullopt;
  }
  return std::move(call->value);
}

std::string Communicator::roll_call() const {
  if (size_ == 1) {
    return "";
  }
  const auto wait = std::max<std::chrono::milliseconds>(
      std::chrono::milliseconds(20), std::min<std::chrono::milliseconds>(kRollCallWait, timeout_ / 4));
  // Whether the store answered at all: one that never did is cut off (below).
  auto answered = std::make_shared<std::atomic<bool>>(false);
  const auto missing = bounded([store = store_, rank = rank_, size = size_, wait, answered] {
    // One key that every rank appends its number to: one round trip per look, whatever
    // the group's size.
    const std::string mine = std::to_string(rank) + ",";
    store->append(kTimedOutKey, std::vector<uint8_t>(mine.begin(), mine.end()));
    answered->store(true);
    const auto until = std::chrono::steady_clock::now() + wait;
    for (;;) {
      std::vector<bool> in(size, false);
      const auto list = store->get(kTimedOutKey);
      int count = 0;
      for (size_t at = 0; at < list.size();) {
        const auto comma = std::find(list.begin() + at, list.end(), uint8_t{','}) - list.begin();
        const int q = std::atoi(std::string(list.begin() + at, list.begin() + comma).c_str());
        if (q >= 0 && q < size && !in[q]) {
          in[q] = true;
          ++count;
        }
        at = comma + 1;
      }
      if (count == size || std::chrono::steady_clock::now() >= until) {
        std::vector<int> missing;
        for (int q = 0; q < size; ++q) {
          if (!in[q]) {
            missing.push_back(q);
          }
        }
        return missing;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }, wait + kRollCallSlack); // a store cut off (a partition) answers nothing: the op's error must not wait on it
  if (!missing) {
    if (!answered->load()) {
      // Cut off: later calls (abort's, teardown's) need not wait on it either.
      stores_silent_.store(true, std::memory_order_release);
    }
    return " The group's store did not answer (it may live in the process or on the host that stopped, "
           "often rank 0's), so which rank stopped is not known.";
  }
  if (missing->empty()) {
    return " Every other rank timed out too: none is missing; they may have called different collectives, or "
           "the same ones in a different order.";
  }
  std::string names;
  for (size_t i = 0; i < missing->size(); ++i) {
    names += (i == 0 ? "" : i + 1 == missing->size() ? " and " : ", ") + std::string("rank ") +
        std::to_string((*missing)[i]);
  }
  const bool one = missing->size() == 1;
  return " Of the other ranks, " + names + (one ? " has" : " have") + " not timed out within " +
      std::to_string(wait.count()) + " ms of this one: " + (one ? "it" : "they") +
      " may have died, hung, or be elsewhere (computing, or in another collective).";
}

void Communicator::explain_break(const std::string& more) {
  std::lock_guard<std::mutex> lock(why_mutex_);
  why_ += more;
}

bool Communicator::peer_abandoned_an_op() const {
  // A store that does not answer: kvs_answers() decides.
  return bounded([store = store_] { return store->check({kAbandonedKey}); }).value_or(false);
}

void Communicator::unlink_segments_of_dead_peers() {
  if (!broken()) {
    return;
  }
  std::lock_guard<std::mutex> lock(sweep_mutex_);
  const auto gone = [](int pid) {
    const char state = process_state(pid);
    // A stopped peer that made the group fail counts as gone, as it does for shrink().
    return state == 'X' || state == 'Z' || state == 'T' || state == 't';
  };
  const auto swept = std::remove_if(host_peers_.begin(), host_peers_.end(), [&](int pid) {
    if (!gone(pid)) {
      return false;
    }
    unlink_fabric_segments(pid);
    return true;
  });
  host_peers_.erase(swept, host_peers_.end());
}

Communicator::~Communicator() {
  if (inherited()) {
    // A forked child's copy (freed as its interpreter exits): oneCCL's objects share the
    // parent's sockets, and their teardown would speak to the group's key-value store as the
    // parent and join threads the child does not have. Left, never freed.
    struct Left {
      std::optional<ccl::communicator> comm;
      std::shared_ptr<ccl::kvs> kvs;
      std::unique_ptr<CclTransport> ccl;
    };
    (void)new Left{std::move(comm_), std::move(kvs_), std::move(ccl_)};
    return;
  }
  // oneCCL's teardown talks to the group's key-value store, which rank 0
  // hosts; if rank 0 has already exited (its group broke, or it was killed),
  // oneCCL throws from a destructor and aborts the process. So a group that
  // knows a peer is gone, or finds the store silent, leaves its oneCCL
  // objects be: a leak at the end of a failed job instead of a SIGABRT.
  // An aborted group may still have an op inside oneCCL that no peer will
  // ever join: freeing the communicator under it is not safe, and a peer that
  // freed its own would reuse the communicator's id, whose messages that op
  // then takes (measured: the next group's creation hung on both ranks).
  const auto kvs_silent = [&] {
    return !bounded([kvs = kvs_, rank = rank_] { return kvs_answers(*kvs, rank); }, {}, Inline::kNever)
                .value_or(false);
  };
  if (g_creation_failed.load() || aborted() || (shm_ && shm_->any_peer_gone()) || peer_abandoned_an_op() ||
      (rank_ != 0 && kvs_silent())) {
    leave_behind(std::move(comm_), kvs_);
  } else {
    shm_.reset(); // ours, which use the communicator
    ccl_.reset();
    tear_down(std::move(comm_), std::move(kvs_), kvs_server_, timeout_);
  }
  unlink_segments_of_dead_peers();
}

std::unique_ptr<Pending> Communicator::start(const char* op, std::vector<Prim> prims) {
  Transport& transport = shm_ ? static_cast<Transport&>(*shm_) : *ccl_;
  return transport.start(op, std::move(prims));
}

bool Communicator::mark_broken(const std::string& why) {
  std::lock_guard<std::mutex> lock(why_mutex_);
  if (broken_.load(std::memory_order_relaxed)) {
    return false;
  }
  why_ = why;
  broken_.store(true, std::memory_order_release);
  return true;
}

void Communicator::abort(bool ops_in_flight) {
  mark_broken("abort() was called on it");
  if (aborted_.exchange(true, std::memory_order_acq_rel) || !ops_in_flight) {
    return;
  }
  // The key must be in the store before abort() returns: a caller that then
  // tells its peers (measured: a test's announcement) lets them destroy their
  // groups, and a peer that checks before the key lands frees its communicator
  // (both ranks then hung creating the next group). Bounded: a store whose
  // host is stopped or cut off holds abort() for at most a few seconds.
  bounded([store = store_] {
    store->set(kAbandonedKey, std::vector<uint8_t>{1});
    return true;
  });
}

void Communicator::add_completion_hook(int64_t id, std::function<void(uint64_t)> hook) {
  std::lock_guard<std::mutex> lock(hooks_mutex_);
  hooks_[id] = std::move(hook);
  has_hooks_.store(true, std::memory_order_release);
}

void Communicator::remove_completion_hook(int64_t id) {
  std::lock_guard<std::mutex> lock(hooks_mutex_);
  hooks_.erase(id);
  has_hooks_.store(!hooks_.empty(), std::memory_order_release);
}

void Communicator::completed(uint64_t key) const {
  if (!has_hooks_.load(std::memory_order_acquire)) {
    return;
  }
  // Under the lock: once unregistered, a hook is not running and will not run.
  std::lock_guard<std::mutex> lock(hooks_mutex_);
  for (const auto& entry : hooks_) {
    try {
      entry.second(key);
    } catch (...) {
      // A hook's failure is not the op's: the op completed (and a Work's completion must not throw).
    }
  }
}

void Communicator::add_abort_hook(int64_t id, std::function<void()> hook) {
  std::lock_guard<std::mutex> lock(hooks_mutex_);
  abort_hooks_[id] = std::move(hook);
}

void Communicator::remove_abort_hook(int64_t id) {
  std::lock_guard<std::mutex> lock(hooks_mutex_);
  abort_hooks_.erase(id);
}

void Communicator::run_abort_hooks() {
  std::map<int64_t, std::function<void()>> hooks;
  {
    // Called without the lock: a hook may (un)register hooks.
    std::lock_guard<std::mutex> lock(hooks_mutex_);
    hooks = abort_hooks_;
  }
  if (hooks.empty()) {
    return;
  }
  // On a thread of their own, waited for at most kHookWait: torch 2.15 gives
  // every ccl group a FlightRecorderHook whose abort hook dumps the trace
  // (measured: 5 s on a quiet machine, 9 s beside other jobs), and the op's
  // error must still reach its waiter within the group's timeout. A slower
  // hook finishes beside the waiter; the process waits for it at exit.
  struct Run {
    std::mutex mutex;
    std::condition_variable cv;
    bool done = false;
  };
  auto run = std::make_shared<Run>();
  auto& all = hooks_in_flight();
  {
    std::lock_guard<std::mutex> lock(all.mutex);
    ++all.running;
  }
  std::thread hook_thread;
  try {
    hook_thread = std::thread([hooks = std::move(hooks), run] {
      pthread_setname_np(pthread_self(), "ccl-abort-hooks");
      for (const auto& entry : hooks) {
        try {
          entry.second();
        } catch (const std::exception& e) {
          TORCH_WARN("ccl: abort hook ", entry.first, " raised (ignored; the group's error follows): ", e.what());
        } catch (...) {
          TORCH_WARN("ccl: abort hook ", entry.first, " raised (ignored; the group's error follows)");
        }
      }
      {
        std::lock_guard<std::mutex> lock(run->mutex);
        run->done = true;
      }
      run->cv.notify_all();
      auto& all = hooks_in_flight();
      {
        std::lock_guard<std::mutex> lock(all.mutex);
        --all.running;
      }
      all.cv.notify_all();
    });
  } catch (const std::system_error& e) {
    {
      std::lock_guard<std::mutex> lock(all.mutex);
      --all.running;
    }
    all.cv.notify_all();
    TORCH_WARN("ccl: the group's abort hooks were not run: no thread could be started for them (", e.what(), ")");
    return;
  }
  hook_thread.detach();
  std::unique_lock<std::mutex> lock(run->mutex);
  run->cv.wait_for(lock, kHookWait, [&] { return run->done; });
}

void wait_for_abort_hooks(std::chrono::milliseconds limit) {
  auto& all = hooks_in_flight();
  std::unique_lock<std::mutex> lock(all.mutex);
  all.cv.wait_for(lock, limit, [&] { return all.running == 0; });
}

namespace {
struct Aborts {
  std::mutex mutex;
  std::condition_variable cv;
  int running = 0;
  std::chrono::steady_clock::time_point last_end{};
};

std::atomic<Aborts*> g_aborts{nullptr};

Aborts& aborts() {
  return made_once(g_aborts, [] { return new Aborts(); });
}
} // namespace

void forget_exit_waits_in_child() {
  // The parent's counts are of its threads, and one of them may have held a lock at the fork.
  g_hooks.store(nullptr, std::memory_order_relaxed);
  g_aborts.store(nullptr, std::memory_order_relaxed);
}

AbortInProgress::AbortInProgress() {
  std::lock_guard<std::mutex> lock(aborts().mutex);
  ++aborts().running;
}

AbortInProgress::~AbortInProgress() {
  auto& all = aborts();
  {
    std::lock_guard<std::mutex> lock(all.mutex);
    --all.running;
    all.last_end = std::chrono::steady_clock::now();
  }
  all.cv.notify_all();
}

void settle_aborts(std::chrono::milliseconds limit) {
  // Time for a thread that left abort() to get through torch's binding and
  // take the GIL, which is free while we wait here.
  constexpr std::chrono::milliseconds kBackInPython{50};
  auto& all = aborts();
  const auto deadline = std::chrono::steady_clock::now() + limit;
  std::unique_lock<std::mutex> lock(all.mutex);
  all.cv.wait_until(lock, deadline, [&] { return all.running == 0; });
  if (all.running == 0 && all.last_end != std::chrono::steady_clock::time_point{}) {
    const auto settled = std::min(deadline, all.last_end + kBackInPython);
    lock.unlock();
    std::this_thread::sleep_until(settled);
  }
}

std::string Communicator::broken_reason() const {
  if (inherited()) { // before the lock, which a parent's thread may have held at the fork
    return "it was made in the parent of this forked process, and its peers, connections and shared memory are "
           "the parent's";
  }
  std::lock_guard<std::mutex> lock(why_mutex_);
  return why_;
}

} // namespace oneccl_bind_pt

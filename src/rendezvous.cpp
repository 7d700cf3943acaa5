#include "rendezvous.hpp"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <iterator>
#include <iomanip>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <dirent.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

namespace oneccl_bind_pt {

namespace {

constexpr const char* kAddressKey = "oneccl/kvs_address";
constexpr const char* kArrivedCounter = "oneccl/arrived";
constexpr const char* kAllArrivedKey = "oneccl/all_arrived";
// kAllArrivedKey's value when a rank announced a failure, before its reason.
constexpr const char* kFailedMark = "failed: ";
// The same reason, for ranks already past the rendezvous (announced_failure).
constexpr const char* kFailedKey = "oneccl/failed";

std::string arrived_key(int rank) {
  return "oneccl/arrived/" + std::to_string(rank);
}

// "0, 2, 5" (at most 16 shown).
std::string rank_list(const std::vector<int>& ranks) {
  std::ostringstream out;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i == 16) {
      out << ", ...";
      break;
    }
    out << (i ? ", " : "") << ranks[i];
  }
  return out.str();
}

// Ranks whose arrival key is absent: only computed on the error path.
std::string missing_ranks(c10d::Store& store, int size) {
  std::vector<int> missing;
  for (int r = 0; r < size && missing.size() <= 16; ++r) {
    if (!store.check({arrived_key(r)})) {
      missing.push_back(r);
    }
  }
  return missing.empty() ? std::string("none (they arrived just now)") : rank_list(missing);
}

// "3.0", "1800.0": as torch and the Python side print a timeout.
std::string seconds_text(std::chrono::milliseconds timeout) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(1) << timeout.count() / 1000.0;
  return out.str();
}

[[noreturn]] void fail(const std::string& what) {
  C10_THROW_ERROR(DistBackendError, "ccl rendezvous: " + what);
}

// oneCCL settings every rank must share: where one rank's transport differs from another's,
// the ranks cannot connect, and oneCCL finds it only inside its communicator creation, where a
// rank then failed or waited for good (CCL_ATL_SHM on one rank only: one rank's transport failed
// to start, the other hung tearing down its key-value store).
// CCL_WORKER_COUNT: oneCCL splits a collective into one part per worker on every rank.
constexpr const char* kMustAgree[] = {"CCL_ATL_TRANSPORT", "CCL_ATL_SHM", "CCL_WORKER_COUNT"};

// "\nCCL_ATL_TRANSPORT=ofi\nCCL_ATL_SHM=0": as this process read them first, right after
// oneCCL read its own (ccl::init); lower case, and an unset CCL_ATL_SHM as oneCCL's default.
const std::string& oneccl_settings() {
  static const std::string settings = [] {
    std::string text;
    for (const char* name : kMustAgree) {
      const char* set = std::getenv(name);
      // Unset: oneCCL's defaults.
      const std::string n(name);
      std::string value = set ? set : n == "CCL_ATL_SHM" ? "0" : n == "CCL_WORKER_COUNT" ? "1" : "unset";
      std::transform(value.begin(), value.end(), value.begin(), [](unsigned char c) { return std::tolower(c); });
      text += std::string("\n") + name + "=" + value;
    }
    return text;
  }();
  return settings;
}

// Called by the last rank to arrive, when every arrival mark is in: which of kMustAgree differ
// between ranks, as a sentence, or "" when they all agree. A mark without them (one written by
// hand, as a test's stand-in rank does) is left out.
std::string settings_disagreement(c10d::Store& store, int size) {
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) {
    keys.push_back(arrived_key(r));
  }
  constexpr size_t kNames = std::size(kMustAgree);
  std::vector<std::pair<std::string, std::vector<int>>> seen[kNames]; // per name: value, ranks; first seen first
  const auto marks = store.multiGet(keys);
  for (int r = 0; r < size; ++r) {
    std::istringstream lines(std::string(marks[r].begin(), marks[r].end()));
    std::string line;
    std::getline(lines, line); // host/pid
    while (std::getline(lines, line)) {
      for (size_t i = 0; i < kNames; ++i) {
        const std::string prefix = std::string(kMustAgree[i]) + "=";
        if (line.rfind(prefix, 0) == 0) {
          const std::string value = line.substr(prefix.size());
          auto at = std::find_if(seen[i].begin(), seen[i].end(), [&](const auto& v) { return v.first == value; });
          (at == seen[i].end() ? seen[i].emplace_back(value, std::vector<int>{}) : *at).second.push_back(r);
        }
      }
    }
  }
  std::string differ;
  for (size_t i = 0; i < kNames; ++i) {
    if (seen[i].size() < 2) {
      continue;
    }
    differ += (differ.empty() ? "" : "; ") + std::string(kMustAgree[i]) + " is ";
    for (size_t v = 0; v < seen[i].size(); ++v) {
      const auto& [value, ranks] = seen[i][v];
      differ += std::string(v == 0 ? "" : v + 1 == seen[i].size() ? " and " : ", ") + value + " on rank" +
          (ranks.size() > 1 ? "s " : " ") + rank_list(ranks);
    }
  }
  if (differ.empty()) {
    return "";
  }
  return "the ranks of this process group have different oneCCL settings, which must be the same on "
         "every rank: " + differ + ". Give each the same value on every rank (oneccl_bind_pt chooses them alike "
         "where you leave them unset, at each process's first ccl group: where processes made different ccl groups "
         "first, make one of all ranks first, e.g. init_process_group(\"ccl\"))";
}

// Makes `reason` the group's failure, unless a rank announced one first (that one stands: a
// failure can make others fail after it). For ranks past the rendezvous, first; then in place
// of the mark the last arrival sets, for those in it or still to come (a rank that comes after
// this one gave up, and sets that mark over this one, finds the failure in its key).
void set_failure(c10d::Store& store, int rank, const std::string& reason) {
  const std::vector<uint8_t> bytes(reason.begin(), reason.end());
  std::vector<uint8_t> first;
  try {
    first = store.compareSet(kFailedKey, {}, bytes);
  } catch (const std::exception&) {
    // A store without compareSet (one written in Python): not atomic, but the first reason
    // all the same unless two ranks fail at the same moment.
    first = store.check({kFailedKey}) ? store.get(kFailedKey) : (store.set(kFailedKey, bytes), bytes);
  }
  const std::string mark = kFailedMark + std::string(first.begin(), first.end());
  store.set(kAllArrivedKey, std::vector<uint8_t>(mark.begin(), mark.end()));
  if (rank == 0 && !store.check({kAddressKey})) {
    store.set(kAddressKey, std::vector<uint8_t>{}); // the others wait for it too
  }
}

// This process's open sockets, by fd and inode.
template <class Fn>
void each_socket(Fn fn) {
  const std::unique_ptr<DIR, int (*)(DIR*)> dir(opendir("/proc/self/fd"), closedir);
  if (!dir) {
    return; // no /proc: oneCCL's sockets keep Nagle's algorithm, creation is slower
  }
  const int own = dirfd(dir.get());
  while (const dirent* entry = readdir(dir.get())) {
    char* end = nullptr;
    const long fd = std::strtol(entry->d_name, &end, 10);
    struct stat st {};
    if (*end == '\0' && end != entry->d_name && fd != own && fstat(static_cast<int>(fd), &st) == 0 &&
        S_ISSOCK(st.st_mode)) {
      fn(static_cast<int>(fd), st.st_ino);
    }
  }
}

} // namespace

c10::intrusive_ptr<c10d::Store> creation_keys(const c10::intrusive_ptr<c10d::Store>& store, int rank) {
  const int64_t n = store->add("oneccl/creations/" + std::to_string(rank), 1);
  if (n == 1) {
    return store;
  }
  return c10::make_intrusive<c10d::PrefixStore>("oneccl/creation/" + std::to_string(n), store);
}

NewTcpSockets::NewTcpSockets() {
  each_socket([&](int, ino_t inode) { seen_.insert(inode); });
}

void NewTcpSockets::no_delay() {
  each_socket([&](int fd, ino_t inode) {
    int protocol = 0, type = 0;
    socklen_t len = sizeof protocol, type_len = sizeof type;
    if (seen_.insert(inode).second && getsockopt(fd, SOL_SOCKET, SO_PROTOCOL, &protocol, &len) == 0 &&
        protocol == IPPROTO_TCP && getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &type_len) == 0 &&
        type == SOCK_STREAM) {
      const int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one); // best effort: only a speed-up
    }
  });
}

std::set<pid_t> thread_ids() {
  std::set<pid_t> ids;
  if (DIR* dir = opendir("/proc/self/task")) {
    while (const dirent* entry = readdir(dir)) {
      if (const pid_t id = static_cast<pid_t>(std::atoi(entry->d_name)); id > 0) {
        ids.insert(id);
      }
    }
    closedir(dir);
  }
  return ids;
}

Rendezvous rendezvous(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    std::chrono::milliseconds timeout,
    const std::string& host) {
  const auto seconds = seconds_text(timeout);
  const std::string& settings = oneccl_settings(); // before rank 0 opens its key-value store
  NewTcpSockets opened;
  std::shared_ptr<ccl::kvs> kvs;
  pid_t kvs_server = 0;
  try {
    if (rank == 0) {
      // oneCCL serves the store on a thread it starts here: known by its id, its death (a
      // client that vanished mid-request kills it) shows at teardown (see ~Communicator).
      const auto before = thread_ids();
      kvs = ccl::create_main_kvs();
      std::vector<pid_t> started;
      const auto after = thread_ids();
      std::set_difference(after.begin(), after.end(), before.begin(), before.end(), std::back_inserter(started));
      if (started.size() == 1) { // else another thread started meanwhile: not known
        kvs_server = started[0];
      }
      opened.no_delay(); // before the others can connect: what its listener accepts inherits it
      auto address = kvs->get_address();
      store->set(kAddressKey, std::vector<uint8_t>(address.begin(), address.end()));
    }
  } catch (const ccl::exception& e) {
    const std::string why = std::string("rank 0 could not open oneCCL's key-value store: ") + e.what() +
        " (CCL_KVS_IFACE / CCL_KVS_IP_EXCHANGE choose its network interface)";
    announce_failure(store, rank, why);
    fail(why);
  }

  // Everybody announces itself, so a timeout can say who never came, and
  // takes a numbered slot among the ranks on its host.
  const std::string pid = std::to_string(getpid());
  const std::string whoami = host + "/" + pid + settings;
  store->set(arrived_key(rank), std::vector<uint8_t>(whoami.begin(), whoami.end()));
  const std::string host_key = "oneccl/host/" + host;
  const int64_t slot = store->add(host_key, 1);
  store->set(host_key + "/" + std::to_string(slot), std::vector<uint8_t>(pid.begin(), pid.end()));
  if (store->add(kArrivedCounter, 1) == size) {
    // Checked before any rank passes, so that none enters oneCCL with settings it cannot meet.
    if (const auto differ = settings_disagreement(*store, size); !differ.empty()) {
      set_failure(*store, rank, differ);
    } else {
      store->set(kAllArrivedKey, std::vector<uint8_t>{1});
    }
  }
  try {
    store->wait({kAllArrivedKey, kAddressKey}, timeout);
  } catch (const c10::Error&) {
    const std::string missing = missing_ranks(*store, size);
    // A rank that comes later fails at once with this, rather than waiting out its own timeout
    // inside oneCCL for a rank that has left.
    announce_failure(store, rank, "it waited " + seconds + " s for the other ranks; missing ranks: " + missing);
    fail("rank " + std::to_string(rank) + " waited " + seconds +
         " s for the other ranks of this process group (size " + std::to_string(size) +
         "); missing ranks: " + missing +
         ". Every rank must create the group (init_process_group / new_group) "
         "and none may have exited.");
  }

  // The arrival mark, and the address (rank 0 has its own), in one round trip.
  std::vector<std::string> marks{kAllArrivedKey};
  if (rank != 0) {
    marks.push_back(kAddressKey);
  }
  const auto marked = store->multiGet(marks);
  std::string mark(marked[0].begin(), marked[0].end());
  if (mark.rfind(kFailedMark, 0) != 0 && store->check({kFailedKey})) {
    // A rank gave up (at its timeout) before this one came, and this one, the last to arrive,
    // set its mark over the failure's: the failure stands.
    const auto bytes = store->get(kFailedKey);
    mark = kFailedMark + std::string(bytes.begin(), bytes.end());
  }
  if (mark.rfind(kFailedMark, 0) == 0) {
    fail(mark.substr(std::char_traits<char>::length(kFailedMark)) + " (rank " + std::to_string(rank) +
         " gives up on this process group with it)");
  }

  // One round trip for all of them: a host may hold a hundred ranks.
  std::vector<std::string> slots;
  const int64_t on_host = store->add(host_key, 0);
  for (int64_t i = 1; i <= on_host; ++i) {
    if (i != slot) {
      slots.push_back(host_key + "/" + std::to_string(i));
    }
  }
  std::vector<int> host_peers;
  for (const auto& bytes : slots.empty() ? std::vector<std::vector<uint8_t>>{} : store->multiGet(slots)) {
    host_peers.push_back(std::stoi(std::string(bytes.begin(), bytes.end())));
  }

  Rendezvous met{std::move(opened), std::move(kvs), kvs_server, {}, std::move(host_peers)};
  if (rank != 0) {
    const auto& bytes = marked[1];
    if (bytes.size() != met.address.size()) {
      const std::string why = "oneCCL's key-value store address from rank 0 has " + std::to_string(bytes.size()) +
          " bytes, expected " + std::to_string(met.address.size()) + " (ranks built against different oneCCL versions?)";
      announce_failure(store, rank, why);
      fail("rank " + std::to_string(rank) + ": " + why);
    }
    std::copy(bytes.begin(), bytes.end(), reinterpret_cast<uint8_t*>(met.address.data()));
  }
  return met;
}

void announce_failure(const c10::intrusive_ptr<c10d::Store>& store, int rank, const std::string& why) {
  try {
    set_failure(*store, rank, "rank " + std::to_string(rank) + " could not create its side of this process group: " + why);
  } catch (...) {
    // The store may be unreachable as well: the caller's own error is what matters.
  }
}

std::string announced_failure(const c10::intrusive_ptr<c10d::Store>& store) {
  try {
    if (store->check({kFailedKey})) {
      const auto bytes = store->get(kFailedKey);
      return std::string(bytes.begin(), bytes.end());
    }
  } catch (...) {
    // A store that cannot answer has announced nothing; the caller's deadline still holds.
  }
  return "";
}

std::vector<std::string> exchange(
    const c10::intrusive_ptr<c10d::Store>& store,
    const std::string& key,
    const std::string& mine,
    int rank,
    int size,
    std::chrono::milliseconds timeout) {
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) {
    keys.push_back(key + "/" + std::to_string(r));
  }
  store->set(keys[rank], std::vector<uint8_t>(mine.begin(), mine.end()));
  try {
    store->wait(keys, timeout);
  } catch (const c10::Error&) {
    std::ostringstream missing;
    for (int r = 0; r < size; ++r) {
      if (!store->check({keys[r]})) {
        missing << (missing.tellp() > 0 ? ", " : "") << r;
      }
    }
    fail("rank " + std::to_string(rank) + " waited " + seconds_text(timeout) +
         " s for the other ranks of this process group (" + key + "); missing ranks: " +
         missing.str() + ". Every rank must create the group and none may have exited.");
  }
  std::vector<std::string> all;
  all.reserve(size);
  for (int r = 0; r < size; ++r) {
    auto bytes = store->get(keys[r]);
    all.emplace_back(bytes.begin(), bytes.end());
  }
  return all;
}

} // namespace oneccl_bind_pt

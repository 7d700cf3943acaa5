#include "transport_ccl.hpp"

#include "dtypes.hpp"
#include "errors.hpp"
#include "reduce_ops.hpp"

#include <c10/util/Exception.h>

#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>

namespace oneccl_bind_pt {

namespace {

// `scratch`: two bytes that live as long as the op (see Barrier below).
void issue(ccl::communicator& comm, const Prim& p, std::vector<ccl::event>& events, uint8_t* scratch) {
  using K = Prim::Kind;
  switch (p.kind) {
    case K::Allreduce:
      events.push_back(ccl::allreduce(
          p.src, p.dst, p.count, p.red->dtype, p.red->op, comm, p.red->allreduce_attr()));
      break;
    case K::Reduce:
      events.push_back(ccl::reduce(p.src, p.dst, p.count, p.red->dtype, p.red->op, p.peer, comm));
      break;
    case K::ReduceScatter:
      events.push_back(ccl::reduce_scatter(p.src, p.dst, p.count, p.red->dtype, p.red->op, comm));
      break;
    case K::Broadcast:
      events.push_back(ccl::broadcast(p.dst, p.count, kByteType, p.peer, comm));
      break;
    case K::Allgatherv:
      if (p.dst_list.empty()) {
        events.push_back(ccl::allgatherv(p.src, p.count, p.dst, p.recv_counts, kByteType, comm));
      } else {
        events.push_back(ccl::allgatherv(p.src, p.count, p.dst_list, p.recv_counts, kByteType, comm));
      }
      break;
    case K::Alltoallv:
      events.push_back(ccl::alltoallv(p.src, p.send_counts, p.dst, p.recv_counts, kByteType, comm));
      break;
    case K::Send:
    case K::Recv:
      TORCH_INTERNAL_ASSERT(false, "ccl: send and recv are issued in their line (P2pTurn)");
    case K::Barrier:
      // ccl::barrier blocks the calling thread until every rank arrives, so
      // it could never time out (and barrier(async_op=True) would not be
      // asynchronous). A one-byte allreduce synchronizes the same way but
      // returns an event we poll against the group's timeout like any op.
      events.push_back(ccl::allreduce(
          scratch, scratch + 1, 1, ccl::datatype::uint8, ccl::reduction::sum, comm));
      break;
  }
}

bool is_p2p(const Prim& p) {
  return p.kind == Prim::Kind::Send || p.kind == Prim::Kind::Recv;
}

class CclPending final : public Pending {
 public:
  CclPending(ccl::communicator& comm, const std::function<std::string()>& broken_reason,
             std::vector<std::shared_ptr<P2pTurn>> turns, const char* op, std::vector<Prim> prims)
      : comm_(comm), broken_reason_(broken_reason), op_(op), prims_(std::move(prims)), turns_(std::move(turns)) {
    issue_ready(); // throws if nothing could start (its turns given up: their lines go on)
    constructed_ = true;
  }

  // An op that failed before oneCCL had any of it leaves its buffers to its caller.
  bool buffers_in_use_after_abort() const override { return issued_ > 0; }

  bool poll() override {
    if (issued_ < prims_.size() && issue_error_.empty()) { // skip the walk once all started
      issue_ready();
    }
    while (next_ < events_.size()) {
      if (!events_[next_].test()) {
        return false;
      }
      ++next_;
    }
    for (const auto& turn : turns_) {
      if (!turn->complete()) {
        return false;
      }
    }
    if (!issue_error_.empty()) {
      C10_THROW_ERROR(DistBackendError, issue_error_);
    }
    return issued_ == prims_.size();
  }

 private:
  // Issues every Prim not yet issued that may start: collectives at once, in order; a
  // send or recv once its line lets it. Lines wait only on themselves, not on each other
  // (a batch's recv from one peer never holds back its send to another).
  void issue_ready() {
    if (std::string why = broken_reason_(); !why.empty()) {
      // The group broke (an op before this one timed out or failed), maybe while part of
      // this one waited for its turn: what has not started is never handed to oneCCL.
      give_up_turns();
      const std::string msg = std::string("ccl ") + op_ + ": " +
          (issued_ > 0 ? "not all of it started" : "not started") + ": the process group broke" +
          (constructed_ ? " while it waited for the send or recv before it to or from the same peer: " : ": ") + why;
      if (!constructed_) {
        C10_THROW_ERROR(DistBackendError, msg);
      }
      issue_error_ = msg;
      return;
    }
    for (size_t i = 0, t = 0; i < prims_.size() && issue_error_.empty(); ++i) {
      const Prim& p = prims_[i];
      P2pTurn* turn = is_p2p(p) ? turns_[t++].get() : nullptr;
      try {
        if (started_[i] || (turn && turn->before && !turn->before->complete())) {
          continue;
        }
        if (turn) {
          turn->event = p.kind == Prim::Kind::Send
              ? ccl::send(const_cast<void*>(p.src), p.count, kByteType, p.peer, comm_)
              : ccl::recv(p.dst, p.count, kByteType, p.peer, comm_);
          turn->before.reset();
        } else {
          issue(comm_, p, events_, scratch_);
        }
      } catch (const std::exception& e) {
        const auto msg = std::string("ccl ") + op_ + ": oneCCL rejected the call: " + e.what();
        give_up_turns();
        if (!constructed_ && issued_ == 0) {
          C10_THROW_ERROR(DistBackendError, msg); // nothing started: the group is fine
        }
        // Part of the op is in flight, or it waited for its turn and the ranks have moved
        // on: peers and buffers are in an unknown state (poll() reports it).
        issue_error_ = msg + (issued_ > 0 ? " (after part of it had started)" : " (after waiting for its turn)");
        return;
      }
      started_[i] = true;
      ++issued_;
    }
  }

  // The turns not issued will never be: the ops after them in their lines go ahead.
  void give_up_turns() {
    for (const auto& turn : turns_) {
      if (!turn->event) {
        turn->before.reset();
        turn->done = true;
      }
    }
  }

  ccl::communicator& comm_;
  const std::function<std::string()>& broken_reason_; // the transport's: it outlives its ops
  const char* op_;
  std::vector<Prim> prims_; // oneCCL may refer to their count vectors until done
  std::vector<std::shared_ptr<P2pTurn>> turns_; // one per send/recv Prim, in order
  std::vector<ccl::event> events_;
  // The barrier's allreduce buffers: here, since an op that timed out is
  // kept (never freed) with its Pending while oneCCL may still write them.
  uint8_t scratch_[2] = {0, 0};
  std::vector<bool> started_ = std::vector<bool>(prims_.size()); // per Prim: handed to oneCCL
  size_t next_ = 0;   // the first event not yet seen done
  size_t issued_ = 0; // Prims handed to oneCCL
  bool constructed_ = false;
  std::string issue_error_;
};

} // namespace

bool P2pTurn::complete() {
  if (!done && event && event->test()) {
    done = true;
  }
  return done;
}

std::unique_ptr<Pending> CclTransport::start(const char* op, std::vector<Prim> prims) {
  // The turns join their lines only once the op exists: an op that failed to start (it
  // throws) leaves no turn for later ones to wait on.
  std::vector<std::shared_ptr<P2pTurn>> turns;
  std::map<std::pair<int, bool>, std::shared_ptr<P2pTurn>> last;
  for (const auto& p : prims) {
    if (is_p2p(p)) {
      const std::pair<int, bool> line{p.peer, p.kind == Prim::Kind::Send};
      auto it = last.find(line);
      std::shared_ptr<P2pTurn> before = it != last.end() ? it->second : nullptr;
      if (!before) {
        auto known = lines_.find(line);
        before = known != lines_.end() ? known->second : nullptr;
      }
      auto turn = std::make_shared<P2pTurn>();
      turn->before = before && !before->done ? before : nullptr;
      last[line] = turn;
      turns.push_back(std::move(turn));
    }
  }
  auto pending = std::make_unique<CclPending>(comm_, broken_reason_, std::move(turns), op, std::move(prims));
  for (auto& [line, turn] : last) {
    lines_[line] = std::move(turn);
  }
  return pending;
}

namespace {

// oneCCL reads its variables in ccl::init() and reports each one that differs
// from its default on stdout, CCL_LOG_LEVEL too: that report is made before the
// level applies, so the package's own default (CCL_LOG_LEVEL=error, which hides
// the others) printed one oneCCL line at every start. While init runs at that
// level, stdout goes through a pipe whose reader passes every line on as it comes,
// except that one. The reader stops once init is over and the pipe is drained (not
// at the pipe's end: a child forked meanwhile may hold its write end for good).
class WithoutLogLevelNotice {
 public:
  WithoutLogLevelNotice() {
    const char* level = std::getenv("CCL_LOG_LEVEL");
    if (!level || std::strcmp(level, "error") != 0 || pipe2(pipe_, O_CLOEXEC) != 0) {
      return;
    }
    std::fflush(stdout);
    out_ = fcntl(STDOUT_FILENO, F_DUPFD_CLOEXEC, 0);
    if (out_ < 0) {
      close_pipe();
      return;
    }
    try {
      reader_ = std::thread([this] { pass_on(); });
    } catch (...) {
      close(out_);
      out_ = -1;
      close_pipe();
      return;
    }
    if (dup2(pipe_[1], STDOUT_FILENO) < 0) {
      restore();
    }
  }
  ~WithoutLogLevelNotice() {
    restore();
  }
  WithoutLogLevelNotice(const WithoutLogLevelNotice&) = delete;
  WithoutLogLevelNotice& operator=(const WithoutLogLevelNotice&) = delete;

 private:
  void restore() {
    if (out_ < 0) {
      return;
    }
    std::fflush(stdout);
    dup2(out_, STDOUT_FILENO);
    done_.store(true, std::memory_order_release);
    reader_.join();
    close(out_);
    out_ = -1;
    close_pipe();
  }

  void close_pipe() {
    for (int& fd : pipe_) {
      if (fd >= 0) {
        close(fd);
        fd = -1;
      }
    }
  }

  void pass_on() {
    std::string line;
    char buf[4096];
    for (;;) {
      pollfd p{pipe_[0], POLLIN, 0};
      const int ready = poll(&p, 1, 20);
      if (ready == 0 || (ready < 0 && errno != EINTR)) {
        if (done_.load(std::memory_order_acquire)) {
          break; // init is over and nothing is left to read
        }
        continue;
      }
      const ssize_t n = ready > 0 ? read(pipe_[0], buf, sizeof buf) : -1;
      if (n == 0) {
        break;
      }
      for (ssize_t i = 0; i < n; ++i) {
        line += buf[i];
        if (buf[i] == '\n') {
          emit(line);
          line.clear();
        }
      }
    }
    emit(line);
  }

  void emit(const std::string& line) const {
    if (line.empty() || line.find("value of CCL_LOG_LEVEL changed") != std::string::npos) {
      return;
    }
    for (size_t done = 0; done < line.size();) {
      const ssize_t n = write(out_, line.data() + done, line.size() - done);
      if (n < 0 && errno == EINTR) {
        continue;
      }
      if (n <= 0) {
        return;
      }
      done += static_cast<size_t>(n);
    }
  }

  int pipe_[2] = {-1, -1};
  int out_ = -1; // the real stdout, while init writes to the pipe
  std::atomic<bool> done_{false};
  std::thread reader_;
};

} // namespace

void ensure_ccl_initialized() {
  static std::once_flag once;
  std::call_once(once, [] {
    try {
      const WithoutLogLevelNotice quiet;
      ccl::init();
    } catch (const ccl::exception& e) {
      C10_THROW_ERROR(
          DistBackendError, std::string("ccl: oneCCL failed to initialize: ") + e.what());
    }
  });
}

} // namespace oneccl_bind_pt

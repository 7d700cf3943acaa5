// The wheel's platform tag is manylinux_2_28, torch's own: it must run on glibc 2.28 and
// the libstdc++ of GCC 8. Linking on a newer distribution binds some references (ours,
// oneCCL's static archive's, and those inlined from newer libstdc++ headers) to symbol
// versions added later: glibc 2.34 moved libpthread and libdl into libc under new
// versions, 2.33 exported fstat, 2.32/2.29 re-versioned a few functions, GCC 12's
// libstdc++ re-versioned condition_variable::wait. setup.py links with
// -Wl,--wrap=<symbol> for each symbol below, so every reference lands on the __wrap_
// function here, which calls the version glibc 2.28 (or GCC 8's libstdc++) already had.
// scripts/build_wheels.py lists what pins the tag, so a new pin shows up there.
#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/stat.h>
#include <time.h>

#include <condition_variable>
#include <mutex>

// Declares <name>_old as the function <name> at an older version, and __wrap_<name>
// forwarding to it with the same signature.
#define OLD_VERSION(name, version)                                      \
  extern "C" decltype(::name) name##_old;                               \
  __asm__(".symver " #name "_old," #name "@" version);
// Hidden: the wrappers serve this library's own references, not other libraries'.
#define HIDDEN __attribute__((visibility("hidden")))
#define FORWARD(ret, name, params, args)        \
  extern "C" HIDDEN ret __wrap_##name params {  \
    return name##_old args;                     \
  }

OLD_VERSION(pthread_create, "GLIBC_2.2.5")
FORWARD(int, pthread_create,
        (pthread_t * t, const pthread_attr_t* a, void* (*f)(void*), void* arg),
        (t, a, f, arg))
OLD_VERSION(pthread_join, "GLIBC_2.2.5")
FORWARD(int, pthread_join, (pthread_t t, void** r), (t, r))
OLD_VERSION(pthread_once, "GLIBC_2.2.5")
FORWARD(int, pthread_once, (pthread_once_t * o, void (*f)(void)), (o, f))
OLD_VERSION(pthread_barrier_init, "GLIBC_2.2.5")
FORWARD(int, pthread_barrier_init,
        (pthread_barrier_t * b, const pthread_barrierattr_t* a, unsigned n),
        (b, a, n))
OLD_VERSION(pthread_barrier_wait, "GLIBC_2.2.5")
FORWARD(int, pthread_barrier_wait, (pthread_barrier_t * b), (b))
OLD_VERSION(pthread_setaffinity_np, "GLIBC_2.3.4")
FORWARD(int, pthread_setaffinity_np,
        (pthread_t t, size_t n, const cpu_set_t* s), (t, n, s))
OLD_VERSION(pthread_getaffinity_np, "GLIBC_2.3.4")
FORWARD(int, pthread_getaffinity_np, (pthread_t t, size_t n, cpu_set_t* s),
        (t, n, s))
OLD_VERSION(pthread_attr_setaffinity_np, "GLIBC_2.3.4")
FORWARD(int, pthread_attr_setaffinity_np,
        (pthread_attr_t * a, size_t n, const cpu_set_t* s), (a, n, s))
OLD_VERSION(pthread_mutex_trylock, "GLIBC_2.2.5")
FORWARD(int, pthread_mutex_trylock, (pthread_mutex_t * m), (m))
OLD_VERSION(pthread_setname_np, "GLIBC_2.12")
FORWARD(int, pthread_setname_np, (pthread_t t, const char* name), (t, name))
OLD_VERSION(pthread_sigmask, "GLIBC_2.2.5")
FORWARD(int, pthread_sigmask, (int how, const sigset_t* set, sigset_t* old), (how, set, old))
OLD_VERSION(pthread_getcpuclockid, "GLIBC_2.2.5")
FORWARD(int, pthread_getcpuclockid, (pthread_t t, clockid_t* c), (t, c))
// Not in the headers: pthread_key_create's alias, which libstdc++'s headers call.
extern "C" int __pthread_key_create(pthread_key_t*, void (*)(void*));
OLD_VERSION(__pthread_key_create, "GLIBC_2.2.5")
FORWARD(int, __pthread_key_create, (pthread_key_t * k, void (*d)(void*)),
        (k, d))

// Before 2.34 these lived in libdl.so.2 (which setup.py links with -ldl) at these versions.
OLD_VERSION(dlopen, "GLIBC_2.2.5")
FORWARD(void*, dlopen, (const char* f, int m), (f, m))
OLD_VERSION(dlsym, "GLIBC_2.2.5")
FORWARD(void*, dlsym, (void* h, const char* s), (h, s))
OLD_VERSION(dlclose, "GLIBC_2.2.5")
FORWARD(int, dlclose, (void* h), (h))
OLD_VERSION(dlerror, "GLIBC_2.2.5")
FORWARD(char*, dlerror, (void), ())
OLD_VERSION(dladdr, "GLIBC_2.2.5")
FORWARD(int, dladdr, (const void* a, Dl_info* i), (a, i))
OLD_VERSION(dlinfo, "GLIBC_2.3.3")
FORWARD(int, dlinfo, (void* h, int r, void* a), (h, r, a))

// log2@GLIBC_2.29 only dropped a wrapper that set errno; the result is the same.
// (Declared by hand: <math.h> overloads log2 in C++.)
extern "C" double log2_old(double);
__asm__(".symver log2_old,log2@GLIBC_2.2.5");
FORWARD(double, log2, (double x), (x))

// fstat is exported since 2.33; before, <sys/stat.h> inlined a call to __fxstat.
extern "C" int __fxstat_old(int, int, struct stat*);
__asm__(".symver __fxstat_old,__fxstat@GLIBC_2.2.5");
extern "C" HIDDEN int __wrap_fstat(int fd, struct stat* buf) {
  return __fxstat_old(1 /* _STAT_VER_LINUX on x86_64 */, fd, buf);
}

// pthread_cond_clockwait (2.30) waits on the caller's clock. Before it, libstdc++ waited
// on CLOCK_REALTIME: do the same, translating a CLOCK_MONOTONIC deadline into the
// remaining time from now. Callers re-check their deadline after waking, so a change of
// the wall clock during the wait only moves the wake-up, as with GCC 8's libstdc++.
extern "C" int pthread_cond_timedwait_old(
    pthread_cond_t*, pthread_mutex_t*, const struct timespec*);
__asm__(".symver pthread_cond_timedwait_old,pthread_cond_timedwait@GLIBC_2.3.2");
extern "C" HIDDEN int __wrap_pthread_cond_clockwait(
    pthread_cond_t* c, pthread_mutex_t* m, clockid_t clock,
    const struct timespec* deadline) {
  if (clock == CLOCK_REALTIME) {
    return pthread_cond_timedwait_old(c, m, deadline);
  }
  struct timespec now_clock, now_real;
  clock_gettime(clock, &now_clock);
  clock_gettime(CLOCK_REALTIME, &now_real);
  long long left_ns = (deadline->tv_sec - now_clock.tv_sec) * 1000000000LL +
      (deadline->tv_nsec - now_clock.tv_nsec);
  if (left_ns < 0) {
    left_ns = 0;
  }
  long long at_ns = now_real.tv_sec * 1000000000LL + now_real.tv_nsec + left_ns;
  struct timespec at = {static_cast<time_t>(at_ns / 1000000000LL),
                        static_cast<long>(at_ns % 1000000000LL)};
  return pthread_cond_timedwait_old(c, m, &at);
}

// libstdc++ (GCC 11+) headers read this glibc 2.32 flag to skip atomics in a process
// with one thread; 0 ("maybe several threads") keeps the atomics, always correct.
extern "C" {
HIDDEN char __wrap___libc_single_threaded = 0;
}

// GCC 12's libstdc++ added condition_variable::wait@GLIBCXX_3.4.30; 3.4.11 is the same
// function.
extern "C" void cv_wait_old(std::condition_variable*, std::unique_lock<std::mutex>*);
__asm__(".symver cv_wait_old,_ZNSt18condition_variable4waitERSt11unique_lockISt5mutexE@GLIBCXX_3.4.11");
extern "C" HIDDEN void __wrap__ZNSt18condition_variable4waitERSt11unique_lockISt5mutexE(
    std::condition_variable* cv, std::unique_lock<std::mutex>* lock) {
  cv_wait_old(cv, lock);
}

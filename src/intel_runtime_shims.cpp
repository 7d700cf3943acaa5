// oneCCL's CPU static archive is compiled by Intel's compiler and references
// a few symbols of its runtime. These stand-ins let g++ link it without
// shipping that runtime: the memcpy/memset entry points forward to libc, and
// the ITT (VTune tracing) hooks stay null, which ITT treats as "not collecting".
#include <cstddef>
#include <cstring>

extern "C" {

void* _intel_fast_memcpy(void* dst, const void* src, size_t n) {
  return std::memcpy(dst, src, n);
}

void* _intel_fast_memset(void* dst, int value, size_t n) {
  return std::memset(dst, value, n);
}

void* __itt_domain_create_ptr__3_0 = nullptr;
void* __itt_event_create_ptr__3_0 = nullptr;
void* __itt_event_end_ptr__3_0 = nullptr;
void* __itt_event_start_ptr__3_0 = nullptr;
void* __itt_metadata_add_ptr__3_0 = nullptr;
void* __itt_string_handle_create_ptr__3_0 = nullptr;
void* __itt_task_begin_ptr__3_0 = nullptr;
void* __itt_task_end_ptr__3_0 = nullptr;
void* __itt_thread_set_name_ptr__3_0 = nullptr;

} // extern "C"

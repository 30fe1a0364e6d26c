// The body of the PyTorch pluggable-allocator `malloc` (exported by the Rust
// trampoline `tidepool_torch_malloc`, since a Rust shared library exports
// only Rust symbols). PyTorch takes a NULL result for
// success (the tensor would get address 0), so a failure must be thrown.
// PyTorch turns a std::runtime_error into a Python RuntimeError; the text of
// an out-of-memory failure starts like PyTorch's own ("CUDA out of memory.
// Tried to allocate ..."), so code that matches on it keeps working.

#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <sys/types.h>

extern "C" {
// From the Rust side of libtidepool (see include/tidepool.h).
int tidepool_torch_try_malloc(ssize_t size, int device, void* stream, void** out);
const char* tidepool_last_error(void);
}

namespace {

// Status codes of include/tidepool.h that mean "no memory".
constexpr int kOutOfMemory = 2;
constexpr int kTooLarge = 11;

std::string human_size(ssize_t size) {
  char buf[64];
  double b = static_cast<double>(size);
  if (b >= 1024.0 * 1024.0 * 1024.0) {
    std::snprintf(buf, sizeof buf, "%.2f GiB", b / (1024.0 * 1024.0 * 1024.0));
  } else if (b >= 1024.0 * 1024.0) {
    std::snprintf(buf, sizeof buf, "%.2f MiB", b / (1024.0 * 1024.0));
  } else {
    std::snprintf(buf, sizeof buf, "%zd bytes", size);
  }
  return buf;
}

}  // namespace

extern "C" void* tidepool_shim_torch_malloc(ssize_t size, int device, void* stream) {
  void* ptr = nullptr;
  int status = tidepool_torch_try_malloc(size, device, stream, &ptr);
  if (status == 0) {
    return ptr;
  }
  const char* detail = tidepool_last_error();
  std::string msg;
  if (status == kOutOfMemory || status == kTooLarge) {
    msg = "CUDA out of memory. Tried to allocate " + human_size(size) + " on device " +
          std::to_string(device) + " (tidepool). " + detail;
  } else {
    msg = "tidepool: allocation of " + human_size(size) + " on device " +
          std::to_string(device) + " failed: " + detail;
  }
  throw std::runtime_error(msg);
}

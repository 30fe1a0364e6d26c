// The C++ PyTorch malloc never returns NULL for a failed request: it
// throws. Run where no CUDA driver exists, so the default pool cannot be
// created and every request fails. Exits 0 and prints "shim checks passed".

#include "tidepool.h"

#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>

int main() {
    if (tidepool_cuda_available()) {
        std::printf("CUDA present: the shim is checked by the PyTorch tests\n");
        std::printf("shim checks passed\n");
        return 0;
    }
    try {
        void* p = tidepool_torch_malloc(1 << 20, 0, nullptr);
        std::fprintf(stderr, "FAILED: tidepool_torch_malloc returned %p instead of throwing\n", p);
        return 1;
    } catch (const std::runtime_error& e) {
        std::string msg = e.what();
        if (msg.find("tidepool") == std::string::npos ||
            msg.find("driver") == std::string::npos) {
            std::fprintf(stderr, "FAILED: unexpected message: %s\n", msg.c_str());
            return 1;
        }
    }
    std::printf("shim checks passed\n");
    return 0;
}

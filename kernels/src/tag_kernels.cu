// tidepool-kernels: the tag kernels, compiled at run time by NVRTC.
//
// No #include: NVRTC compiles this with its built-in declarations only.
// The 32-bit word at byte address a holds  tag ^ tp_mix(a >> 2).  The host
// twin of tp_mix is `tag_word` in src/lib.rs; keep the two identical (the
// CUDA tests check a GPU fill against it word for word).

__device__ __forceinline__ unsigned tp_mix(unsigned long long w)
{
    unsigned x = (unsigned)w ^ ((unsigned)(w >> 32) * 0x9E3779B9u) ^ 0x6A09E667u;
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    x ^= x >> 16;
    return x;
}

__device__ __forceinline__ unsigned long long tp_globaltimer()
{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Grid-stride fill of nwords 32-bit words at p.
extern "C" __global__ void fill_tag(unsigned* p, unsigned long long nwords, unsigned tag)
{
    const unsigned long long base = ((unsigned long long)p) >> 2;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < nwords; i += stride) {
        p[i] = tag ^ tp_mix(base + i);
    }
}

// Grid-stride check; each thread adds its count of mismatching words to
// *errors (one atomic per thread, and only when it found any).
extern "C" __global__ void verify_tag(const unsigned* p, unsigned long long nwords, unsigned tag,
                                      unsigned long long* errors)
{
    const unsigned long long base = ((unsigned long long)p) >> 2;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long bad = 0;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < nwords; i += stride) {
        bad += (p[i] != (tag ^ tp_mix(base + i))) ? 1ull : 0ull;
    }
    if (bad != 0) {
        atomicAdd(errors, bad);
    }
}

// Keep the stream busy for about ns nanoseconds of the global timer
// (launched as one thread of one block).
extern "C" __global__ void spin(unsigned long long ns)
{
    const unsigned long long start = tp_globaltimer();
    for (;;) {
        const unsigned long long elapsed = tp_globaltimer() - start;
        if (elapsed >= ns) {
            break;
        }
        const unsigned long long left = ns - elapsed;
        const unsigned nap = left > 100000ull ? 100000u : (unsigned)left;
        asm volatile("nanosleep.u32 %0;" ::"r"(nap));
    }
}

/* The machine's own ceiling for the `threads` bench: each of T threads runs
 * a fixed number of steps of a private, dependent integer chain (no shared
 * memory, no allocation), and the program prints the aggregate steps per
 * second for T = 1, 2, 4, 8, 16 and the 16-thread speed-up over one thread.
 * A pool cannot scale better than this on the same machine.
 * Build and run on the GPU machine (gcc is there, Rust is not):
 *   gcc -O2 -pthread benches/scripts/cpu_scaling.c -o /tmp/cpu_scaling && /tmp/cpu_scaling
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>

#define STEPS 200000000ULL

static void *chain(void *arg) {
    uint64_t x = (uint64_t)(uintptr_t)arg | 1;
    for (uint64_t i = 0; i < STEPS; i++) {
        x ^= x << 13; x ^= x >> 7; x ^= x << 17;
    }
    return (void *)(uintptr_t)x;
}

static double run(int threads) {
    pthread_t t[64];
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (int i = 0; i < threads; i++) pthread_create(&t[i], NULL, chain, (void *)(uintptr_t)(i + 1));
    uint64_t sink = 0;
    for (int i = 0; i < threads; i++) { void *r; pthread_join(t[i], &r); sink ^= (uint64_t)(uintptr_t)r; }
    clock_gettime(CLOCK_MONOTONIC, &b);
    double s = (b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) * 1e-9;
    double rate = threads * (double)STEPS / s;
    printf("threads %2d: %.3f G steps/s (sink %llx)\n", threads, rate * 1e-9, (unsigned long long)(sink & 0xff));
    return rate;
}

int main(void) {
    double one = run(1);
    run(2); run(4); run(8);
    double sixteen = run(16);
    printf("16 threads / 1 thread = %.2fx\n", sixteen / one);
    return 0;
}

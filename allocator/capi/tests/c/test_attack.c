/* Misuse of the C API, as a C programmer who only read tidepool.h might
 * commit it, on the host backend: NULL handles, foreign and interior
 * pointers, impossible sizes, retired and unknown streams, lowered maxima
 * under live memory, several threads at once, per-thread errors, and the
 * default-pool functions where no CUDA driver exists. Every misuse must give
 * a documented status and leave the pool working; nothing may crash or
 * corrupt live data. Compiled against include/tidepool.h and run by
 * tests/c_api.rs. Exits 0 and prints "all attack checks passed" when every
 * check holds; prints each failed check and exits 1 otherwise. */

#define _POSIX_C_SOURCE 200809L

#include "tidepool.h"

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures = 0;
static pthread_mutex_t report_lock = PTHREAD_MUTEX_INITIALIZER;

#define FAIL(...)                                                          \
    do {                                                                   \
        pthread_mutex_lock(&report_lock);                                  \
        fprintf(stderr, "FAILED %s:%d: ", __FILE__, __LINE__);             \
        fprintf(stderr, __VA_ARGS__);                                      \
        fprintf(stderr, "\n");                                             \
        failures++;                                                        \
        pthread_mutex_unlock(&report_lock);                                \
    } while (0)

#define CHECK(cond)                                                        \
    do {                                                                   \
        if (!(cond))                                                       \
            FAIL("%s (last error: %s)", #cond, tidepool_last_error());     \
    } while (0)

#define CHECK_STATUS(call, expected)                                       \
    do {                                                                   \
        tidepool_status got_ = (call);                                     \
        if (got_ != (expected))                                            \
            FAIL("%s returned %d (%s), expected %s (last error: %s)",      \
                 #call, (int)got_, tidepool_status_string(got_),           \
                 tidepool_status_string(expected),                         \
                 tidepool_last_error());                                   \
    } while (0)

#define MiB ((uint64_t)1 << 20)

static tidepool_pool *host_pool(uint64_t capacity, uint64_t max_size) {
    tidepool_config cfg;
    CHECK_STATUS(tidepool_config_init(&cfg), TIDEPOOL_OK);
    cfg.backend = TIDEPOOL_BACKEND_HOST;
    cfg.host_capacity = capacity;
    cfg.va_size = 4 * capacity;
    cfg.max_size = max_size;
    tidepool_pool *pool = NULL;
    CHECK_STATUS(tidepool_pool_create(&cfg, &pool), TIDEPOOL_OK);
    if (pool == NULL) {
        fprintf(stderr, "cannot go on without a pool\n");
        exit(1);
    }
    return pool;
}

static void fill(void *p, size_t n, unsigned seed) {
    unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        b[i] = (unsigned char)(seed * 131u + i * 7u);
}

static int intact(const void *p, size_t n, unsigned seed) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        if (b[i] != (unsigned char)(seed * 131u + i * 7u))
            return 0;
    return 1;
}

/* --- status strings -------------------------------------------------- */

static void status_strings(void) {
    const char *seen[TIDEPOOL_ERROR_PANIC + 1];
    for (int s = TIDEPOOL_OK; s <= TIDEPOOL_ERROR_PANIC; s++) {
        const char *name = tidepool_status_string((tidepool_status)s);
        CHECK(name != NULL && strncmp(name, "TIDEPOOL_", 9) == 0);
        seen[s] = name;
        for (int t = 0; t < s; t++)
            CHECK(strcmp(seen[t], name) != 0);
    }
    /* A value outside the enumeration (a C int may hold anything, e.g. a
     * status read back from a file or another library version) must give a
     * string, not undefined behaviour. */
    const int bogus[] = {14, 99, -1, 0x7fffffff};
    for (size_t i = 0; i < sizeof bogus / sizeof bogus[0]; i++) {
        const char *name = tidepool_status_string((tidepool_status)bogus[i]);
        if (name == NULL || strstr(name, "UNKNOWN") == NULL)
            FAIL("tidepool_status_string(%d) gave \"%s\", expected an UNKNOWN name",
                 bogus[i], name ? name : "(null)");
    }
}

/* --- NULL everywhere ------------------------------------------------- */

static void null_arguments(void) {
    tidepool_stream s = 0;
    void *p = NULL;
    tidepool_stats st;
    tidepool_config cfg;
    const tidepool_status A = TIDEPOOL_ERROR_INVALID_ARGUMENT;
    CHECK_STATUS(tidepool_config_init(NULL), A);
    CHECK_STATUS(tidepool_config_init(&cfg), TIDEPOOL_OK);
    tidepool_pool *pool = NULL;
    CHECK_STATUS(tidepool_pool_create(NULL, &pool), A);
    CHECK_STATUS(tidepool_pool_create(&cfg, NULL), A);
    CHECK_STATUS(tidepool_pool_destroy(NULL), A);
    CHECK_STATUS(tidepool_set_default_config(NULL), A);
    CHECK_STATUS(tidepool_default_pool(0, NULL), A);
    CHECK_STATUS(tidepool_stream_default(NULL, &s), A);
    CHECK_STATUS(tidepool_stream_create(NULL, &s), A);
    CHECK_STATUS(tidepool_stream_from_raw(NULL, NULL, &s), A);
    CHECK_STATUS(tidepool_stream_retire(NULL, 1), A);
    CHECK_STATUS(tidepool_stream_retire_raw(NULL, NULL), A);
    CHECK_STATUS(tidepool_alloc_async(NULL, 64, 0, &p), A);
    CHECK_STATUS(tidepool_free_async(NULL, NULL, 0), A);
    CHECK_STATUS(tidepool_alloc_async_raw(NULL, 64, NULL, &p), A);
    CHECK_STATUS(tidepool_free_async_raw(NULL, NULL, NULL), A);
    CHECK_STATUS(tidepool_record_use(NULL, NULL, 0), A);
    CHECK_STATUS(tidepool_stream_synchronize(NULL, 0), A);
    CHECK_STATUS(tidepool_synchronize(NULL), A);
    CHECK_STATUS(tidepool_trim_to(NULL, 0, NULL), A);
    CHECK_STATUS(tidepool_set_max_size(NULL, 0), A);
    CHECK_STATUS(tidepool_set_release_threshold(NULL, 0), A);
    CHECK_STATUS(tidepool_get_stats(NULL, &st), A);
    CHECK_STATUS(tidepool_reset_peaks(NULL), A);

    pool = host_pool(16 * MiB, 0);
    CHECK_STATUS(tidepool_stream_default(pool, NULL), A);
    CHECK_STATUS(tidepool_stream_create(pool, NULL), A);
    CHECK_STATUS(tidepool_stream_from_raw(pool, NULL, NULL), A);
    CHECK_STATUS(tidepool_stream_default(pool, &s), TIDEPOOL_OK);
    CHECK_STATUS(tidepool_alloc_async(pool, 64, s, NULL), A);
    CHECK_STATUS(tidepool_alloc_async_raw(pool, 64, NULL, NULL), A);
    CHECK_STATUS(tidepool_get_stats(pool, NULL), A);
    /* NULL frees are no-ops; a NULL record_use names no allocation. */
    CHECK_STATUS(tidepool_free_async(pool, NULL, s), TIDEPOOL_OK);
    CHECK_STATUS(tidepool_free_async_raw(pool, NULL, NULL), TIDEPOOL_OK);
    CHECK_STATUS(tidepool_get_stats(pool, &st), TIDEPOOL_OK);
    CHECK(st.used_current == 0);
    CHECK_STATUS(tidepool_pool_destroy(pool), TIDEPOOL_OK);
}

/* --- configuration values a C caller can write ---------------------- */

static void bad_configs(void) {
    tidepool_config cfg;
    tidepool_pool *pool = NULL;
    CHECK_STATUS(tidepool_config_init(&cfg), TIDEPOOL_OK);
    cfg.backend = TIDEPOOL_BACKEND_HOST;
    cfg.host_capacity = 16 * MiB;
    cfg.page_size = 3; /* not a power of two */
    CHECK_STATUS(tidepool_pool_create(&cfg, &pool), TIDEPOOL_ERROR_INVALID_ARGUMENT);
    CHECK(pool == NULL);
    CHECK(strlen(tidepool_last_error()) > 0);

    /* A backend value outside the enumeration (a typo, an int from a
     * config file) is an invalid argument, not undefined behaviour. */
    CHECK_STATUS(tidepool_config_init(&cfg), TIDEPOOL_OK);
    *(int *)&cfg.backend = 7;
    pool = NULL;
    CHECK_STATUS(tidepool_pool_create(&cfg, &pool), TIDEPOOL_ERROR_INVALID_ARGUMENT);
    CHECK(pool == NULL);
    CHECK(strstr(tidepool_last_error(), "backend") != NULL);
    CHECK_STATUS(tidepool_set_default_config(&cfg), TIDEPOOL_ERROR_INVALID_ARGUMENT);
}

/* --- pointers that are not this pool's allocations ------------------- */

static void foreign_and_interior_pointers(void) {
    tidepool_pool *a = host_pool(16 * MiB, 0);
    tidepool_pool *b = host_pool(16 * MiB, 0);
    tidepool_stream sa, sb;
    CHECK_STATUS(tidepool_stream_default(a, &sa), TIDEPOOL_OK);
    CHECK_STATUS(tidepool_stream_default(b, &sb), TIDEPOOL_OK);
    void *pa = NULL, *pb = NULL;
    CHECK_STATUS(tidepool_alloc_async(a, MiB, sa, &pa), TIDEPOOL_OK);
    CHECK_STATUS(tidepool_alloc_async(b, MiB, sb, &pb), TIDEPOOL_OK);
    fill(pa, MiB, 1);
    fill(pb, MiB, 2);

    /* b's pointer freed in a: refused, and both allocations stay live. */
    CHECK_STATUS(tidepool_free_async(a, pb, sa), TIDEPOOL_ERROR_WRONG_POOL);
    CHECK_STATUS(tidepool_record_use(a, pb, sa), TIDEPOOL_ERROR_WRONG_POOL);
    /* An address inside an allocation. */
    CHECK_STATUS(tidepool_free_async(a, (char *)pa + 64, sa),
                 TIDEPOOL_ERROR_INVALID_POINTER);
    CHECK_STATUS(tidepool_record_use(a, (char *)pa + 64, sa),
                 TIDEPOOL_ERROR_INVALID_POINTER);
    /* An ordinary host address (the stack, malloc). */
    int local = 0;
    void *heap = malloc(64);
    tidepool_status st1 = tidepool_free_async(a, &local, sa);
    CHECK(st1 == TIDEPOOL_ERROR_WRONG_POOL || st1 == TIDEPOOL_ERROR_INVALID_POINTER);
    tidepool_status st2 = tidepool_free_async(a, heap, sa);
    CHECK(st2 == TIDEPOOL_ERROR_WRONG_POOL || st2 == TIDEPOOL_ERROR_INVALID_POINTER);
    free(heap);

    tidepool_stats st;
    CHECK_STATUS(tidepool_get_stats(a, &st), TIDEPOOL_OK);
    CHECK(st.used_current == MiB && st.frees == 0);
    CHECK_STATUS(tidepool_get_stats(b, &st), TIDEPOOL_OK);
    CHECK(st.used_current == MiB && st.frees == 0);
    CHECK(intact(pa, MiB, 1));
    CHECK(intact(pb, MiB, 2));

    /* A stream id of pool b used in pool a. */
    tidepool_stream sb2;
    CHECK_STATUS(tidepool_stream_create(b, &sb2), TIDEPOOL_OK);
    void *q = NULL;
    CHECK_STATUS(tidepool_alloc_async(a, 4096, sb2, &q), TIDEPOOL_ERROR_INVALID_STREAM);
    /* Refused because it is b's, not by luck: on a GPU, two pools' stream
     * ids can coincide. */
    if (strstr(tidepool_last_error(), "another pool") == NULL)
        FAIL("a stream of pool b used in pool a: %s", tidepool_last_error());
    /* Pool b's default stream is not pool a's either. */
    CHECK_STATUS(tidepool_alloc_async(a, 4096, sb, &q), TIDEPOOL_ERROR_INVALID_STREAM);
    CHECK_STATUS(tidepool_record_use(a, pa, sb), TIDEPOOL_ERROR_INVALID_STREAM);
    CHECK_STATUS(tidepool_record_use(a, pa, sb2), TIDEPOOL_ERROR_INVALID_STREAM);
    CHECK_STATUS(tidepool_free_async(a, pa, sb2), TIDEPOOL_ERROR_INVALID_STREAM);
    CHECK_STATUS(tidepool_stream_synchronize(a, sb2), TIDEPOOL_ERROR_INVALID_STREAM);
    CHECK_STATUS(tidepool_stream_retire(a, sb2), TIDEPOOL_ERROR_INVALID_STREAM);
    /* The refused calls changed nothing in either pool. */
    CHECK_STATUS(tidepool_get_stats(a, &st), TIDEPOOL_OK);
    CHECK(st.used_current == MiB && st.frees == 0);
    CHECK(intact(pa, MiB, 1));

    /* Double free: an error, and nothing changes. */
    CHECK_STATUS(tidepool_free_async(a, pa, sa), TIDEPOOL_OK);
    CHECK_STATUS(tidepool_free_async(a, pa, sa), TIDEPOOL_ERROR_DOUBLE_FREE);
    CHECK_STATUS(tidepool_record_use(a, pa, sa), TIDEPOOL_ERROR_DOUBLE_FREE);
    CHECK_STATUS(tidepool_get_stats(a, &st), TIDEPOOL_OK);
    CHECK(st.used_current == 0 && st.frees == 1);

    CHECK_STATUS(tidepool_free_async(b, pb, sb), TIDEPOOL_OK);
    CHECK_STATUS(tidepool_stream_retire(b, sb2), TIDEPOOL_OK);
    CHECK_STATUS(tidepool_pool_destroy(a), TIDEPOOL_OK);
    CHECK_STATUS(tidepool_pool_destroy(b), TIDEPOOL_OK);
}

/* --- sizes ------------------------------------------------------------ */

static void sizes(void) {
    tidepool_pool *pool = host_pool(16 * MiB, 0);
    tidepool_stream s;
    CHECK_STATUS(tidepool_stream_default(pool, &s), TIDEPOOL_OK);
    void *p = (void *)1;
    CHECK_STATUS(tidepool_alloc_async(pool, 0, s, &p), TIDEPOOL_OK);
    CHECK(p == NULL);

    const size_t huge[] = {SIZE_MAX, SIZE_MAX - 4095, SIZE_MAX / 2 + 1,
                           (size_t)1 << 62, 64 * MiB + 1, 17 * MiB};
    for (size_t i = 0; i < sizeof huge / sizeof huge[0]; i++) {
        p = (void *)1;
        tidepool_status r = tidepool_alloc_async(pool, huge[i], s, &p);
        if (r != TIDEPOOL_ERROR_TOO_LARGE && r != TIDEPOOL_ERROR_OUT_OF_MEMORY)
            FAIL("alloc of %zu bytes gave %s: %s", huge[i], tidepool_status_string(r),
                 tidepool_last_error());
        CHECK(strlen(tidepool_last_error()) > 0);
    }
    /* The pool still works at its full capacity afterwards. */
    p = NULL;
    CHECK_STATUS(tidepool_alloc_async(pool, 16 * MiB, s, &p), TIDEPOOL_OK);
    if (p) {
        fill(p, 16 * MiB, 3);
        CHECK(intact(p, 16 * MiB, 3));
    }
    CHECK_STATUS(tidepool_free_async(pool, p, s), TIDEPOOL_OK);
    tidepool_stats st;
    CHECK_STATUS(tidepool_get_stats(pool, &st), TIDEPOOL_OK);
    CHECK(st.used_current == 0);
    CHECK_STATUS(tidepool_pool_destroy(pool), TIDEPOOL_OK);
}

/* --- streams: retired, unknown, default ------------------------------- */

static void streams(void) {
    tidepool_pool *pool = host_pool(16 * MiB, 0);
    tidepool_stream s0, s1;
    CHECK_STATUS(tidepool_stream_default(pool, &s0), TIDEPOOL_OK);
    CHECK_STATUS(tidepool_stream_create(pool, &s1), TIDEPOOL_OK);
    void *p = NULL, *q = NULL;
    CHECK_STATUS(tidepool_alloc_async(pool, MiB, s1, &p), TIDEPOOL_OK);
    CHECK_STATUS(tidepool_free_async(pool, p, s1), TIDEPOOL_OK);
    CHECK_STATUS(tidepool_alloc_async(pool, MiB, s1, &q), TIDEPOOL_OK);
    fill(q, MiB, 4);

    CHECK_STATUS(tidepool_stream_retire(pool, s0), TIDEPOOL_ERROR_INVALID_STREAM);
    CHECK_STATUS(tidepool_stream_retire(pool, s1), TIDEPOOL_OK);
    CHECK_STATUS(tidepool_stream_retire(pool, s1), TIDEPOOL_ERROR_INVALID_STREAM);
    void *r = NULL;
    CHECK_STATUS(tidepool_alloc_async(pool, MiB, s1, &r), TIDEPOOL_ERROR_INVALID_STREAM);
    CHECK(r == NULL);
    CHECK_STATUS(tidepool_record_use(pool, q, s1), TIDEPOOL_ERROR_INVALID_STREAM);
    CHECK_STATUS(tidepool_stream_synchronize(pool, s1), TIDEPOOL_ERROR_INVALID_STREAM);
    /* q, allocated on the retired stream, is still live and freed on
     * another stream. */
    CHECK(intact(q, MiB, 4));
    CHECK_STATUS(tidepool_free_async(pool, q, s1), TIDEPOOL_ERROR_INVALID_STREAM);
    CHECK_STATUS(tidepool_free_async(pool, q, s0), TIDEPOOL_OK);

    /* A use on a retired stream of this pool: refused, and the allocation
     * stays freeable. */
    tidepool_stream s2;
    CHECK_STATUS(tidepool_stream_create(pool, &s2), TIDEPOOL_OK);
    CHECK_STATUS(tidepool_stream_retire(pool, s2), TIDEPOOL_OK);
    void *u = NULL;
    CHECK_STATUS(tidepool_alloc_async(pool, MiB, s0, &u), TIDEPOOL_OK);
    CHECK_STATUS(tidepool_record_use(pool, u, s2), TIDEPOOL_ERROR_INVALID_STREAM);
    CHECK_STATUS(tidepool_record_use(pool, u, s2 + 1000), TIDEPOOL_ERROR_INVALID_STREAM);
    CHECK_STATUS(tidepool_free_async(pool, u, s0), TIDEPOOL_OK);

    /* Made-up ids. */
    const tidepool_stream bogus[] = {0xdeadbeef, UINT64_MAX, s1 + 1000};
    for (size_t i = 0; i < sizeof bogus / sizeof bogus[0]; i++) {
        r = NULL;
        CHECK_STATUS(tidepool_alloc_async(pool, 4096, bogus[i], &r),
                     TIDEPOOL_ERROR_INVALID_STREAM);
        CHECK_STATUS(tidepool_stream_synchronize(pool, bogus[i]),
                     TIDEPOOL_ERROR_INVALID_STREAM);
        CHECK_STATUS(tidepool_stream_retire(pool, bogus[i]),
                     TIDEPOOL_ERROR_INVALID_STREAM);
    }
    /* Raw handle 0 is the default stream; retiring an unknown raw handle
     * is ignored. */
    tidepool_stream sr;
    CHECK_STATUS(tidepool_stream_from_raw(pool, NULL, &sr), TIDEPOOL_OK);
    CHECK(sr == s0);
    CHECK_STATUS(tidepool_stream_retire_raw(pool, (void *)0x1234), TIDEPOOL_OK);
    CHECK_STATUS(tidepool_synchronize(pool), TIDEPOOL_OK);
    tidepool_stats st;
    CHECK_STATUS(tidepool_get_stats(pool, &st), TIDEPOOL_OK);
    CHECK(st.used_current == 0);
    CHECK_STATUS(tidepool_pool_destroy(pool), TIDEPOOL_OK);
}

/* --- exact statistics after a known sequence ------------------------- */

static void exact_stats(void) {
    tidepool_pool *pool = host_pool(32 * MiB, 0);
    tidepool_stream s;
    CHECK_STATUS(tidepool_stream_default(pool, &s), TIDEPOOL_OK);
    void *p[5] = {0};
    const size_t sz[5] = {1, 4095, 4096, 3 * MiB + 17, 0};
    uint64_t total = 0;
    for (int i = 0; i < 5; i++) {
        CHECK_STATUS(tidepool_alloc_async(pool, sz[i], s, &p[i]), TIDEPOOL_OK);
        total += sz[i];
    }
    tidepool_stats st;
    CHECK_STATUS(tidepool_get_stats(pool, &st), TIDEPOOL_OK);
    CHECK(st.used_current == total);
    CHECK(st.used_high == total);
    /* The size-0 request gave NULL, which is never freed: not counted, so
     * allocs - frees is the number of live allocations. */
    CHECK(st.allocs == 4 && st.frees == 0);
    CHECK(st.reserved_current >= total && st.reserved_high == st.reserved_current);
    CHECK(st.ooms == 0);
    CHECK_STATUS(tidepool_free_async(pool, p[3], s), TIDEPOOL_OK);
    CHECK_STATUS(tidepool_free_async(pool, p[4], s), TIDEPOOL_OK);
    CHECK_STATUS(tidepool_get_stats(pool, &st), TIDEPOOL_OK);
    CHECK(st.used_current == total - sz[3]);
    CHECK(st.used_high == total);
    CHECK(st.frees == 1 && st.allocs - st.frees == 3);
    CHECK_STATUS(tidepool_reset_peaks(pool), TIDEPOOL_OK);
    CHECK_STATUS(tidepool_get_stats(pool, &st), TIDEPOOL_OK);
    CHECK(st.used_high == total - sz[3]);
    CHECK(st.reserved_high == st.reserved_current);
    void *big = NULL;
    CHECK_STATUS(tidepool_alloc_async(pool, 64 * MiB, s, &big), TIDEPOOL_ERROR_OUT_OF_MEMORY);
    CHECK_STATUS(tidepool_get_stats(pool, &st), TIDEPOOL_OK);
    CHECK(st.ooms == 1);
    CHECK(st.allocs == 4);
    for (int i = 0; i < 3; i++)
        CHECK_STATUS(tidepool_free_async(pool, p[i], s), TIDEPOOL_OK);
    CHECK_STATUS(tidepool_synchronize(pool), TIDEPOOL_OK);
    uint64_t released = 0;
    CHECK_STATUS(tidepool_trim_to(pool, 0, &released), TIDEPOOL_OK);
    CHECK_STATUS(tidepool_get_stats(pool, &st), TIDEPOOL_OK);
    CHECK(st.used_current == 0 && st.frees == 4 && st.allocs == st.frees);
    CHECK(st.reserved_current == 0);
    CHECK(released > 0 && st.releases > 0);
    CHECK_STATUS(tidepool_pool_destroy(pool), TIDEPOOL_OK);
}

/* --- trim_to and set_max_size under live memory ----------------------- */

static void trim_and_cap_under_live_memory(void) {
    tidepool_pool *pool = host_pool(64 * MiB, 0);
    tidepool_stream s;
    CHECK_STATUS(tidepool_stream_default(pool, &s), TIDEPOOL_OK);
    enum { N = 16 };
    void *p[N] = {0};
    for (int i = 0; i < N; i++) {
        CHECK_STATUS(tidepool_alloc_async(pool, 2 * MiB, s, &p[i]), TIDEPOOL_OK);
        if (p[i])
            fill(p[i], 2 * MiB, 10 + i);
    }
    /* Free every other one: holes the trim may release. */
    for (int i = 0; i < N; i += 2) {
        CHECK_STATUS(tidepool_free_async(pool, p[i], s), TIDEPOOL_OK);
        p[i] = NULL;
    }
    CHECK_STATUS(tidepool_synchronize(pool), TIDEPOOL_OK);
    CHECK_STATUS(tidepool_trim_to(pool, 0, NULL), TIDEPOOL_OK);
    tidepool_stats st;
    CHECK_STATUS(tidepool_get_stats(pool, &st), TIDEPOOL_OK);
    CHECK(st.used_current == (N / 2) * 2 * MiB);
    CHECK(st.reserved_current >= st.used_current);
    CHECK(st.reserved_current < N * 2 * MiB);
    for (int i = 1; i < N; i += 2)
        if (p[i] && !intact(p[i], 2 * MiB, 10 + i))
            FAIL("allocation %d changed by tidepool_trim_to", i);

    /* A maximum below what is in use: nothing live is touched, new memory
     * beyond the maximum is refused, and memory within it still works
     * once enough is freed. */
    CHECK_STATUS(tidepool_set_max_size(pool, 8 * MiB), TIDEPOOL_OK);
    void *x = NULL;
    CHECK_STATUS(tidepool_alloc_async(pool, 2 * MiB, s, &x), TIDEPOOL_ERROR_OUT_OF_MEMORY);
    CHECK(x == NULL);
    CHECK(strstr(tidepool_last_error(), "out of memory") != NULL);
    for (int i = 1; i < N; i += 2)
        if (p[i] && !intact(p[i], 2 * MiB, 10 + i))
            FAIL("allocation %d changed by a refused allocation under a lowered maximum", i);
    CHECK_STATUS(tidepool_get_stats(pool, &st), TIDEPOOL_OK);
    CHECK(st.used_current == (N / 2) * 2 * MiB);
    /* The refusal is an out-of-memory like any other. */
    CHECK(st.ooms == 1);
    for (int i = 1; i < N; i += 2) {
        CHECK_STATUS(tidepool_free_async(pool, p[i], s), TIDEPOOL_OK);
        p[i] = NULL;
    }
    CHECK_STATUS(tidepool_alloc_async(pool, 4 * MiB, s, &x), TIDEPOOL_OK);
    CHECK_STATUS(tidepool_get_stats(pool, &st), TIDEPOOL_OK);
    CHECK(st.reserved_current <= 8 * MiB);
    CHECK_STATUS(tidepool_free_async(pool, x, s), TIDEPOOL_OK);
    /* Lifting the maximum again. */
    CHECK_STATUS(tidepool_set_max_size(pool, 0), TIDEPOOL_OK);
    CHECK_STATUS(tidepool_alloc_async(pool, 32 * MiB, s, &x), TIDEPOOL_OK);
    CHECK_STATUS(tidepool_free_async(pool, x, s), TIDEPOOL_OK);
    CHECK_STATUS(tidepool_pool_destroy(pool), TIDEPOOL_OK);
}

/* --- several threads, several streams -------------------------------- */

#define THREADS 4
#define ROUNDS 200

struct worker {
    tidepool_pool *pool;
    tidepool_stream stream;
    int index;
    int bad;
};

static void *work(void *arg) {
    struct worker *w = arg;
    void *live[8] = {0};
    size_t size[8] = {0};
    for (int r = 0; r < ROUNDS; r++) {
        int k = r % 8;
        if (live[k]) {
            if (!intact(live[k], size[k], (unsigned)(w->index * 1000 + k)))
                w->bad++;
            if (tidepool_free_async(w->pool, live[k], w->stream) != TIDEPOOL_OK)
                w->bad++;
            live[k] = NULL;
        }
        size[k] = 512 + (size_t)((r * 7919 + w->index * 104729) % (256 * 1024));
        if (tidepool_alloc_async(w->pool, size[k], w->stream, &live[k]) != TIDEPOOL_OK ||
            live[k] == NULL) {
            w->bad++;
            live[k] = NULL;
            continue;
        }
        fill(live[k], size[k], (unsigned)(w->index * 1000 + k));
        /* Cross-stream: declare a use on the default stream now and then. */
        if (r % 16 == 0) {
            tidepool_stream d;
            if (tidepool_stream_default(w->pool, &d) != TIDEPOOL_OK ||
                tidepool_record_use(w->pool, live[k], d) != TIDEPOOL_OK)
                w->bad++;
        }
    }
    for (int k = 0; k < 8; k++)
        if (live[k]) {
            if (!intact(live[k], size[k], (unsigned)(w->index * 1000 + k)))
                w->bad++;
            if (tidepool_free_async(w->pool, live[k], w->stream) != TIDEPOOL_OK)
                w->bad++;
        }
    return NULL;
}

/* While the workers run: release cached memory, move the maximum (never
 * below what they need), wait for all streams, read and reset the
 * statistics. None of it may fail a worker's call or touch live data. */
struct trimmer {
    tidepool_pool *pool;
    volatile int *stop;
    int bad;
    int rounds;
};

static void *trim(void *arg) {
    struct trimmer *t = arg;
    while (!*t->stop || t->rounds < 50) {
        tidepool_stats st;
        uint64_t released = 0;
        if (tidepool_trim_to(t->pool, 0, &released) != TIDEPOOL_OK)
            t->bad++;
        if (tidepool_set_max_size(t->pool, t->rounds % 2 ? 48 * MiB : 0) != TIDEPOOL_OK)
            t->bad++;
        if (t->rounds % 8 == 0 && tidepool_synchronize(t->pool) != TIDEPOOL_OK)
            t->bad++;
        if (tidepool_get_stats(t->pool, &st) != TIDEPOOL_OK)
            t->bad++;
        else if (st.used_high < st.used_current || st.reserved_high < st.reserved_current ||
                 st.frees > st.allocs)
            t->bad++;
        if (t->rounds % 16 == 0 && tidepool_reset_peaks(t->pool) != TIDEPOOL_OK)
            t->bad++;
        t->rounds++;
    }
    return NULL;
}

static void threads(void) {
    tidepool_pool *pool = host_pool(64 * MiB, 0);
    pthread_t t[THREADS];
    struct worker w[THREADS];
    for (int i = 0; i < THREADS; i++) {
        w[i].pool = pool;
        w[i].index = i;
        w[i].bad = 0;
        CHECK_STATUS(tidepool_stream_create(pool, &w[i].stream), TIDEPOOL_OK);
    }
    volatile int stop = 0;
    struct trimmer tr = {pool, &stop, 0, 0};
    pthread_t tt;
    pthread_create(&tt, NULL, trim, &tr);
    for (int i = 0; i < THREADS; i++)
        pthread_create(&t[i], NULL, work, &w[i]);
    for (int i = 0; i < THREADS; i++) {
        pthread_join(t[i], NULL);
        if (w[i].bad)
            FAIL("thread %d saw %d failed calls or corrupted allocations", i, w[i].bad);
    }
    stop = 1;
    pthread_join(tt, NULL);
    if (tr.bad)
        FAIL("the trimming thread saw %d failed calls or inconsistent statistics in %d rounds",
             tr.bad, tr.rounds);
    CHECK_STATUS(tidepool_set_max_size(pool, 0), TIDEPOOL_OK);
    CHECK_STATUS(tidepool_synchronize(pool), TIDEPOOL_OK);
    tidepool_stats st;
    CHECK_STATUS(tidepool_get_stats(pool, &st), TIDEPOOL_OK);
    CHECK(st.used_current == 0);
    CHECK(st.allocs == THREADS * ROUNDS && st.frees == THREADS * ROUNDS);
    for (int i = 0; i < THREADS; i++)
        CHECK_STATUS(tidepool_stream_retire(pool, w[i].stream), TIDEPOOL_OK);
    CHECK_STATUS(tidepool_pool_destroy(pool), TIDEPOOL_OK);
}

/* --- the last error is per thread ------------------------------------ */

static pthread_barrier_t barrier;

static void *erring_thread(void *arg) {
    (void)arg;
    /* Fail on this thread, then wait while the main thread looks. */
    tidepool_status s = tidepool_pool_destroy(NULL);
    if (s != TIDEPOOL_ERROR_INVALID_ARGUMENT || strstr(tidepool_last_error(), "pool") == NULL)
        FAIL("failure on the helper thread left no message");
    pthread_barrier_wait(&barrier);
    pthread_barrier_wait(&barrier);
    /* The main thread's failure is not visible here. */
    if (strstr(tidepool_last_error(), "tidepool_pool_destroy") == NULL ||
        strstr(tidepool_last_error(), "out") != NULL)
        FAIL("the helper thread's last error changed to \"%s\"", tidepool_last_error());
    return NULL;
}

static void *quiet_thread(void *arg) {
    (void)arg;
    if (tidepool_last_error()[0] != '\0')
        FAIL("a fresh thread sees the error \"%s\"", tidepool_last_error());
    return NULL;
}

static void per_thread_errors(void) {
    pthread_barrier_init(&barrier, NULL, 2);
    CHECK_STATUS(tidepool_config_init(NULL), TIDEPOOL_ERROR_INVALID_ARGUMENT);
    char mine[512];
    snprintf(mine, sizeof mine, "%s", tidepool_last_error());
    pthread_t t;
    pthread_create(&t, NULL, erring_thread, NULL);
    pthread_barrier_wait(&barrier);
    CHECK(strcmp(tidepool_last_error(), mine) == 0);
    CHECK_STATUS(tidepool_default_pool(0, NULL), TIDEPOOL_ERROR_INVALID_ARGUMENT);
    pthread_barrier_wait(&barrier);
    pthread_join(t, NULL);
    pthread_t q;
    pthread_create(&q, NULL, quiet_thread, NULL);
    pthread_join(q, NULL);
    pthread_barrier_destroy(&barrier);
}

/* --- a destroyed pool ------------------------------------------------ */

static void calls_after_destroy(void) {
    tidepool_pool *pool = host_pool(16 * MiB, 0);
    tidepool_stream s, s1;
    CHECK_STATUS(tidepool_stream_default(pool, &s), TIDEPOOL_OK);
    CHECK_STATUS(tidepool_stream_create(pool, &s1), TIDEPOOL_OK);
    void *p = NULL;
    CHECK_STATUS(tidepool_alloc_async(pool, MiB, s, &p), TIDEPOOL_OK);
    CHECK_STATUS(tidepool_pool_destroy(pool), TIDEPOOL_OK);
    /* New pools made afterwards must not be reachable through the old
     * handle, even where memory is reused. */
    tidepool_pool *fresh[4];
    for (int i = 0; i < 4; i++)
        fresh[i] = host_pool(16 * MiB, 0);

    const tidepool_status A = TIDEPOOL_ERROR_INVALID_ARGUMENT;
#define DESTROYED(call)                                                    \
    do {                                                                   \
        CHECK_STATUS(call, A);                                             \
        if (strstr(tidepool_last_error(), "destroyed") == NULL)            \
            FAIL("%s: message does not say the pool was destroyed: %s",    \
                 #call, tidepool_last_error());                            \
    } while (0)
    tidepool_stream out;
    tidepool_stats st;
    void *q = NULL;
    DESTROYED(tidepool_pool_destroy(pool));
    DESTROYED(tidepool_stream_default(pool, &out));
    DESTROYED(tidepool_stream_create(pool, &out));
    DESTROYED(tidepool_stream_from_raw(pool, NULL, &out));
    DESTROYED(tidepool_stream_retire(pool, s1));
    DESTROYED(tidepool_stream_retire_raw(pool, NULL));
    DESTROYED(tidepool_alloc_async(pool, 64, s, &q));
    DESTROYED(tidepool_free_async(pool, p, s));
    DESTROYED(tidepool_alloc_async_raw(pool, 64, NULL, &q));
    DESTROYED(tidepool_free_async_raw(pool, p, NULL));
    DESTROYED(tidepool_record_use(pool, p, s));
    DESTROYED(tidepool_stream_synchronize(pool, s));
    DESTROYED(tidepool_synchronize(pool));
    DESTROYED(tidepool_trim_to(pool, 0, NULL));
    DESTROYED(tidepool_set_max_size(pool, MiB));
    DESTROYED(tidepool_set_release_threshold(pool, 0));
    DESTROYED(tidepool_get_stats(pool, &st));
    DESTROYED(tidepool_reset_peaks(pool));
#undef DESTROYED
    CHECK(q == NULL);
    for (int i = 0; i < 4; i++) {
        CHECK_STATUS(tidepool_get_stats(fresh[i], &st), TIDEPOOL_OK);
        CHECK(st.allocs == 0 && st.reserved_current == 0);
        CHECK_STATUS(tidepool_pool_destroy(fresh[i]), TIDEPOOL_OK);
    }
}

/* --- default pools and PyTorch entry points without a driver ---------- */

static void default_pools_without_driver(void) {
    if (tidepool_cuda_available()) {
        printf("CUDA present: default pools are checked by the GPU tests\n");
        return;
    }
    tidepool_config cfg;
    CHECK_STATUS(tidepool_config_init(&cfg), TIDEPOOL_OK);
    tidepool_pool *pool = NULL;
    CHECK_STATUS(tidepool_default_pool(-1, &pool), TIDEPOOL_ERROR_INVALID_ARGUMENT);
    CHECK_STATUS(tidepool_default_pool(1 << 20, &pool), TIDEPOOL_ERROR_INVALID_ARGUMENT);
    CHECK_STATUS(tidepool_default_pool(0, &pool), TIDEPOOL_ERROR_DRIVER_UNAVAILABLE);
    CHECK(pool == NULL);
    /* No pool exists, so configuring is still allowed, and a host backend
     * is refused for default pools. */
    cfg.max_size = 64 * MiB;
    CHECK_STATUS(tidepool_set_default_config(&cfg), TIDEPOOL_OK);
    cfg.backend = TIDEPOOL_BACKEND_HOST;
    CHECK_STATUS(tidepool_set_default_config(&cfg), TIDEPOOL_ERROR_INVALID_ARGUMENT);

    void *p = (void *)1;
    CHECK_STATUS(tidepool_torch_try_malloc(4096, 0, NULL, &p),
                 TIDEPOOL_ERROR_DRIVER_UNAVAILABLE);
    CHECK_STATUS(tidepool_torch_try_malloc(-5, 0, NULL, &p),
                 TIDEPOOL_ERROR_INVALID_ARGUMENT);
    CHECK_STATUS(tidepool_torch_try_malloc(4096, 0, NULL, NULL),
                 TIDEPOOL_ERROR_INVALID_ARGUMENT);
    /* The hooks cannot fail loudly; they must not crash. */
    tidepool_torch_free(NULL, 0, 0, NULL);
    /* A free for a device with no pool says the pointer is not tidepool's
     * (and creates no pool to find that out). */
    tidepool_torch_free((void *)0x1000, 64, 0, NULL);
    if (strstr(tidepool_last_error(), "not allocated by tidepool") == NULL)
        FAIL("tidepool_torch_free of a stray pointer: %s", tidepool_last_error());
    tidepool_torch_free((void *)0x1000, 64, -3, NULL);
    tidepool_torch_record_stream((void *)0x1000, NULL);
    tidepool_torch_reset();
    tidepool_torch_memory_fraction(0.5, 0);
    tidepool_torch_memory_fraction(-1.0, 0);
    tidepool_torch_memory_fraction(0.0 / 0.0, 0);
    CHECK_STATUS(tidepool_torch_empty_cache(), TIDEPOOL_OK);
    tidepool_stats st;
    memset(&st, 0xff, sizeof st);
    CHECK_STATUS(tidepool_torch_get_stats(0, &st), TIDEPOOL_OK);
    CHECK(st.reserved_current == 0 && st.allocs == 0);
    CHECK_STATUS(tidepool_torch_get_stats(0, NULL), TIDEPOOL_ERROR_INVALID_ARGUMENT);
    CHECK_STATUS(tidepool_torch_reset_peaks(0), TIDEPOOL_OK);
    CHECK(!tidepool_torch_owns(NULL));
    CHECK(!tidepool_torch_owns(&st));
    /* Still configurable: every creation failed. */
    CHECK_STATUS(tidepool_config_init(&cfg), TIDEPOOL_OK);
    CHECK_STATUS(tidepool_set_default_config(&cfg), TIDEPOOL_OK);
}

/* Name each part on stderr first, so a crash shows where it happened. */
#define RUN(part)                                                          \
    do {                                                                   \
        fprintf(stderr, "-- %s\n", #part);                                \
        part();                                                            \
    } while (0)

int main(void) {
    RUN(status_strings);
    RUN(null_arguments);
    RUN(bad_configs);
    RUN(foreign_and_interior_pointers);
    RUN(sizes);
    RUN(streams);
    RUN(exact_stats);
    RUN(trim_and_cap_under_live_memory);
    RUN(threads);
    RUN(per_thread_errors);
    RUN(calls_after_destroy);
    RUN(default_pools_without_driver);
    if (failures) {
        fprintf(stderr, "%d attack check(s) failed\n", failures);
        return 1;
    }
    printf("all attack checks passed\n");
    return 0;
}

/* The C API on the host backend: compiled against include/tidepool.h and
 * run by tests/c_api.rs. Exits 0 and prints "all C API checks passed" when
 * every check holds; prints the failed check and exits 1 otherwise. */

#include "tidepool.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures = 0;

#define CHECK(cond)                                                        \
    do {                                                                   \
        if (!(cond)) {                                                     \
            fprintf(stderr, "FAILED %s:%d: %s (last error: %s)\n",         \
                    __FILE__, __LINE__, #cond, tidepool_last_error());     \
            failures++;                                                    \
        }                                                                  \
    } while (0)

#define CHECK_STATUS(call, expected)                                       \
    do {                                                                   \
        tidepool_status got_ = (call);                                     \
        if (got_ != (expected)) {                                          \
            fprintf(stderr, "FAILED %s:%d: %s returned %s, expected %s "   \
                    "(last error: %s)\n", __FILE__, __LINE__, #call,       \
                    tidepool_status_string(got_),                          \
                    tidepool_status_string(expected),                      \
                    tidepool_last_error());                                \
            failures++;                                                    \
        }                                                                  \
    } while (0)

#define MiB ((uint64_t)1 << 20)

static tidepool_pool *host_pool(uint64_t max_size) {
    tidepool_config cfg;
    CHECK_STATUS(tidepool_config_init(&cfg), TIDEPOOL_OK);
    CHECK(cfg.backend == TIDEPOOL_BACKEND_CUDA);
    CHECK(cfg.release_threshold == UINT64_MAX);
    cfg.backend = TIDEPOOL_BACKEND_HOST;
    cfg.host_capacity = 64 * MiB;
    cfg.va_size = 256 * MiB;
    cfg.max_size = max_size;
    tidepool_pool *pool = NULL;
    CHECK_STATUS(tidepool_pool_create(&cfg, &pool), TIDEPOOL_OK);
    CHECK(pool != NULL);
    return pool;
}

static void alloc_free_and_stats(void) {
    tidepool_pool *pool = host_pool(0);
    tidepool_stream s0, s1;
    CHECK_STATUS(tidepool_stream_default(pool, &s0), TIDEPOOL_OK);
    CHECK_STATUS(tidepool_stream_create(pool, &s1), TIDEPOOL_OK);
    CHECK(s0 != s1);

    void *p = NULL;
    CHECK_STATUS(tidepool_alloc_async(pool, MiB, s0, &p), TIDEPOOL_OK);
    CHECK(p != NULL);
    /* Host-backed memory is host memory: write and read it back. */
    memset(p, 0xab, MiB);
    CHECK(((unsigned char *)p)[MiB - 1] == 0xab);

    void *q = NULL;
    CHECK_STATUS(tidepool_alloc_async(pool, 3 * MiB, s1, &q), TIDEPOOL_OK);
    CHECK(q != NULL && q != p);
    /* Declare a use of p on s1: its free then waits for s1 too. */
    CHECK_STATUS(tidepool_record_use(pool, p, s1), TIDEPOOL_OK);

    tidepool_stats st;
    CHECK_STATUS(tidepool_get_stats(pool, &st), TIDEPOOL_OK);
    CHECK(st.used_current == 4 * MiB);
    CHECK(st.reserved_current >= 4 * MiB);
    CHECK(st.allocs == 2);

    CHECK_STATUS(tidepool_free_async(pool, p, s0), TIDEPOOL_OK);
    CHECK_STATUS(tidepool_free_async(pool, q, s1), TIDEPOOL_OK);

    /* Double free: an error code, and nothing changes. */
    CHECK_STATUS(tidepool_free_async(pool, p, s0), TIDEPOOL_ERROR_DOUBLE_FREE);
    CHECK(strstr(tidepool_last_error(), "double free") != NULL);
    /* A pointer the pool never handed out. */
    CHECK_STATUS(tidepool_free_async(pool, (char *)q + 64, s1),
                 TIDEPOOL_ERROR_INVALID_POINTER);

    CHECK_STATUS(tidepool_get_stats(pool, &st), TIDEPOOL_OK);
    CHECK(st.used_current == 0);
    CHECK(st.used_high == 4 * MiB);
    CHECK(st.frees == 2);
    CHECK(st.reserved_high >= 4 * MiB);

    /* Everything is complete after a synchronise: trim gives it all back. */
    CHECK_STATUS(tidepool_synchronize(pool), TIDEPOOL_OK);
    uint64_t released = 0;
    CHECK_STATUS(tidepool_trim_to(pool, 0, &released), TIDEPOOL_OK);
    CHECK_STATUS(tidepool_get_stats(pool, &st), TIDEPOOL_OK);
    CHECK(st.reserved_current == 0);
    CHECK(released >= 4 * MiB);
    CHECK_STATUS(tidepool_reset_peaks(pool), TIDEPOOL_OK);
    CHECK_STATUS(tidepool_get_stats(pool, &st), TIDEPOOL_OK);
    CHECK(st.reserved_high == 0 && st.used_high == 0);

    CHECK_STATUS(tidepool_stream_retire(pool, s1), TIDEPOOL_OK);
    CHECK_STATUS(tidepool_alloc_async(pool, MiB, s1, &p), TIDEPOOL_ERROR_INVALID_STREAM);
    CHECK_STATUS(tidepool_stream_retire(pool, s0), TIDEPOOL_ERROR_INVALID_STREAM);
    CHECK_STATUS(tidepool_pool_destroy(pool), TIDEPOOL_OK);
}

/* Units: an 8 MiB block gets one 8 MiB piece of physical memory where the
 * default gives it four 2 MiB pages (the host backend's page size). */
static uint64_t growths_for_8_mib(uint64_t max_unit_size, uint64_t unit_min_block) {
    tidepool_config cfg;
    CHECK_STATUS(tidepool_config_init(&cfg), TIDEPOOL_OK);
    CHECK(cfg.max_unit_size == 0 && cfg.unit_min_block == 256 * MiB);
    cfg.backend = TIDEPOOL_BACKEND_HOST;
    cfg.host_capacity = 64 * MiB;
    cfg.va_size = 256 * MiB;
    if (max_unit_size != 0) {
        cfg.max_unit_size = max_unit_size;
        cfg.unit_min_block = unit_min_block;
    }
    tidepool_pool *pool = NULL;
    CHECK_STATUS(tidepool_pool_create(&cfg, &pool), TIDEPOOL_OK);
    if (pool == NULL) return 0;
    tidepool_stream s0;
    CHECK_STATUS(tidepool_stream_default(pool, &s0), TIDEPOOL_OK);
    void *p = NULL;
    CHECK_STATUS(tidepool_alloc_async(pool, 8 * MiB, s0, &p), TIDEPOOL_OK);
    memset(p, 0x5a, 8 * MiB);
    CHECK(((unsigned char *)p)[8 * MiB - 1] == 0x5a);
    tidepool_stats st;
    CHECK_STATUS(tidepool_get_stats(pool, &st), TIDEPOOL_OK);
    CHECK_STATUS(tidepool_free_async(pool, p, s0), TIDEPOOL_OK);
    CHECK_STATUS(tidepool_pool_destroy(pool), TIDEPOOL_OK);
    return st.growths;
}

static void physical_units(void) {
    CHECK(tidepool_config_size() == sizeof(tidepool_config));
    CHECK(growths_for_8_mib(0, 0) == 4);
    CHECK(growths_for_8_mib(8 * MiB, 8 * MiB) == 1);
    /* Below unit_min_block, single pages again. */
    CHECK(growths_for_8_mib(8 * MiB, 16 * MiB) == 4);
}

static void size_zero_and_null_arguments(void) {
    tidepool_pool *pool = host_pool(0);
    tidepool_stream s0;
    CHECK_STATUS(tidepool_stream_default(pool, &s0), TIDEPOOL_OK);
    void *p = (void *)0x1;
    CHECK_STATUS(tidepool_alloc_async(pool, 0, s0, &p), TIDEPOOL_OK);
    CHECK(p == NULL);
    CHECK_STATUS(tidepool_free_async(pool, NULL, s0), TIDEPOOL_OK);
    CHECK_STATUS(tidepool_alloc_async(pool, 16, s0, NULL), TIDEPOOL_ERROR_INVALID_ARGUMENT);
    CHECK_STATUS(tidepool_alloc_async(NULL, 16, s0, &p), TIDEPOOL_ERROR_INVALID_ARGUMENT);
    CHECK_STATUS(tidepool_get_stats(pool, NULL), TIDEPOOL_ERROR_INVALID_ARGUMENT);
    /* The legacy NULL stream as a raw handle is the default stream. */
    tidepool_stream raw0;
    CHECK_STATUS(tidepool_stream_from_raw(pool, NULL, &raw0), TIDEPOOL_OK);
    CHECK(raw0 == s0);
    CHECK_STATUS(tidepool_alloc_async_raw(pool, 4096, NULL, &p), TIDEPOOL_OK);
    CHECK(p != NULL);
    CHECK_STATUS(tidepool_free_async_raw(pool, p, NULL), TIDEPOOL_OK);
    /* The host backend has no driver streams to adopt. */
    CHECK_STATUS(tidepool_stream_from_raw(pool, (void *)0x1234, &raw0),
                 TIDEPOOL_ERROR_UNSUPPORTED);
    tidepool_stats st;
    CHECK_STATUS(tidepool_get_stats(pool, &st), TIDEPOOL_OK);
    /* 4096 bytes were allocated and freed; the size-0 request gave NULL,
     * which is never freed, so it is not counted. */
    CHECK(st.allocs == 1 && st.frees == 1 && st.used_current == 0);
    CHECK_STATUS(tidepool_pool_destroy(pool), TIDEPOOL_OK);
}

static void maximum_sizes(void) {
    /* Created with a maximum. */
    tidepool_pool *pool = host_pool(4 * MiB);
    tidepool_stream s0;
    CHECK_STATUS(tidepool_stream_default(pool, &s0), TIDEPOOL_OK);
    void *p = NULL;
    CHECK_STATUS(tidepool_alloc_async(pool, 8 * MiB, s0, &p), TIDEPOOL_ERROR_OUT_OF_MEMORY);
    CHECK(strstr(tidepool_last_error(), "out of memory") != NULL);
    CHECK_STATUS(tidepool_alloc_async(pool, 2 * MiB, s0, &p), TIDEPOOL_OK);
    CHECK_STATUS(tidepool_free_async(pool, p, s0), TIDEPOOL_OK);
    tidepool_stats st;
    CHECK_STATUS(tidepool_get_stats(pool, &st), TIDEPOOL_OK);
    CHECK(st.ooms == 1);
    CHECK_STATUS(tidepool_pool_destroy(pool), TIDEPOOL_OK);

    /* A maximum set at run time. */
    pool = host_pool(0);
    CHECK_STATUS(tidepool_stream_default(pool, &s0), TIDEPOOL_OK);
    CHECK_STATUS(tidepool_set_max_size(pool, 4 * MiB), TIDEPOOL_OK);
    CHECK_STATUS(tidepool_alloc_async(pool, 8 * MiB, s0, &p), TIDEPOOL_ERROR_OUT_OF_MEMORY);
    CHECK_STATUS(tidepool_get_stats(pool, &st), TIDEPOOL_OK);
    CHECK(st.reserved_current <= 4 * MiB);
    CHECK(st.used_current == 0);
    CHECK_STATUS(tidepool_alloc_async(pool, 4 * MiB, s0, &p), TIDEPOOL_OK);
    CHECK_STATUS(tidepool_free_async(pool, p, s0), TIDEPOOL_OK);
    CHECK_STATUS(tidepool_set_max_size(pool, 0), TIDEPOOL_OK);
    CHECK_STATUS(tidepool_alloc_async(pool, 8 * MiB, s0, &p), TIDEPOOL_OK);
    CHECK_STATUS(tidepool_free_async(pool, p, s0), TIDEPOOL_OK);
    CHECK_STATUS(tidepool_pool_destroy(pool), TIDEPOOL_OK);
}

static void default_pools_without_a_driver(void) {
    if (tidepool_cuda_available()) {
        printf("CUDA present: skipping the no-driver checks\n");
        return;
    }
    tidepool_pool *pool = NULL;
    CHECK_STATUS(tidepool_default_pool(0, &pool), TIDEPOOL_ERROR_DRIVER_UNAVAILABLE);
    CHECK(pool == NULL);
    CHECK_STATUS(tidepool_default_pool(-1, &pool), TIDEPOOL_ERROR_INVALID_ARGUMENT);
    tidepool_config cfg;
    tidepool_config_init(&cfg);
    cfg.backend = TIDEPOOL_BACKEND_HOST;
    CHECK_STATUS(tidepool_set_default_config(&cfg), TIDEPOOL_ERROR_INVALID_ARGUMENT);
}

int main(void) {
    alloc_free_and_stats();
    physical_units();
    size_zero_and_null_arguments();
    maximum_sizes();
    default_pools_without_a_driver();
    CHECK(strcmp(tidepool_status_string(TIDEPOOL_ERROR_DOUBLE_FREE),
                 "TIDEPOOL_ERROR_DOUBLE_FREE") == 0);
    if (failures) {
        fprintf(stderr, "%d C API checks failed\n", failures);
        return 1;
    }
    printf("all C API checks passed\n");
    return 0;
}

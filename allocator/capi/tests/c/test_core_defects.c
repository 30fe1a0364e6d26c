/* A former defect of the pool, reached through the C API exactly as the
 * header allows: a use recorded with tidepool_record_use on a stream that
 * is retired afterwards made the allocation impossible to free. Run by
 * tests/c_api.rs. Exits 0 and prints "core defect checks passed" when the
 * free works. */

#include "tidepool.h"

#include <stdio.h>

int main(void) {
    tidepool_config cfg;
    tidepool_config_init(&cfg);
    cfg.backend = TIDEPOOL_BACKEND_HOST;
    cfg.host_capacity = 16 << 20;
    cfg.va_size = 64 << 20;
    tidepool_pool *pool = NULL;
    if (tidepool_pool_create(&cfg, &pool) != TIDEPOOL_OK) {
        fprintf(stderr, "FAILED: pool: %s\n", tidepool_last_error());
        return 1;
    }
    tidepool_stream s0, side;
    void *p = NULL;
    if (tidepool_stream_default(pool, &s0) != TIDEPOOL_OK ||
        tidepool_stream_create(pool, &side) != TIDEPOOL_OK ||
        tidepool_alloc_async(pool, 1 << 20, s0, &p) != TIDEPOOL_OK ||
        tidepool_record_use(pool, p, side) != TIDEPOOL_OK ||
        tidepool_stream_retire(pool, side) != TIDEPOOL_OK) {
        fprintf(stderr, "FAILED: setup: %s\n", tidepool_last_error());
        return 1;
    }
    tidepool_status s = tidepool_free_async(pool, p, s0);
    if (s != TIDEPOOL_OK) {
        fprintf(stderr, "FAILED: free after the use stream was retired: %s: %s\n",
                tidepool_status_string(s), tidepool_last_error());
        return 1;
    }
    tidepool_stats st;
    tidepool_synchronize(pool);
    tidepool_get_stats(pool, &st);
    tidepool_pool_destroy(pool);
    if (st.used_current != 0) {
        fprintf(stderr, "FAILED: %llu bytes still in use\n", (unsigned long long)st.used_current);
        return 1;
    }
    printf("core defect checks passed\n");
    return 0;
}

# Driver cost of each VMM call against the size of one mapping, on GPU 0:
# python3 vmm_costs.py [total_MiB] [repeats]. For each handle size, creates
# handles covering total_MiB, maps them side by side, sets access on each
# mapping, unmaps and releases them; prints microseconds per call.
import ctypes as C, sys, time
L = C.CDLL("libcuda.so.1"); U = C.c_ulonglong
def ok(r):
    assert r == 0, "CUDA error %d" % r
total = int(sys.argv[1]) << 20 if len(sys.argv) > 1 else 4 << 30
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 2
ok(L.cuInit(0)); dev = C.c_int(); ok(L.cuDeviceGet(C.byref(dev), 0))
ctx = C.c_void_p(); ok(L.cuDevicePrimaryCtxRetain(C.byref(ctx), dev)); ok(L.cuCtxSetCurrent(ctx))
prop = (C.c_int * 8)(1, 0, 1, 0, 0, 0, 0, 0)  # pinned, device 0, no export
rw = (C.c_int * 3)(1, 0, 3)                   # device 0, read-write
va = U(); ok(L.cuMemAddressReserve(C.byref(va), U(total), U(2 << 20), U(0), U(0)))
for rep in range(reps):
    for mib in [2, 8, 32, 128, 512]:
        size = mib << 20; n = total // size; t = {}; clock = time.perf_counter
        at = lambda i: U(va.value + i * size)
        s = clock(); hs = []
        for i in range(n):
            h = U(); ok(L.cuMemCreate(C.byref(h), U(size), prop, U(0))); hs.append(h)
        t["create"] = clock() - s; s = clock()
        for i in range(n): ok(L.cuMemMap(at(i), U(size), U(0), hs[i], U(0)))
        t["map"] = clock() - s; s = clock()
        for i in range(n): ok(L.cuMemSetAccess(at(i), U(size), rw, U(1)))
        t["set_access"] = clock() - s; s = clock()
        for i in range(n): ok(L.cuMemUnmap(at(i), U(size)))
        t["unmap"] = clock() - s; s = clock()
        for h in hs: ok(L.cuMemRelease(h))
        t["release"] = clock() - s
        print("%4d MiB x %4d:" % (mib, n), " ".join("%s %.1f" % (k, v / n * 1e6) for k, v in t.items()), "us/call")

# Whether one cuMemSetAccess over several mappings costs less than one call
# per mapping, on GPU 0: python3 vmm_access_runs.py [pages] [down]. Maps
# `pages` 2 MiB handles side by side, then sets access in runs of 1, 2, 4,
# ... mappings (one call per run; `down`: longest runs first), five rounds
# each, run lengths interleaved; prints medians.
import ctypes as C, sys, time
L = C.CDLL("libcuda.so.1"); U = C.c_ulonglong; G = 2 << 20
N = int(sys.argv[1]) if len(sys.argv) > 1 else 256
def ok(r):
    assert r == 0, "CUDA error %d" % r
ok(L.cuInit(0)); dev = C.c_int(); ok(L.cuDeviceGet(C.byref(dev), 0))
ctx = C.c_void_p(); ok(L.cuDevicePrimaryCtxRetain(C.byref(ctx), dev)); ok(L.cuCtxSetCurrent(ctx))
prop = (C.c_int * 8)(1, 0, 1, 0, 0, 0, 0, 0); rw = (C.c_int * 3)(1, 0, 3)
hs = []
for i in range(N):
    h = U(); ok(L.cuMemCreate(C.byref(h), U(G), prop, U(0))); hs.append(h)
va = U(); ok(L.cuMemAddressReserve(C.byref(va), U(N * G), U(G), U(0), U(0)))
at = lambda i: U(va.value + i * G); clock = time.perf_counter
runs = [1 << k for k in range(N.bit_length()) if 1 << k <= N]
if sys.argv[2:] == ["down"]: runs.reverse()
res = {r: ([], [], []) for r in runs}
for _ in range(5):
    for run in runs:
        acc, mp, un = res[run]
        s = clock()
        for i in range(N): ok(L.cuMemMap(at(i), U(G), U(0), hs[i], U(0)))
        mp.append((clock() - s) / N); s = clock()
        for c in range(N // run): ok(L.cuMemSetAccess(at(c * run), U(run * G), rw, U(1)))
        acc.append((clock() - s) / (N // run)); s = clock()
        for i in range(N): ok(L.cuMemUnmap(at(i), U(G)))
        un.append((clock() - s) / N)
med = lambda v: sorted(v)[2] * 1e6
for run in runs:
    acc, mp, un = res[run]
    print("run %3d: set_access %7.1f us/call %5.1f us/mapping; map %.1f, unmap %.1f us/mapping"
          % (run, med(acc), med(acc) / run, med(mp), med(un)))
for h in hs: ok(L.cuMemRelease(h))

# Whether the VMM calls cost more when many mappings are live (a pool that
# keeps ghost mappings: one physical page mapped at several addresses), on
# GPU 0: python3 vmm_ghost_costs.py. For 0, 2048, 8192 and 16384 live
# mappings (2048 handles of 2 MiB, each mapped up to 8 times, with access),
# times map + set_access + unmap of 256 other 2 MiB handles.
import ctypes as C, time
L = C.CDLL("libcuda.so.1"); U = C.c_ulonglong; G = 2 << 20
def ok(r):
    assert r == 0, "CUDA error %d" % r
ok(L.cuInit(0)); dev = C.c_int(); ok(L.cuDeviceGet(C.byref(dev), 0))
ctx = C.c_void_p(); ok(L.cuDevicePrimaryCtxRetain(C.byref(ctx), dev)); ok(L.cuCtxSetCurrent(ctx))
prop = (C.c_int * 8)(1, 0, 1, 0, 0, 0, 0, 0); rw = (C.c_int * 3)(1, 0, 3)
def create(n):
    hs = []
    for _ in range(n):
        h = U(); ok(L.cuMemCreate(C.byref(h), U(G), prop, U(0))); hs.append(h)
    return hs
bg, fg = create(2048), create(256)
va = U(); ok(L.cuMemAddressReserve(C.byref(va), U((16384 + 256) << 21), U(G), U(0), U(0)))
at = lambda i: U(va.value + i * G); live = 0; clock = time.perf_counter
for target in [0, 2048, 8192, 16384]:
    while live < target:
        ok(L.cuMemMap(at(live), U(G), U(0), bg[live % 2048], U(0)))
        ok(L.cuMemSetAccess(at(live), U(G), rw, U(1))); live += 1
    t = {"map": [], "set_access": [], "unmap": []}
    for _ in range(5):
        for name in t:
            s = clock()
            for i in range(256):
                a = at(16384 + i)
                if name == "map": ok(L.cuMemMap(a, U(G), U(0), fg[i], U(0)))
                elif name == "set_access": ok(L.cuMemSetAccess(a, U(G), rw, U(1)))
                else: ok(L.cuMemUnmap(a, U(G)))
            t[name].append((clock() - s) / 256 * 1e6)
    print("%5d live mappings:" % live, " ".join("%s %.1f" % (k, sorted(v)[2]) for k, v in t.items()), "us/call")

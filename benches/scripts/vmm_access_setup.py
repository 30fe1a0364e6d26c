# What a 2 MiB bind (map + set_access) costs under the conditions a pool
# creates, on GPU 0: python3 vmm_access_setup.py [out.json]. Each case maps
# 256 handles of 2 MiB side by side at the start of a reservation, sets
# access on each, unmaps them; medians of 5 rounds, microseconds per call.
# Cases: the size of the address reservation (1 GiB ... twice the device's
# memory), handles never mapped before against handles mapped before,
# exportable (POSIX fd) handles, 4096 other handles (8 GiB) live and
# mapped elsewhere, and one set_access per page right after its map
# against all maps first.
import ctypes as C, json, sys, time
L = C.CDLL("libcuda.so.1"); U = C.c_ulonglong; G = 2 << 20; N = 256
def ok(r):
    assert r == 0, "CUDA error %d" % r
ok(L.cuInit(0)); dev = C.c_int(); ok(L.cuDeviceGet(C.byref(dev), 0))
ctx = C.c_void_p(); ok(L.cuDevicePrimaryCtxRetain(C.byref(ctx), dev)); ok(L.cuCtxSetCurrent(ctx))
total = U(); ok(L.cuDeviceTotalMem_v2(C.byref(total), dev))
rw = (C.c_int * 3)(1, 0, 3)
def prop(export):  # pinned, on device 0; handle type 1 = POSIX fd
    return (C.c_int * 8)(1, 1 if export else 0, 1, 0, 0, 0, 0, 0)
def create(n, export=False):
    hs = []
    for _ in range(n):
        h = U(); ok(L.cuMemCreate(C.byref(h), U(G), prop(export), U(0))); hs.append(h)
    return hs
def reserve(size):
    va = U(); ok(L.cuMemAddressReserve(C.byref(va), U(size), U(G), U(0), U(0))); return va
clock = time.perf_counter
def bind_round(va, hs, interleave=True):
    at = lambda i: U(va.value + i * G); t = {}
    if interleave:
        s = clock()
        for i in range(N):
            ok(L.cuMemMap(at(i), U(G), U(0), hs[i], U(0)))
            ok(L.cuMemSetAccess(at(i), U(G), rw, U(1)))
        t["map+set_access"] = (clock() - s) / N * 1e6
    else:
        s = clock()
        for i in range(N): ok(L.cuMemMap(at(i), U(G), U(0), hs[i], U(0)))
        t["map"] = (clock() - s) / N * 1e6; s = clock()
        for i in range(N): ok(L.cuMemSetAccess(at(i), U(G), rw, U(1)))
        t["set_access"] = (clock() - s) / N * 1e6
    s = clock()
    for i in range(N): ok(L.cuMemUnmap(at(i), U(G)))
    t["unmap"] = (clock() - s) / N * 1e6
    return t
def case(name, va, fresh_handles=False, export=False, interleave=False):
    rounds = []
    reused = None if fresh_handles else create(N, export)
    for _ in range(5):
        hs = create(N, export) if fresh_handles else reused
        rounds.append(bind_round(va, hs, interleave))
        if fresh_handles:
            for h in hs: ok(L.cuMemRelease(h))
    if reused:
        for h in reused: ok(L.cuMemRelease(h))
    med = {k: sorted(r[k] for r in rounds)[2] for k in rounds[0]}
    print("%-44s" % name, " ".join("%s %.1f" % kv for kv in med.items()), "us/call", flush=True)
    return {"case": name, **med}
out = []
sizes = [1 << 30, 16 << 30, 64 << 30, 2 * total.value // G * G]
vas = {s: reserve(s) for s in sizes}
for s in sizes:
    out.append(case("reserve %d GiB, handles reused" % (s >> 30), vas[s]))
    out.append(case("reserve %d GiB, fresh handles" % (s >> 30), vas[s], fresh_handles=True))
big = vas[sizes[-1]]
out.append(case("largest, reused, exportable handles", big, export=True))
out.append(case("largest, fresh, map then set_access each", big, fresh_handles=True, interleave=True))
# 4096 other handles live and mapped (8 GiB) in another reservation.
other = reserve(4096 * G); live = create(4096)
for i, h in enumerate(live):
    ok(L.cuMemMap(U(other.value + i * G), U(G), U(0), h, U(0)))
    ok(L.cuMemSetAccess(U(other.value + i * G), U(G), rw, U(1)))
out.append(case("largest, reused, 4096 pages live elsewhere", big))
out.append(case("largest, fresh, 4096 pages live elsewhere", big, fresh_handles=True))
out.append(case("1 GiB, reused, 4096 pages live elsewhere", vas[sizes[0]]))
# One set_access over the 4096 live mappings at once, for comparison.
s = clock(); ok(L.cuMemSetAccess(other, U(4096 * G), rw, U(1)))
out.append({"case": "one set_access over 4096 live mappings", "per_page_us": (clock() - s) / 4096 * 1e6})
print(out[-1], flush=True)
if len(sys.argv) > 1:
    json.dump(out, open(sys.argv[1], "w"), indent=1)

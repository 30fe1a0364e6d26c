"""PyTorch cases for tidepool, one per process (the allocator must be
installed before CUDA starts): ``python torch_cases.py CASE``. Each case
prints ``CASE ok`` and exits 0, or raises. Run by test_tidepool_torch.py."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import tidepool_torch  # noqa: E402

MiB = 1 << 20


def case_pointers_in_pool():
    tidepool_torch.install()
    import torch

    xs = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (1, 4096, 3 * MiB, 64 * MiB)]
    for x in xs:
        assert tidepool_torch.owns(x), f"tensor at {x.data_ptr():#x} is not in a tidepool pool"
    xs[2].fill_(5)
    assert int(xs[2].sum().item()) == 5 * 3 * MiB
    st = tidepool_torch.memory_stats()
    assert st["allocated_bytes.all.current"] >= 67 * MiB, st
    assert st["reserved_bytes.all.current"] >= st["allocated_bytes.all.current"], st
    assert tidepool_torch.memory_allocated() == st["allocated_bytes.all.current"]
    del xs, x
    assert tidepool_torch.memory_allocated() == 0, tidepool_torch.memory_stats()
    assert tidepool_torch.max_memory_allocated() >= 67 * MiB
    tidepool_torch.reset_peak_memory_stats()
    assert tidepool_torch.max_memory_allocated() == 0
    print("hooks:", tidepool_torch.installed_hooks())


def case_empty_tensor():
    tidepool_torch.install()
    import torch

    e = torch.empty(0, device="cuda")
    assert e.numel() == 0
    f = torch.cat([e, torch.ones(3, device="cuda")])
    assert f.sum().item() == 3.0
    z = torch.zeros(0, 5, device="cuda") @ torch.zeros(5, 2, device="cuda")
    assert z.shape == (0, 2)


def _train_a_little(torch, steps=3):
    model = torch.nn.Linear(256, 256).cuda()
    opt = torch.optim.AdamW(model.parameters())
    # Inputs from the CPU generator: after an aborted graph capture PyTorch's
    # CUDA generator refuses to run (its own state, not the allocator's).
    for _ in range(steps):
        loss = model(torch.randn(64, 256).cuda()).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    return float(loss.item())


def case_capped_pool_raises_and_keeps_training():
    tidepool_torch.install(max_size=256 * MiB)
    import torch

    _train_a_little(torch)
    try:
        torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
    except RuntimeError as e:
        msg = str(e)
        assert "out of memory" in msg, msg
        print("raised:", msg.splitlines()[0][:200])
    else:
        raise AssertionError("a request above max_size did not raise")
    loss = _train_a_little(torch)
    assert loss == loss, "training after the OOM produced NaN"
    assert tidepool_torch.memory_stats()["num_ooms"] >= 1


def case_memory_fraction_caps():
    tidepool_torch.install()
    import torch

    assert "set_memory_fraction_fn" in tidepool_torch.installed_hooks(), (
        "this PyTorch does not let the memory_fraction hook be set",
        tidepool_torch.installed_hooks(),
    )
    torch.cuda.set_per_process_memory_fraction(0.01)
    total = torch.cuda.get_device_properties(0).total_memory
    try:
        torch.empty(int(total * 0.05), dtype=torch.uint8, device="cuda")
    except RuntimeError as e:
        assert "out of memory" in str(e), str(e)
    else:
        raise AssertionError("a request above the memory fraction did not raise")
    torch.cuda.set_per_process_memory_fraction(1.0)
    x = torch.empty(int(total * 0.05), dtype=torch.uint8, device="cuda")
    del x


def case_empty_cache_gives_memory_back():
    tidepool_torch.install()
    import torch

    x = torch.empty(4096 * MiB, dtype=torch.uint8, device="cuda")
    x.fill_(1)
    del x
    torch.cuda.synchronize()
    reserved_before = tidepool_torch.memory_reserved()
    free_before = torch.cuda.mem_get_info()[0]
    assert reserved_before >= 4096 * MiB
    # Through PyTorch (the reset hook), when this PyTorch lets it be set;
    # through the module otherwise.
    if "set_reset_fn" in tidepool_torch.installed_hooks():
        torch.cuda.empty_cache()
    else:
        tidepool_torch.empty_cache()
    reserved_after = tidepool_torch.memory_reserved()
    free_after = torch.cuda.mem_get_info()[0]
    print(
        f"reserved {reserved_before / MiB:.0f} -> {reserved_after / MiB:.0f} MiB; "
        f"device free {free_before / MiB:.0f} -> {free_after / MiB:.0f} MiB"
    )
    assert reserved_after < reserved_before
    assert free_after >= free_before + 4000 * MiB


def _side_stream_reuse(record):
    """A tensor read on a side stream (after a long device-side sleep),
    freed on the default stream and its memory reallocated and overwritten
    there. With record_stream, the side stream must still read the old
    data; without it, the new tensor overwrites it first."""
    tidepool_torch.install()
    import torch

    n = 16 * MiB
    side = torch.cuda.Stream()
    x = torch.ones(n, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(400_000_000)  # ~0.2 s of device time on the side stream
        y = x.clone()
    if record:
        x.record_stream(side)
    x_ptr = x.data_ptr()
    del x
    z = torch.empty(n, device="cuda")
    z.fill_(7.0)
    same = z.data_ptr() == x_ptr
    torch.cuda.synchronize()
    kept = bool((y == 1.0).all().item())
    print(f"record_stream={record}: reused address={same}, side-stream data kept={kept}")
    return kept, same


def case_record_stream_keeps_data():
    kept, _ = _side_stream_reuse(record=True)
    assert "set_record_stream_fn" in tidepool_torch.installed_hooks(), (
        "this PyTorch does not let the record_stream hook be set",
        tidepool_torch.installed_hooks(),
    )
    assert kept, "data read on the side stream was overwritten despite record_stream"


def case_without_record_stream_data_is_lost():
    # The control of the case above: it shows the check can fail.
    kept, same = _side_stream_reuse(record=False)
    assert same and not kept, (
        "without record_stream the memory was expected to be reused at once and the "
        f"side stream's data overwritten (reused={same}, kept={kept})"
    )


def case_graph_capture_is_a_clear_error():
    """Allocation on a stream being captured into a CUDA graph: the library
    answers TIDEPOOL_ERROR_STREAM_CAPTURING without breaking the capture,
    and PyTorch raises a RuntimeError naming the cause (never a NULL
    pointer). Each step is printed, so a failure shows where it happened."""
    import ctypes

    tidepool_torch.install()
    import torch

    lib = tidepool_torch._load()
    lib.tidepool_torch_try_malloc.argtypes = [
        ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
    x = torch.ones(1024, device="cuda")
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    errors = []
    with torch.cuda.stream(side):
        g.capture_begin()
        print("capturing after begin:", torch.cuda.is_current_stream_capturing())
        out = ctypes.c_void_p()
        status = lib.tidepool_torch_try_malloc(4096, 0, ctypes.c_void_p(side.cuda_stream), ctypes.byref(out))
        detail = lib.tidepool_last_error().decode()
        still = torch.cuda.is_current_stream_capturing()
        print(f"direct call: status {status}, ptr {out.value}, capture still active: {still}; {detail}")
        try:
            y = x * 2  # noqa: F841 - allocates on the capturing stream
            print("x * 2 during capture: no error")
        except RuntimeError as e:
            errors.append(str(e))
            print("x * 2 during capture raised:", str(e)[:400])
        try:
            g.capture_end()
            print("capture_end: ok")
        except RuntimeError as e:
            print("capture_end raised:", str(e)[:400])
    assert status == 7 and not out.value, (status, out.value, detail)
    assert "captured into a CUDA graph" in detail, detail
    assert still, "the library's call broke the capture"
    assert errors and "captured into a CUDA graph" in errors[0], errors
    # The process keeps working afterwards.
    z = torch.ones(10, device="cuda") * 3
    torch.cuda.synchronize()
    assert z.sum().item() == 30.0
    loss = _train_a_little(torch)
    assert loss == loss, "training after the failed capture produced NaN"


def case_install_after_cuda_init_refused():
    import torch

    torch.zeros(1, device="cuda")
    try:
        tidepool_torch.install()
    except RuntimeError as e:
        assert "already initialised" in str(e), str(e)
    else:
        raise AssertionError("install() after CUDA initialisation did not refuse")


CASES = {name[len("case_"):]: fn for name, fn in globals().items() if name.startswith("case_")}

if __name__ == "__main__":
    name = sys.argv[1]
    CASES[name]()
    print(f"{name} ok")

"""tidepool as PyTorch's CUDA allocator.

Pure Python (ctypes); needs ``libtidepool.so``. Install the allocator before
anything initialises CUDA::

    import tidepool_torch
    tidepool_torch.install()            # or install(max_size=40 << 30, ...)
    import torch
    x = torch.empty(1 << 20, device="cuda")   # memory from tidepool

Under a pluggable allocator PyTorch's own ``torch.cuda.memory_allocated``,
``memory_reserved``, ``memory_stats`` and ``reset_peak_memory_stats`` raise;
use the functions of this module instead (same names, same meaning).

The library is found at ``$TIDEPOOL_LIB``, else next to this package, else
in the repository's ``target/release`` or ``target/debug``.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Dict, List, Optional

__all__ = [
    "install",
    "is_installed",
    "library_path",
    "installed_hooks",
    "memory_stats",
    "memory_allocated",
    "memory_reserved",
    "max_memory_allocated",
    "max_memory_reserved",
    "reset_peak_memory_stats",
    "empty_cache",
    "owns",
    "TidepoolError",
]


class TidepoolError(RuntimeError):
    """A libtidepool call failed; the message is the library's own."""


class _Config(ctypes.Structure):
    # Mirrors `tidepool_config` in include/tidepool.h.
    _fields_ = [
        ("backend", ctypes.c_int),
        ("device", ctypes.c_int32),
        ("max_size", ctypes.c_uint64),
        ("release_threshold", ctypes.c_uint64),
        ("follow_event_dependencies", ctypes.c_bool),
        ("opportunistic", ctypes.c_bool),
        ("internal_dependencies", ctypes.c_bool),
        ("wait_for_pending_frees", ctypes.c_bool),
        ("page_size", ctypes.c_uint64),
        ("va_size", ctypes.c_uint64),
        ("stream_cache_bytes", ctypes.c_uint64),
        ("check_capture", ctypes.c_bool),
        ("host_capacity", ctypes.c_uint64),
        ("max_unit_size", ctypes.c_uint64),
        ("unit_min_block", ctypes.c_uint64),
    ]


_STATS_FIELDS = [
    "reserved_current",
    "reserved_high",
    "used_current",
    "used_high",
    "allocs",
    "frees",
    "cache_hits",
    "growths",
    "releases",
    "remaps",
    "internal_dependencies",
    "ooms",
    "raw_streams_adopted",
    "raw_streams_recycled",
]


class _Stats(ctypes.Structure):
    # Mirrors `tidepool_stats` in include/tidepool.h.
    _fields_ = [(name, ctypes.c_uint64) for name in _STATS_FIELDS]


# Options of install() that map onto tidepool_config fields.
_CONFIG_KEYS = {
    "max_size",
    "release_threshold",
    "follow_event_dependencies",
    "opportunistic",
    "internal_dependencies",
    "wait_for_pending_frees",
    "page_size",
    "va_size",
    "stream_cache_bytes",
    "check_capture",
    "max_unit_size",
    "unit_min_block",
}

_HOOKS = [
    ("set_record_stream_fn", "tidepool_torch_record_stream"),
    ("set_reset_fn", "tidepool_torch_reset"),
    ("set_memory_fraction_fn", "tidepool_torch_memory_fraction"),
]

_lib: Optional[ctypes.CDLL] = None
_path: Optional[str] = None
_allocator = None
_hooks: List[str] = []


def _torch():
    """PyTorch, or an ImportError that says what is missing and what to do."""
    try:
        import torch
    except ImportError as e:
        raise ImportError(
            "tidepool_torch needs PyTorch with CUDA, which could not be imported "
            f"({e}); install PyTorch (https://pytorch.org) in this environment, "
            "or use libtidepool through its C API without it"
        ) from e
    return torch


_BOOL_KEYS = {
    "follow_event_dependencies",
    "opportunistic",
    "internal_dependencies",
    "wait_for_pending_frees",
    "check_capture",
}


def _checked_option(key: str, value):
    """A config value as ctypes will store it, refusing what it would
    silently change (ctypes wraps -1 to 2**64 - 1 and takes any truthy
    object as true)."""
    if key in _BOOL_KEYS:
        if not isinstance(value, bool):
            raise TypeError(f"tidepool option {key} must be True or False, not {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"tidepool option {key} must be an int (bytes), not {value!r}")
    if not 0 <= value < 1 << 64:
        raise ValueError(f"tidepool option {key} must be within 0..2**64-1 bytes, not {value}")
    return value


def _candidates() -> List[Path]:
    here = Path(__file__).resolve().parent
    found = []
    env = os.environ.get("TIDEPOOL_LIB")
    if env:
        found.append(Path(env))
    found.append(here / "libtidepool.so")
    for parent in here.parents:
        for profile in ("release", "debug"):
            found.append(parent / "target" / profile / "libtidepool.so")
    return found


def library_path() -> str:
    """The path of the libtidepool.so this module uses (or would use)."""
    if _path is not None:
        return _path
    for c in _candidates():
        if c.is_file():
            return str(c)
    raise FileNotFoundError(
        "libtidepool.so not found; build it with `cargo build --release -p tidepool-capi` "
        "or set TIDEPOOL_LIB to its path (looked in: "
        + ", ".join(str(c) for c in _candidates())
        + ")"
    )


def _load(path: Optional[str] = None) -> ctypes.CDLL:
    global _lib, _path
    if _lib is not None:
        return _lib
    path = path or library_path()
    lib = ctypes.CDLL(path)
    lib.tidepool_last_error.restype = ctypes.c_char_p
    lib.tidepool_status_string.restype = ctypes.c_char_p
    lib.tidepool_status_string.argtypes = [ctypes.c_int]
    lib.tidepool_config_init.argtypes = [ctypes.POINTER(_Config)]
    lib.tidepool_set_default_config.argtypes = [ctypes.POINTER(_Config)]
    lib.tidepool_torch_get_stats.argtypes = [ctypes.c_int32, ctypes.POINTER(_Stats)]
    lib.tidepool_torch_reset_peaks.argtypes = [ctypes.c_int32]
    lib.tidepool_torch_owns.argtypes = [ctypes.c_void_p]
    lib.tidepool_torch_owns.restype = ctypes.c_bool
    lib.tidepool_cuda_available.restype = ctypes.c_bool
    # The config struct gains fields between versions: filling a struct of
    # another size would write past the library's, or leave fields unset.
    size = getattr(lib, "tidepool_config_size", None)
    if size is not None:
        size.restype = ctypes.c_size_t
    theirs = size() if size is not None else None
    if theirs != ctypes.sizeof(_Config):
        raise TidepoolError(
            f"{path} does not match this tidepool_torch: its tidepool_config is "
            f"{theirs if theirs is not None else 'of unknown size'} bytes, this package's "
            f"{ctypes.sizeof(_Config)}; use the library built from the same sources"
        )
    _lib, _path = lib, path
    return lib


def _check(status: int, what: str) -> None:
    if status != 0:
        lib = _load()
        name = lib.tidepool_status_string(status).decode()
        msg = lib.tidepool_last_error().decode(errors="replace")
        raise TidepoolError(f"{what} failed ({name}): {msg}")


def install(library: Optional[str] = None, **config) -> None:
    """Make tidepool PyTorch's CUDA allocator for this process.

    Must run before CUDA is initialised (before the first CUDA tensor, and
    before ``torch.cuda.init()``). Options (all optional), as in
    ``tidepool_config``: ``max_size`` (bytes, per device; 0 = none),
    ``release_threshold``, ``follow_event_dependencies``, ``opportunistic``,
    ``internal_dependencies``, ``wait_for_pending_frees``, ``page_size``,
    ``va_size``, ``stream_cache_bytes``, ``check_capture``,
    ``max_unit_size`` (bytes; larger pieces of physical memory for large
    blocks: a cheaper first growth, coarser reuse; 0 = single pages),
    ``unit_min_block`` (bytes; the smallest block that gets them).
    """
    global _allocator, _hooks
    unknown = set(config) - _CONFIG_KEYS
    if unknown:
        raise TypeError(f"unknown tidepool option(s): {', '.join(sorted(unknown))}")
    checked = {key: _checked_option(key, value) for key, value in config.items()}
    if _allocator is not None:
        raise RuntimeError("tidepool_torch.install() was already called in this process")
    torch = _torch()

    if torch.cuda.is_initialized():
        raise RuntimeError(
            "CUDA is already initialised: call tidepool_torch.install() before the first "
            "CUDA tensor or torch.cuda call that initialises CUDA (PyTorch cannot change "
            "its allocator afterwards)"
        )
    lib = _load(library)
    cfg = _Config()
    _check(lib.tidepool_config_init(ctypes.byref(cfg)), "tidepool_config_init")
    for key, value in checked.items():
        setattr(cfg, key, value)
    _check(lib.tidepool_set_default_config(ctypes.byref(cfg)), "tidepool_set_default_config")

    alloc = torch.cuda.memory.CUDAPluggableAllocator(
        _path, "tidepool_torch_malloc", "tidepool_torch_free"
    )
    native = alloc.allocator()
    hooks = []
    for setter, symbol in _HOOKS:
        fn = getattr(native, setter, None)
        if callable(fn):
            fn(ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value)
            hooks.append(setter)
    torch.cuda.memory.change_current_allocator(alloc)
    _allocator, _hooks = alloc, hooks


def is_installed() -> bool:
    """Whether install() has made tidepool this process's allocator."""
    return _allocator is not None


def installed_hooks() -> List[str]:
    """The optional PyTorch hooks this PyTorch build let install() set
    (``set_record_stream_fn``, ``set_reset_fn``, ``set_memory_fraction_fn``)."""
    return list(_hooks)


def _device_index(device) -> int:
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    torch = _torch()
    if device is None:
        return torch.cuda.current_device()
    return torch.device(device).index or 0


def _stats(device=None) -> Dict[str, int]:
    lib = _load()
    st = _Stats()
    _check(lib.tidepool_torch_get_stats(_device_index(device), ctypes.byref(st)), "get_stats")
    return {name: int(getattr(st, name)) for name in _STATS_FIELDS}


def memory_stats(device=None) -> Dict[str, int]:
    """torch.cuda.memory_stats-style keys (the ``all`` pool) plus the raw
    counters under ``tidepool.*``. Allocated = bytes of live tensors
    (requested sizes); reserved = physical memory the pool holds."""
    s = _stats(device)
    out = {
        "allocated_bytes.all.current": s["used_current"],
        "allocated_bytes.all.peak": s["used_high"],
        "reserved_bytes.all.current": s["reserved_current"],
        "reserved_bytes.all.peak": s["reserved_high"],
        "active_bytes.all.current": s["used_current"],
        "active_bytes.all.peak": s["used_high"],
        "allocation.all.allocated": s["allocs"],
        "allocation.all.freed": s["frees"],
        "allocation.all.current": s["allocs"] - s["frees"],
        "num_ooms": s["ooms"],
        "num_device_alloc": s["growths"],
        "num_device_free": s["releases"],
    }
    out.update({f"tidepool.{k}": v for k, v in s.items()})
    return out


def memory_allocated(device=None) -> int:
    """Bytes in live tensors."""
    return _stats(device)["used_current"]


def max_memory_allocated(device=None) -> int:
    """Peak of memory_allocated since start or the last reset."""
    return _stats(device)["used_high"]


def memory_reserved(device=None) -> int:
    """Physical bytes the pool holds."""
    return _stats(device)["reserved_current"]


def max_memory_reserved(device=None) -> int:
    """Peak of memory_reserved since start or the last reset."""
    return _stats(device)["reserved_high"]


def reset_peak_memory_stats(device=None) -> None:
    """Reset the peaks to the current values."""
    _check(_load().tidepool_torch_reset_peaks(_device_index(device)), "reset_peaks")


def empty_cache() -> None:
    """Wait for every stream the pools have seen, then give all memory not
    in use back to the device (what torch.cuda.empty_cache does)."""
    _check(_load().tidepool_torch_empty_cache(), "empty_cache")


def owns(ptr_or_tensor) -> bool:
    """Whether an address (or a tensor's data) lies in a tidepool pool."""
    ptr = ptr_or_tensor if isinstance(ptr_or_tensor, int) else ptr_or_tensor.data_ptr()
    return bool(_load().tidepool_torch_owns(ctypes.c_void_p(ptr)))

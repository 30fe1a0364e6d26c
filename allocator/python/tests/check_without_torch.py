"""tidepool_torch where PyTorch cannot be imported: importing the package
works, and every function that needs PyTorch raises an ImportError that says
so, from tidepool_torch itself, rather than a bare "No module named 'torch'"
from deep inside. Bad options are refused before anything is loaded.

Runs without pytest (tests/c_api.rs of the tidepool-capi crate runs it with
TIDEPOOL_LIB set). PyTorch is hidden even where it is installed. Prints
"python checks passed" and exits 0 when every check holds."""

import importlib.abc
import os
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))


class _NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named '{name}'", name=name)
        return None


sys.meta_path.insert(0, _NoTorch())
sys.modules.pop("torch", None)

import tidepool_torch  # noqa: E402

failures = []


def expect(exc_type, fn, *words):
    try:
        fn()
    except exc_type as e:
        msg = str(e)
        missing = [w for w in words if w not in msg]
        if missing:
            failures.append(f"{fn.__name__}: message lacks {missing}: {msg}")
        # Raised by tidepool_torch itself, not from inside another module.
        last = traceback.extract_tb(e.__traceback__)[-1]
        if os.path.basename(os.path.dirname(last.filename)) != "tidepool_torch":
            failures.append(f"{fn.__name__}: raised from {last.filename}:{last.lineno}")
    except Exception as e:  # noqa: BLE001
        failures.append(f"{fn.__name__}: {type(e).__name__} instead of {exc_type.__name__}: {e}")
    else:
        failures.append(f"{fn.__name__}: no {exc_type.__name__}")


def install():
    tidepool_torch.install()


def stats_of_the_current_device():
    tidepool_torch.memory_allocated()


def reset_peaks_of_the_current_device():
    tidepool_torch.reset_peak_memory_stats()


def negative_size():
    tidepool_torch.install(max_size=-1)


def size_as_text():
    tidepool_torch.install(max_size="40G")


def switch_as_int():
    tidepool_torch.install(opportunistic=1)


def unknown_option():
    tidepool_torch.install(max_sise=1 << 30)


expect(ImportError, install, "PyTorch", "install")
expect(ImportError, stats_of_the_current_device, "PyTorch")
expect(ImportError, reset_peaks_of_the_current_device, "PyTorch")
expect(ValueError, negative_size, "max_size")
expect(TypeError, size_as_text, "max_size")
expect(TypeError, switch_as_int, "opportunistic")
expect(TypeError, unknown_option, "max_sise")
if tidepool_torch.is_installed():
    failures.append("a failed install() left the allocator marked installed")

# What needs only the library works without PyTorch.
if "TIDEPOOL_LIB" in os.environ:
    if tidepool_torch.memory_allocated(0) != 0:
        failures.append("memory_allocated(0) is not 0 with no pool created")
    if tidepool_torch.memory_stats(0)["allocation.all.current"] != 0:
        failures.append("allocation.all.current is not 0 with no pool created")
    if tidepool_torch.owns(0):
        failures.append("owns(0) is true")

    # A package whose config struct is not the library's refuses to load it.
    import ctypes

    class _ShortConfig(ctypes.Structure):
        _fields_ = tidepool_torch._Config._fields_[:-2]

    saved = (tidepool_torch._lib, tidepool_torch._path, tidepool_torch._Config)

    def load_with_another_config():
        tidepool_torch._lib = None
        tidepool_torch._Config = _ShortConfig
        try:
            tidepool_torch._load(os.environ["TIDEPOOL_LIB"])
        finally:
            tidepool_torch._lib, tidepool_torch._path, tidepool_torch._Config = saved

    expect(tidepool_torch.TidepoolError, load_with_another_config, "tidepool_config", "bytes")
    if tidepool_torch._load() is not saved[0]:
        failures.append("the library loaded before the refused one is no longer used")

if failures:
    for f in failures:
        print("FAILED", f, file=sys.stderr)
    sys.exit(1)
print("python checks passed")

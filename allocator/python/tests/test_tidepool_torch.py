"""PyTorch tests of tidepool_torch. Each case runs in its own process (the
allocator must be installed before CUDA starts). Skipped, with the reason
printed, where torch, CUDA or libtidepool.so is missing; with
TIDEPOOL_REQUIRE_GPU=1 a missing GPU is a failure instead."""

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import tidepool_torch  # noqa: E402


def _skip(reason):
    if os.environ.get("TIDEPOOL_REQUIRE_GPU") == "1":
        pytest.fail(f"TIDEPOOL_REQUIRE_GPU=1 but {reason}")
    sys.stderr.write(f"SKIP tidepool_torch tests: {reason}\n")
    pytest.skip(reason, allow_module_level=True)


def _environment():
    try:
        import torch  # noqa: F401
    except ImportError as e:
        return f"torch is not installed ({e})"
    try:
        tidepool_torch.library_path()
    except FileNotFoundError as e:
        return str(e)
    # Ask in a child process, so this one never initialises CUDA.
    probe = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
        capture_output=True,
        text=True,
    )
    if probe.stdout.strip() != "True":
        return "no CUDA device is available to torch"
    return None


_reason = _environment()
if _reason:
    _skip(_reason)

from torch_cases import CASES  # noqa: E402


@pytest.mark.parametrize("case", sorted(CASES))
def test_case(case):
    r = subprocess.run(
        [sys.executable, os.path.join(HERE, "torch_cases.py"), case],
        capture_output=True,
        text=True,
        timeout=90,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    sys.stdout.write(r.stdout)
    sys.stderr.write(r.stderr[-4000:])
    assert r.returncode == 0 and f"{case} ok" in r.stdout, f"case {case} failed (rc {r.returncode})"

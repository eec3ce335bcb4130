"""Kernel tests run the Triton kernels on CPU through Triton's interpreter.

``TRITON_INTERPRET`` must be set before the kernels are defined (``triton.jit`` decides at
decoration time whether a kernel is compiled or interpreted), hence at conftest import time.
Should another test folder have imported the kernel modules first in the same session, they are
reloaded here so their kernels are interpreted. ``PAGEDMODEL_ATTENTION_BACKEND`` is left alone;
tests that need it set it themselves.
"""
import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

# dependency order: helpers, kernels, then the module re-exporting them
for _name in ("triton_launch", "triton_cache_write", "triton_block_copy", "triton_paged_attention",
              "triton_attention"):
    _module = sys.modules.get(f"pagedmodel.kernels.{_name}")
    if _module is not None:
        importlib.reload(_module)


import pytest  # noqa: E402


@pytest.fixture(params=["auto", "off"])
def op_mode(request, monkeypatch):
    """Runs a test twice: with the CPU ops (the install's build for this CPU; a missing build fails the test
    rather than skipping it) and with PAGEDMODEL_CPU_OPS=off (the torch-ops fallbacks)."""
    from pagedmodel.kernels import cpu_ops

    monkeypatch.setenv(cpu_ops.OPS_ENV, request.param)
    if request.param == "auto" and cpu_ops.load() is None:
        pytest.fail(f"the CPU ops are not loaded: {cpu_ops.load_error()}")
    return request.param

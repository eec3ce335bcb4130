"""Kernel tests run the Triton kernels on CPU through Triton's interpreter.

``TRITON_INTERPRET`` must be set before triton is first imported (the kernels are wrapped
for the interpreter when their module is imported), hence at conftest import time.
``PAGEDMODEL_ATTENTION_BACKEND`` is left alone here; tests that need it set it themselves.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"

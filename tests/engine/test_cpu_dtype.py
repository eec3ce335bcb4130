"""``--dtype auto`` on CPU: bf16 only where the CPU has native bf16 (AMX or AVX512-BF16); and the block size default per device."""
from __future__ import annotations

import pytest
import torch

from pagedmodel.kernels.cpu_features import cpu_flags, has_native_bf16
from pagedmodel.server.engine.device import pick_block_size, pick_dtype

AVX2_EPYC = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx avx2 fma bmi2\nbugs\t\t: sysret_ss_attrs\n"
SAPPHIRE_RAPIDS = "flags\t\t: fpu avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile amx_int8\n"
COOPER_LAKE = "flags\t\t: fpu avx2 avx512f avx512_bf16\n"
SKYLAKE_X = "flags\t\t: fpu avx2 avx512f avx512bw avx512vl\n"


def test_flags_are_read_from_the_flags_line_only():
    assert cpu_flags(AVX2_EPYC) == {"fpu", "sse2", "avx", "avx2", "fma", "bmi2"}
    assert cpu_flags("model name\t: something\n") == frozenset()


@pytest.mark.parametrize("cpuinfo,native", [(AVX2_EPYC, False), (SKYLAKE_X, False), (COOPER_LAKE, True),
                                            (SAPPHIRE_RAPIDS, True)])
def test_native_bf16_needs_amx_or_avx512_bf16(cpuinfo, native):
    assert has_native_bf16(cpu_flags(cpuinfo)) is native


@pytest.mark.parametrize("capability,native", [("AVX2", False), ("AVX512", False), ("DEFAULT", False),
                                               ("AVX512_BF16", True), ("AMX", True)])
def test_without_cpuinfo_torch_capability_decides(capability, native):
    assert has_native_bf16(frozenset(), capability) is native


def test_this_machine_agrees_with_its_cpuinfo():
    flags = cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo here")
    assert has_native_bf16() is bool({"amx_bf16", "avx512_bf16"} & flags)


@pytest.mark.parametrize("native,expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_dtype_on_cpu_follows_the_cpu(native, expected):
    assert pick_dtype("auto", object(), torch.device("cpu"), native_bf16=native) is expected


def test_an_explicit_dtype_wins_over_the_cpu():
    assert pick_dtype("float32", object(), torch.device("cpu"), native_bf16=True) is torch.float32
    assert pick_dtype("bfloat16", object(), torch.device("cpu"), native_bf16=False) is torch.bfloat16


@pytest.mark.parametrize(("asked", "device", "expected"), [
    (None, "cpu", 128),     # vLLM's CPU default: long contiguous reads of each sequence's blocks
    (None, "cuda", 16),
    (16, "cpu", 16),        # an explicit --block-size always wins
    (64, "cuda", 64),
])
def test_default_block_size_follows_the_device(asked, device, expected):
    assert pick_block_size(asked, torch.device(device)) == expected

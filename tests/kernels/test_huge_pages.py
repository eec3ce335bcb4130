"""CPU tensors on 2 MB pages (pagedmodel/kernels/huge_pages.py): the KV cache and the packed weights."""
from __future__ import annotations

import pytest
import torch

from pagedmodel.kernels import cpu_linear, cpu_ops, huge_pages
from pagedmodel.kernels.cpu_linear_plan import LinearPlan


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding ``address`` (``hg``: advised MADV_HUGEPAGE)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(part, 16) for part in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_available_follows_the_kernel_setting_and_the_env(tmp_path):
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    assert huge_pages.available(env="1", setting_path=str(setting)) == (huge_pages._madvise() is not None)
    assert not huge_pages.available(env="0", setting_path=str(setting))
    setting.write_text("always madvise [never]\n")
    assert not huge_pages.available(env="1", setting_path=str(setting))
    assert not huge_pages.available(env="1", setting_path=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="PAGEDMODEL_HUGE_PAGES must be 0 or 1"):
        huge_pages.available(env="yes")


def test_empty_starts_on_a_huge_page_and_is_advised_where_available():
    t = huge_pages.zeros((3, 1 << 20), torch.bfloat16)   # 6 MB
    assert t.shape == (3, 1 << 20) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert int(t.count_nonzero()) == 0
    t[2, -1] = 7.0   # the last element is inside the allocation
    assert float(t[2, -1]) == 7.0
    if huge_pages.available():
        assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
        assert "hg" in _vm_flags(t.data_ptr())
    else:   # this kernel offers none: an ordinary tensor of just its own bytes, just as usable
        assert t.untyped_storage().nbytes() == 6 << 20


def test_off_or_small_gives_ordinary_tensors(monkeypatch):
    """An ordinary tensor holds just its own bytes (a huge-page one is a view into a region 2 MB larger).
    Its memory may still carry an earlier region's advice: the heap reuses freed, advised memory."""
    small = huge_pages.empty((100,), torch.float32)
    assert small.shape == (100,) and small.untyped_storage().nbytes() == 400
    monkeypatch.setenv(huge_pages.HUGE_PAGES_ENV, "0")
    big = huge_pages.zeros((4 << 20,), torch.uint8)
    assert big.untyped_storage().nbytes() == 4 << 20 and int(big.count_nonzero()) == 0


def test_gather_copies_tensors_side_by_side_in_one_region():
    tensors = [torch.randn(700, 1000), torch.arange(37, dtype=torch.int16), torch.randn(3, 5).bfloat16()]
    copies = huge_pages.gather(tensors)
    for original, copy in zip(tensors, copies):
        assert copy.dtype == original.dtype and copy.shape == original.shape and torch.equal(copy, original)
        assert copy.data_ptr() % huge_pages.ALIGN == 0 and copy.data_ptr() != original.data_ptr()
    storage = copies[0].untyped_storage().data_ptr()
    assert all(c.untyped_storage().data_ptr() == storage for c in copies)
    assert copies[1].data_ptr() - copies[0].data_ptr() == 700 * 1000 * 4


def test_packed_layers_move_onto_huge_pages_and_compute_the_same():
    """The panels and AMX tiles a decode step streams move into huge-page regions; every path of the
    plan gives the same bits as before the move."""
    if cpu_ops.bf16_linear() is None or not cpu_linear.applies(torch.zeros(2, 2, dtype=torch.bfloat16)):
        pytest.fail(f"the CPU ops are not loaded or bf16 packing does not apply: {cpu_ops.load_error()}")
    amx = cpu_linear.amx_tiles_op() is not None
    plan = LinearPlan(panel_max_rows=1, amx_max_rows=64 if amx else 0)
    g = torch.Generator().manual_seed(0)
    net = torch.nn.Sequential(*(cpu_linear.PackedLinear(torch.randn(1024, 1024, generator=g).bfloat16(), plan=plan)
                                for _ in range(2)))
    xs = [torch.randn(rows, 1024, generator=g).bfloat16() for rows in (1, 16, 80)]
    with torch.inference_mode():
        before = [net(x) for x in xs]
        old = {id(t): t.data_ptr() for layer in net for t in (layer.panels, layer.amx_tiles) if t is not None}
        moved = cpu_linear.place_on_huge_pages(net)
        after = [net(x) for x in xs]
    for b, a in zip(before, after):
        assert torch.equal(b, a)
    streamed = [t for layer in net for t in (layer.panels, layer.amx_tiles) if t is not None]
    assert len(streamed) == (4 if amx else 2)
    if huge_pages.available():
        assert moved == sum(t.numel() * t.element_size() for t in streamed)
        assert all(t.data_ptr() not in old.values() and "hg" in _vm_flags(t.data_ptr()) for t in streamed)
    else:
        assert moved == 0


def test_the_cpu_kv_cache_lives_on_huge_pages():
    from pagedmodel.kernels.backend import select_backend
    from pagedmodel.server.engine.kv_cache import KVCache

    cache = KVCache(2, 256, 16, 3, 64, torch.bfloat16, torch.device("cpu"), select_backend(torch.device("cpu")))
    for layer in cache.layers:
        assert layer.shape == (2, 256, 16, 3, 64)   # 3 MB and layer.dtype == torch.bfloat16
        assert int(layer.count_nonzero()) == 0
        if huge_pages.available():
            assert layer.data_ptr() % huge_pages.HUGE_PAGE == 0 and "hg" in _vm_flags(layer.data_ptr())

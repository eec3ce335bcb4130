"""The fused CPU layer ops (kernels/cpu_layer_ops.cpp) against the torch ops they replace, and the
model with them against the model without them."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedmodel.kernels import cpu_ops
from pagedmodel.server.engine.models.llama import RMSNorm, RotaryEmbedding, _rotate_half

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2 ** -7, atol=2 ** -7)}
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def ops():
    built = cpu_ops.layer_ops()
    if built is None:
        pytest.fail(f"the CPU ops are not loaded: {cpu_ops.load_error()}")
    return built


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, dim", [(1, 8), (5, 576), (33, 100)])
def test_fused_add_rms_norm_matches_add_then_norm(ops, dtype, rows, dim):
    x = (torch.randn(rows, dim, generator=_gen(dim)) * 3).to(dtype)
    residual = torch.randn(rows, dim, generator=_gen(dim + 1)).to(dtype)
    norm = RMSNorm(dim, 1e-5).to(dtype)
    norm.weight.data = torch.randn(dim, generator=_gen(dim + 2)).to(dtype)
    want_sum = x + residual
    want = norm(want_sum)
    ops.fused_add_rms_norm(x, residual, norm.weight.data, 1e-5)
    assert torch.equal(residual, want_sum)   # the sum is stored exactly as torch's add rounds it
    torch.testing.assert_close(x, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch(ops, dtype):
    gate_up = (torch.randn(7, 2 * 300, generator=_gen(3)) * 6).to(dtype)   # both signs, large magnitudes
    gate, up = gate_up.split(300, dim=-1)
    torch.testing.assert_close(ops.silu_and_mul(gate_up), F.silu(gate) * up, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 40])   # 40: half a head is 20 values, a vector and a partial one
def test_rotary_in_place_on_strided_slices_matches_the_torch_formula(ops, dtype, dim):
    from types import SimpleNamespace
    config = SimpleNamespace(rope_theta=10000.0)
    rope = RotaryEmbedding(config, dim, 512)
    qkv = torch.randn(11, (9 + 3 + 3) * dim, generator=_gen(4)).to(dtype)
    q, k, _ = qkv.split([9 * dim, 3 * dim, 3 * dim], dim=-1)
    q, k = q.view(-1, 9, dim), k.view(-1, 3, dim)
    positions = torch.tensor([0, 1, 2, 7, 100, 511, 3, 3, 64, 65, 200])
    cos = rope.cos[positions].to(dtype)[:, None, :]
    sin = rope.sin[positions].to(dtype)[:, None, :]
    want_q, want_k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    ops.rotary_embedding(q, rope.cos, rope.sin, positions)
    ops.rotary_embedding(k, rope.cos, rope.sin, positions)
    torch.testing.assert_close(q, want_q, **TOL[dtype])
    torch.testing.assert_close(k, want_k, **TOL[dtype])
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        ops.rotary_embedding(q[:1], rope.cos, rope.sin, torch.tensor([512]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_and_write_kv_is_rotary_then_the_cache_write(ops, dtype):
    """On the fused qkv projection's output in place: queries and keys rotated as rotary_embedding does,
    keys and values into their slots as write_kv does (a negative slot skips its row), queries left in qkv."""
    from types import SimpleNamespace
    rope = RotaryEmbedding(SimpleNamespace(rope_theta=10000.0), 64, 512)
    qkv = torch.randn(6, (9 + 3 + 3) * 64, generator=_gen(5)).to(dtype)
    positions = torch.tensor([0, 5, 511, 17, 3, 200])
    slots = torch.tensor([9, 2, -1, 30, 0, 17])
    want_qkv = qkv.clone()
    q, k, v = want_qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)
    q, k, v = q.view(-1, 9, 64), k.view(-1, 3, 64), v.view(-1, 3, 64)
    ops.rotary_embedding(q, rope.cos, rope.sin, positions)
    ops.rotary_embedding(k, rope.cos, rope.sin, positions)
    want_cache = torch.randn(2, 4, 8, 3, 64, generator=_gen(6)).to(dtype)
    cache = want_cache.clone()
    ops.write_kv(k, v, want_cache, slots)
    ops.rotary_and_write_kv(qkv, rope.cos, rope.sin, positions, cache, slots, 9)
    assert torch.equal(qkv[:, :12 * 64], want_qkv[:, :12 * 64]) and torch.equal(qkv[:, 12 * 64:], want_qkv[:, 12 * 64:])
    assert torch.equal(cache, want_cache)
    with pytest.raises(RuntimeError, match="q_heads"):
        ops.rotary_and_write_kv(qkv, rope.cos, rope.sin, positions, cache, slots, 8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.rotary_and_write_kv(qkv, rope.cos, rope.sin, positions, cache, torch.tensor([0, 1, 2, 3, 4, 32]), 9)


@pytest.mark.parametrize("dtype", DTYPES)
def test_engine_tokens_are_the_same_with_or_without_the_fused_ops(tiny_llama_dir, monkeypatch, dtype):
    """Greedy tokens of the whole engine, fused ops on and off (PAGEDMODEL_CPU_OPS=off turns
    the CPU ops extension off; the attention then runs on torch ops too, which is tested equal elsewhere)."""
    from pagedmodel import LLM, SamplingParams

    prompts = [[1] + [(7 * i + j) % 400 + 10 for j in range(2 + 11 * i)] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    runs = {}
    for mode in ("auto", "off"):
        monkeypatch.setenv(cpu_ops.OPS_ENV, mode)
        llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32" if dtype == torch.float32 else "bfloat16",
                  max_model_len=256)
        runs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    if dtype == torch.float32:
        assert runs["auto"] == runs["off"]
    else:   # bf16 rounding of a random tiny model can tip a near-tie (then the rest of that sequence
        # differs: the last prompt's first token is one, in every bf16 variant against float32); a
        # broken op would move them all
        assert sum(x != y for x, y in zip(runs["auto"], runs["off"])) <= 1


def test_a_bf16_model_keeps_float32_rotary_tables_and_takes_the_fused_op(ops):
    """``model.to(bfloat16)`` moves the cos/sin tables but leaves them float32, so bf16 steps rotate
    in the fused op (which reads float32 tables) rather than on torch ops with bf16 tables."""
    from types import SimpleNamespace
    rope = RotaryEmbedding(SimpleNamespace(rope_theta=10000.0), 64, 128)
    want = rope.cos.clone()
    rope.to(dtype=torch.bfloat16)
    assert rope.cos.dtype == rope.sin.dtype == torch.float32 and torch.equal(rope.cos, want)
    calls = []
    layer_ops = SimpleNamespace(rotary_embedding=lambda *a: calls.append(a[0].dtype))
    q, k = torch.zeros(3, 9, 64, dtype=torch.bfloat16), torch.zeros(3, 3, 64, dtype=torch.bfloat16)
    rope(torch.arange(3), q, k, layer_ops)
    assert calls == [torch.bfloat16, torch.bfloat16]

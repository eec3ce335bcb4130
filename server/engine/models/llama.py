"""Llama-family decoder (Llama, Mistral, Qwen2) over a flattened, unpadded token batch.

Every step sees one ``[T]`` vector of token ids from many sequences; attention is the only
place where sequences are told apart, through the paged KV cache and AttentionMetadata.
q/k/v and gate/up projections are fused into one matmul each (fewer, larger GEMMs).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedmodel.kernels import cpu_linear, cpu_ops
from pagedmodel.kernels.attention_metadata import AttentionMetadata
from pagedmodel.kernels.backend import AttentionBackend
from pagedmodel.kernels.forward_attention import forward_attention

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def cpu_layer_ops(x: torch.Tensor):
    """The fused C++ layer ops (``kernels/cpu_layer_ops.cpp``) where they apply to ``x``, else None.
    The model looks them up once a forward and hands them to every layer (``ops``): looked up per call, as
    each of a step's ~150 call sites once did, the lookups cost ~0.3 ms a step."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return None
    if torch.compiler.is_compiling():   # a compiled forward: inductor fuses the torch path itself
        return None
    return cpu_ops.layer_ops()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor,
                     ops: object | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``; with the CPU layer ``ops``, in one pass, overwriting both inputs."""
        weight = self.weight
        if ops is not None and x.dim() == 2 and x.is_contiguous() and residual.is_contiguous() \
                and weight.dtype == x.dtype == residual.dtype:
            ops.fused_add_rms_norm(x, residual, weight, self.eps)
            return x, residual
        residual = x + residual
        return self(residual), residual


def rope_parameters(config) -> dict:
    params = getattr(config, "rope_parameters", None) or {}
    if not params:  # older transformers: rope_theta + rope_scaling
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to ``max_positions``, computed once in fp32."""

    def __init__(self, config, head_dim: int, max_positions: int):
        super().__init__()
        params = rope_parameters(config)
        rope_type = params["rope_type"]
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
        if rope_type == "default":
            base = params["rope_theta"]
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scaling = 1.0
        else:
            # the scaled variants' frequency formulas are HF's own, so configs mean the same thing here
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        positions = torch.arange(max_positions, dtype=torch.float)
        freqs = positions[:, None] * inv_freq[None, :].float()
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def _apply(self, fn, recurse=True):
        """Moves the tables with the model but keeps them float32 whatever its dtype: the fused CPU op
        reads float32 tables and rounds once (bf16 tables sent every bf16 step down the slower torch
        path, which casts them to the activations' dtype at use, as HF does)."""
        cos, sin = self.cos, self.sin
        super()._apply(fn, recurse)
        self.cos, self.sin = cos.to(self.cos.device), sin.to(self.sin.device)
        return self

    def fused(self, ops: object | None) -> bool:
        """Whether the CPU layer ``ops`` rotate here: they read float32 tables."""
        return ops is not None and self.cos.dtype == torch.float32 and self.cos.is_contiguous()

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                ops: object | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos, self.sin
        if self.fused(ops):
            ops.rotary_embedding(q, cos, sin, positions)   # in place, in one pass each
            ops.rotary_embedding(k, cos, sin, positions)
            return q, k
        cos = cos[positions].to(q.dtype)[:, None, :]
        sin = sin[positions].to(q.dtype)[:, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.scale = self.head_dim ** -0.5
        self.layer_idx = layer_idx
        self.rotary = rotary

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, backend: AttentionBackend, ops: object | None = None) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if meta is not None and backend.cache_write_is_cpu_op and kv_cache.dtype == qkv.dtype and self.rotary.fused(ops):
            # rotary and the backend's cache write in one CPU call, queries read in place
            ops.rotary_and_write_kv(qkv, self.rotary.cos, self.rotary.sin, positions, kv_cache, meta.slot_mapping,
                                    self.num_heads)
            q = qkv.view(qkv.shape[0], -1, self.head_dim)[:, :self.num_heads]
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(-1, self.num_heads, self.head_dim)
            k = k.view(-1, self.num_kv_heads, self.head_dim)
            v = v.view(-1, self.num_kv_heads, self.head_dim)
            q, k = self.rotary(positions, q, k, ops)
            if meta is None:   # the compiled forward: one opaque op reads the step (compiled_forward.py)
                return self.o_proj(forward_attention(q, k, v, self.layer_idx, self.scale).reshape(-1, self.q_size))
            backend.write_kv(k, v, kv_cache, meta.slot_mapping)
        out = backend.paged_attention(q, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported activation {config.hidden_act!r} (only silu)")
        self.intermediate = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate, bias=False)
        self.down_proj = nn.Linear(self.intermediate, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ops: object | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if ops is not None and gate_up.dim() == 2 and gate_up.is_contiguous():
            return self.down_proj(ops.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__()
        self.self_attn = Attention(config, layer_idx, rotary)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, residual, positions, kv_cache, meta, backend, ops=None):
        """``x`` is the previous layer's output before its residual add, ``residual`` the running sum
        (None at the first layer): each add is fused with the norm that follows it. ``ops``: the CPU layer
        ops (``cpu_layer_ops``), or None for torch's."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual, ops)
        h = self.self_attn(h, positions, kv_cache, meta, backend, ops)
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual, ops)
        return self.mlp(h, ops), residual


class LlamaForCausalLM(nn.Module):
    """Weights use HF parameter names except the fused ``qkv_proj`` / ``gate_up_proj`` (see loader)."""

    def __init__(self, config, max_positions: int):
        super().__init__()
        self.config = config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rotary = RotaryEmbedding(config, head_dim, max_positions)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, self.rotary) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.logits_head: nn.Module | None = None   # a prepacked head for the tied weight (use_packed_linears)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, backend: AttentionBackend,
                embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``embeds``: (flat rows, [rows, hidden]) input embeddings that replace those rows' token embeddings
        (prompts given as embeddings)."""
        x = self.embed_tokens(input_ids)
        if embeds is not None:
            x = x.index_copy(0, embeds[0], embeds[1].to(x.dtype))
        ops = cpu_layer_ops(x)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, positions, kv_cache, meta, backend, ops)
        if residual is None:   # no layers
            return self.norm(x)
        return self.norm.add_and_norm(x, residual, ops)[0]

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """The head's logits; ``float32=False`` leaves them in the dtype the head computed them in (the
        sampler widens only what it needs: a [64, 49,152] copy is milliseconds a step on one core)."""
        if self.lm_head is not None:
            logits = self.lm_head(hidden)
        elif self.logits_head is not None:
            logits = self.logits_head(hidden)
        else:
            logits = F.linear(hidden, self.embed_tokens.weight)
        return logits.float() if float32 else logits

    def use_packed_linears(self) -> int:
        """On CPU (float32, or bfloat16 where the CPU has native bf16): every projection and the head
        through oneDNN-prepacked weights (``pagedmodel/kernels/cpu_linear.py``); returns how many layers were
        packed (0: not applicable or off)."""
        tied_head = self.lm_head is None and cpu_linear.applies(self.embed_tokens.weight)
        packing = cpu_linear.pack_linears(self, extra_weights=(self.embed_tokens.weight,) if tied_head else ())
        packed = packing.count
        if isinstance(self.lm_head, cpu_linear.PackedLinear):
            self.lm_head.float_output = True   # float32 logits straight from a float32 GEMM
        if packed and tied_head:
            self.logits_head = cpu_linear.PackedLinear(self.embed_tokens.weight, plan=packing.plan_for(self.embed_tokens.weight),
                                                       float_output=True)
            packed += 1
        if packed:
            cpu_linear.place_on_huge_pages(self)
        return packed

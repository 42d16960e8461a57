"""A fast CPU backend for Llama-architecture models, in the spirit of gpt-fast.

Why it is faster than `HFCausalLM` on a small, memory-bandwidth-bound CPU:

* The decoder is a plain loop of a few tensor ops per layer: no module hooks, masks built by
  transformers' generic code, or `DynamicCache` concatenation per step.
* The KV cache is preallocated ([layers, kv_heads, max_length, head_dim]); a forward writes into
  it in place and `rollback` only moves the length pointer, so rejected drafts cost nothing.
* Q/K/V and gate/up projections are fused into one matmul each (fewer, larger kernels).
* The LM head -- the biggest single matrix -- is applied only to the `last_n` positions asked for.
* Weights can be stored as bfloat16 or int8 (weight-only, per output channel): decoding reads
  every weight once per step, so halving or quartering the bytes read is most of the speed-up.
  int8 uses `torch._weight_int8pack_mm` (the kernel gpt-fast uses), fed bf16 activations; the
  residual stream, norms, RoPE, attention and the KV cache stay float32 in every mode.

Converted weights are built once per (model, weight_dtype) and shared by every instance, so
instances stay cheap to create like any `CausalLM`: only the KV cache is per-instance state.
Measured numbers and the commands behind them: assets/FAST_BACKEND.md.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from engine.models.causal_lm import CausalLM

WEIGHT_DTYPES = ("float32", "bfloat16", "int8")
_STATIC_ROPE_TYPES = ("default", "linear", "llama3")  # inv_freq does not change with length


def fast_backend_supported(model: PreTrainedModel) -> bool:
    """True for the Llama variants this backend implements and the tests check.

    That is `model_type == "llama"`: no attention/MLP biases, SiLU MLP, static RoPE, float32
    weights on CPU. Qwen2 (q/k/v biases), Mistral (sliding window), Gemma (offset norms, scaled
    embeddings) and friends differ in small ways this code does not handle, so they are refused.
    """
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) != "llama":
        return False
    rope = getattr(cfg, "rope_parameters", None) or {"rope_type": "default"}
    return (
        not getattr(cfg, "attention_bias", False)
        and not getattr(cfg, "mlp_bias", False)
        and getattr(cfg, "hidden_act", "silu") == "silu"
        and getattr(cfg, "pretraining_tp", 1) == 1
        and rope.get("rope_type", "default") in _STATIC_ROPE_TYPES
        and all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())
    )


class _Linear:
    """y = x @ W.T with W stored as float32, bfloat16 or int8 + per-output-channel scales.

    Input and output are float32; lower-precision modes cast the (tiny) activations, not the
    (large) weights, so only the weight read shrinks.
    """

    def __init__(self, weight: torch.Tensor, dtype: str) -> None:
        self.dtype = dtype
        if dtype == "float32":
            self.weight = weight.contiguous()
        elif dtype == "bfloat16":
            self.weight = weight.to(torch.bfloat16).contiguous()
        elif dtype == "int8":
            # Round the scale to bf16 first so the weights are quantized against the scale the
            # kernel will actually multiply by.
            scale = (weight.abs().amax(dim=1) / 127.0).clamp_min(1e-12).to(torch.bfloat16)
            q = (weight / scale.float()[:, None]).round().clamp(-127, 127).to(torch.int8)
            # The kernel silently computes garbage unless in_features is a multiple of 8.
            self.pad = -weight.shape[1] % 8
            self.weight = F.pad(q, (0, self.pad)).contiguous()
            self.scale = scale
        else:
            raise ValueError(f"unknown weight_dtype {dtype!r}; expected one of {', '.join(WEIGHT_DTYPES)}")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.dtype == "float32":
            return F.linear(x, self.weight)
        if self.dtype == "bfloat16":
            return F.linear(x.to(torch.bfloat16), self.weight).float()
        x = x.to(torch.bfloat16)
        if self.pad:
            x = F.pad(x, (0, self.pad))
        return torch._weight_int8pack_mm(x, self.weight, self.scale).float()


class _Layer:
    def __init__(self, layer, dtype: str) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.input_norm = layer.input_layernorm.weight.detach()
        self.post_norm = layer.post_attention_layernorm.weight.detach()
        self.qkv = _Linear(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach(), dtype)
        self.o = _Linear(attn.o_proj.weight.detach(), dtype)
        self.gate_up = _Linear(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach(), dtype)
        self.down = _Linear(mlp.down_proj.weight.detach(), dtype)


class FastLlamaWeights:
    """The converted weights of one model in one weight format (shared by all instances)."""

    def __init__(self, model: PreTrainedModel, weight_dtype: str) -> None:
        if not fast_backend_supported(model):
            raise ValueError(f"the fast backend does not support this model ({type(model).__name__}, "
                             f"model_type={getattr(model.config, 'model_type', None)!r}); use the transformers backend")
        if weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"unknown weight_dtype {weight_dtype!r}; expected one of {', '.join(WEIGHT_DTYPES)}")
        cfg = model.config
        self.weight_dtype = weight_dtype
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.vocab_size = cfg.vocab_size
        self.max_position_embeddings = cfg.max_position_embeddings
        with torch.inference_mode():
            self.embed = model.model.embed_tokens.weight.detach()  # lookups stay float32, shared
            self.layers = [_Layer(layer, weight_dtype) for layer in model.model.layers]
            self.norm = model.model.norm.weight.detach()
            self.lm_head = _Linear(model.lm_head.weight.detach(), weight_dtype)
        rotary = model.model.rotary_emb
        self.inv_freq = rotary.inv_freq.detach().float().clone()
        self.rope_scaling = float(rotary.attention_scaling)

    def rope_tables(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [length, head_dim], computed exactly as transformers does (float32)."""
        freqs = torch.arange(length, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.rope_scaling, emb.sin() * self.rope_scaling


_WEIGHTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def fast_weights(model: PreTrainedModel, weight_dtype: str = "float32") -> FastLlamaWeights:
    """Converted weights for `model`, built on first use and cached for the model's lifetime."""
    per_model = _WEIGHTS.setdefault(model, {})
    if weight_dtype not in per_model:
        per_model[weight_dtype] = FastLlamaWeights(model, weight_dtype)
    return per_model[weight_dtype]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE, rotate-half convention (as transformers' Llama). x: [T, heads, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class FastLlamaCausalLM(CausalLM):
    """A Llama `CausalLM` with a static KV cache; see the module docstring for why it is fast.

    `max_length` sizes the preallocated cache; a forward past it doubles the cache (a one-off
    copy), up to the model's `max_position_embeddings`, beyond which it raises ValueError.
    """

    backend = "fast"

    def __init__(self, model: PreTrainedModel, name: str = "fast", vocab_size: int | None = None,
                 weight_dtype: str = "float32", max_length: int = 2048) -> None:
        super().__init__()
        self.w = fast_weights(model, weight_dtype)
        self.name = name
        self.weight_dtype = weight_dtype
        self.vocab_size = vocab_size or model.config.vocab_size
        self.max_length = 0
        self._allocate(min(max_length, self.w.max_position_embeddings))

    def _allocate(self, max_length: int) -> None:
        w = self.w
        shape = (len(w.layers), w.n_kv_heads, max_length, w.head_dim)
        k, v = torch.zeros(shape), torch.zeros(shape)
        if self.max_length:  # growing: keep what is cached
            k[:, :, : self.length] = self.k[:, :, : self.length]
            v[:, :, : self.length] = self.v[:, :, : self.length]
        self.k, self.v = k, v
        self.cos, self.sin = w.rope_tables(max_length)
        self.max_length = max_length

    def _ensure_capacity(self, needed: int) -> None:
        if needed <= self.max_length:
            return
        limit = self.w.max_position_embeddings
        if needed > limit:
            raise ValueError(f"sequence of {needed} tokens exceeds the model's max_position_embeddings ({limit})")
        self._allocate(min(max(needed, 2 * self.max_length), limit))

    @torch.inference_mode()
    def _forward(self, tokens: Sequence[int], last_n: int) -> torch.Tensor:
        w, pos, n = self.w, self.length, len(tokens)
        if not 1 <= last_n <= n:
            raise ValueError(f"last_n must be in [1, {n}], got {last_n}")
        end = pos + n
        self._ensure_capacity(end)
        nh, nkv, hd = w.n_heads, w.n_kv_heads, w.head_dim
        cos, sin = self.cos[pos:end, None, :], self.sin[pos:end, None, :]
        # Queries sit at the end of the key range: position pos+i sees keys 0..pos+i.
        mask = None
        if n > 1:
            mask = torch.ones(n, end, dtype=torch.bool).tril(diagonal=pos)
        x = w.embed[torch.tensor(list(tokens))]  # [n, hidden]
        for i, layer in enumerate(w.layers):
            h = F.rms_norm(x, (x.shape[-1],), layer.input_norm, w.eps)
            q, k, v = layer.qkv(h).split((nh * hd, nkv * hd, nkv * hd), dim=-1)
            q = _rotate(q.view(n, nh, hd), cos, sin)
            self.k[i, :, pos:end] = _rotate(k.view(n, nkv, hd), cos, sin).transpose(0, 1)
            self.v[i, :, pos:end] = v.view(n, nkv, hd).transpose(0, 1)
            attn = F.scaled_dot_product_attention(
                q.transpose(0, 1), self.k[i, :, :end], self.v[i, :, :end], attn_mask=mask, enable_gqa=True
            )
            x = x + layer.o(attn.transpose(0, 1).reshape(n, nh * hd))
            h = F.rms_norm(x, (x.shape[-1],), layer.post_norm, w.eps)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        x = F.rms_norm(x[n - last_n:], (x.shape[-1],), w.norm, w.eps)
        return w.lm_head(x)[:, : self.vocab_size].float()

    def _crop(self, tokens_to_remove: int) -> None:
        pass  # positions >= self.length are simply overwritten by the next forward

    def _reset(self) -> None:
        pass

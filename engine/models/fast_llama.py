"""A fast CPU backend for Llama-architecture models, in the spirit of gpt-fast.

Why it is faster than `HFCausalLM` on a small, memory-bandwidth-bound CPU:

* The decoder is a plain loop of a few tensor ops per layer: no module hooks, masks built by
  transformers' generic code, or `DynamicCache` concatenation per step.
* The KV cache is preallocated ([layers, kv_heads, max_length, head_dim], sized to each generation
  by `reserve`); a forward writes into it in place and `rollback` only moves the length pointer, so rejected drafts cost nothing.
* Q/K/V and gate/up projections are fused into one matmul each (fewer, larger kernels).
* The LM head -- the biggest single matrix -- is applied only to the `last_n` positions asked for.
* Weights can be stored as float32, bfloat16, float16, int8, q4_1 or q4_1_a16: decoding reads every
  weight once per step, so fewer bytes per weight is most of the speed-up. The residual stream,
  norms, RoPE, attention and the KV cache stay float32 in every mode.
* Every format runs on our own kernels (cpu_kernels.c, compiled on first use for AVX-512 (with or
  without VNNI) or AVX2, whichever the CPU has), and the whole layer stack runs in one native call,
  so nothing runs in Python between the ops of a step. q4_1 stores GGUF's Q4_1 / Q8_0 blocks where
  they hold a model's weights exactly (the embedded target's do), float32 panels elsewhere, so its
  logits are float32's bit for bit from a sixth of the bytes (q4_1_blocks). q4_1_a16, the default,
  runs the same blocks against activations rounded to int16 (integer dot products, a third of the
  vector instructions): 1.3-1.4x faster, at a KL of ~6e-8 against float32. bfloat16 is the
  fastest float format (widening bf16 is a shift), at a KL of ~5e-5 against float32; float16 gives
  KL ~2e-6; int8 (llama.cpp's Q8_0 layout with int16 activations) is slowest to verify, at a KL of
  ~1e-3; float32 streams the most bytes.
* Without the kernels (no C compiler or no AVX2) the layer loop runs in Python over prepacked
  GEMMs (oneDNN for fp32, fbgemm's fp16 for both 16-bit formats), with the glue between them in
  torch ops.
* Verifying K+1 tokens reads each weight once for all rows. One row is memory-bound; beyond it
  the GEMMs become compute-bound the sooner the fewer bytes a weight has: on the default target 5
  rows cost ~1.15x one row in float32, ~1.9-2.0x in the 16-bit formats and ~3x in int8 (Zen 1).
* A long prompt prefilled into an empty cache in float16, q4_1 or int8 uses a register-blocked GEMM
  (cpu_kernels.linear_wide, 1.1-1.5x faster). For int8 it is the one forward whose rows are not
  batch-invariant, and every engine prefills the same way.

Converted weights are built once per (model, weight_dtype) and shared by every instance, so
instances stay cheap to create like any `CausalLM`: only the KV cache is per-instance state.
Measured numbers and the commands behind them: assets/FAST_BACKEND.md.
"""

from __future__ import annotations

import ctypes
import time
import weakref
from functools import cached_property
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from engine.models import cpu_kernels, huge_pages, q4_1_blocks
from engine.models.causal_lm import CausalLM

if TYPE_CHECKING:  # annotations only
    from engine.acceptance import NativeRule

WEIGHT_DTYPES = ("float32", "float16", "bfloat16", "int8", "q4_1", "q4_1_a16")
_GGUF_BLOCK_DTYPES = ("q4_1", "q4_1_a16")  # formats that look for a model's GGUF blocks (q4_1_blocks)
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


def _has_op(namespace: str, name: str) -> bool:
    try:
        getattr(getattr(torch.ops, namespace), name)
        return True
    except (AttributeError, RuntimeError):
        return False


# Prepacked-weight GEMMs whose cost stays nearly flat from 1 to 8 rows on this kind of CPU (AVX2),
# unlike F.linear's MKL path (5 rows cost ~4x one row), which matters for verifying K+1 tokens.
_ONEDNN_FP32 = torch.backends.mkldnn.is_available() and _has_op("mkldnn", "_linear_pointwise")
_FBGEMM_FP16 = "fbgemm" in torch.backends.quantized.supported_engines and _has_op("quantized", "linear_dynamic_fp16")


class PackedLinear:
    """y = x @ W.T for float32 x [M, in] -> float32 y [M, out], W stored in `dtype`.

    Where the native kernels built (cpu_kernels.c), every format runs on them, with fp32
    activations and accumulation:
    float32, float16, bfloat16  weights in 16-channel panels (`cpu_kernels.panel_linear`);
    q4_1     the GGUF blocks that reproduce the float weights exactly (Q4_1, or Q8_0 for the
             embedding), else float32 panels (`q4_1_blocks.exact_blocks`): the float32 reference's
             products, bit for bit, from a sixth of the bytes;
    int8     llama.cpp's Q8_0 weights (int8 per group of 32) x int16 activations (per row and
             group, so a row's result never depends on the other rows), exact integer group sums,
             float32 accumulation across groups.
    q4_1_a16 q4_1's blocks against int16 activations as int8 has them: exact integer products
             (VNNI's vpdpwssd where the CPU has it), so the activations' rounding is its only
             difference from q4_1 (the fallback without the kernels is q4_1's).
    A prefill (`prefill=True`) runs through `cpu_kernels.linear_wide` instead. Without the
    kernels: float32 and q4_1 on oneDNN with a prepacked float32 weight, both 16-bit formats on
    fbgemm's fp16 GEMM (bf16 values in fp16's range are exact in fp16), int8 in torch.
    `format` is the storage format of this GEMM (for q4_1: "q4_1", "q8_0" or "float32").
    """

    _PANEL_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

    def __init__(self, weight: torch.Tensor, dtype: str) -> None:
        if dtype not in WEIGHT_DTYPES:
            raise ValueError(f"unknown weight_dtype {dtype!r}; expected one of {', '.join(WEIGHT_DTYPES)}")
        self.dtype = self.format = dtype
        self.out_features = weight.shape[0]
        self.scales = None  # int8 only
        self.native = cpu_kernels.available()
        weight = weight.detach().float().contiguous()
        if dtype == "int8":
            self.weight, self.scales = cpu_kernels.quantize_q8(weight)
        elif self.native and dtype in _GGUF_BLOCK_DTYPES:
            self.format, self.weight = q4_1_blocks.exact_blocks(weight, int16_activations=dtype == "q4_1_a16")
        elif self.native:
            self.weight = cpu_kernels.pack_panels(weight, self._PANEL_DTYPES[dtype])
        elif dtype in ("float32", *_GGUF_BLOCK_DTYPES):
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None) if _ONEDNN_FP32 else weight
        else:
            rounded = weight.to(self._PANEL_DTYPES[dtype]).float()
            self.weight = torch.ops.quantized.linear_prepack_fp16(rounded, None) if _FBGEMM_FP16 else rounded

    def __call__(self, x: torch.Tensor, prefill: bool = False) -> torch.Tensor:
        """`prefill`: rows need not be batch-invariant (see cpu_kernels.WIDE_MIN_ROWS)."""
        if self.native and prefill:
            return cpu_kernels.linear_wide(x, self.weight, self.out_features, self.scales, self.format)
        if self.dtype == "int8":  # native or its torch fallback
            return cpu_kernels.q8_linear(x, self.weight, self.scales)
        if self.native:
            return cpu_kernels.panel_linear(x, self.weight, self.out_features, self.format)
        if self.dtype in ("float32", *_GGUF_BLOCK_DTYPES) and _ONEDNN_FP32:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")
        if self.dtype not in ("float32", *_GGUF_BLOCK_DTYPES) and _FBGEMM_FP16:
            return torch.ops.quantized.linear_dynamic_fp16(x, self.weight)
        return F.linear(x, self.weight)


def onto_huge_pages(linears: Sequence[PackedLinear]) -> None:
    """Move the native GEMMs' weights (and int8 scales) into one arena on 2 MB pages
    (`huge_pages.arena_copies`): the bytes a decode streams, on a few dozen TLB entries."""
    fields = [(lin, name) for lin in linears if lin.native for name in ("weight", "scales")
              if getattr(lin, name) is not None]
    for (lin, name), copy in zip(fields, huge_pages.arena_copies([getattr(lin, name) for lin, name in fields])):
        setattr(lin, name, copy)


def _interleave_heads(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Reorder each head's output rows from rotate-half pairs (i, i+d/2) to adjacent pairs (2i, 2i+1).

    Applied to both q and k rows it leaves every q.k product unchanged, and lets RoPE run as one
    complex multiply on the projection output (as in gpt-fast) instead of slice/neg/cat/mul/add.
    """
    out, d = weight.shape[0], head_dim
    return weight.view(out // d, 2, d // 2, -1).transpose(1, 2).reshape(weight.shape)


class _Layer:
    def __init__(self, layer, dtype: str, head_dim: int) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.input_norm = layer.input_layernorm.weight.detach()
        self.post_norm = layer.post_attention_layernorm.weight.detach()
        # The softmax scale is folded into W_q (exact when sqrt(head_dim) is a power of two, as for 64).
        q = _interleave_heads(attn.q_proj.weight.detach(), head_dim) * head_dim**-0.5
        k = _interleave_heads(attn.k_proj.weight.detach(), head_dim)
        self.qkv = PackedLinear(torch.cat([q, k, attn.v_proj.weight.detach()]), dtype)
        self.o = PackedLinear(attn.o_proj.weight, dtype)
        self.gate_up = PackedLinear(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), dtype)
        self.down = PackedLinear(mlp.down_proj.weight, dtype)


class FastLlamaWeights:
    """The converted weights of one model in one weight format (shared by all instances)."""

    def __init__(self, model: PreTrainedModel, weight_dtype: str) -> None:
        if not fast_backend_supported(model):
            raise ValueError(f"the fast backend does not support this model ({type(model).__name__}, "
                             f"model_type={getattr(model.config, 'model_type', None)!r}); use the transformers backend")
        cfg = model.config
        if weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"unknown weight_dtype {weight_dtype!r}; expected one of {', '.join(WEIGHT_DTYPES)}")
        self.weight_dtype = weight_dtype
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.hidden = cfg.hidden_size
        self.vocab_size = cfg.vocab_size
        self.max_position_embeddings = cfg.max_position_embeddings
        with torch.inference_mode():
            self.embed = model.model.embed_tokens.weight.detach()  # lookups stay float32, shared
            self.layers = [_Layer(layer, weight_dtype, self.head_dim) for layer in model.model.layers]
            onto_huge_pages([getattr(layer, name) for layer in self.layers for name in cpu_kernels.NativeDecoder.GEMMS])
            self.norm = model.model.norm.weight.detach()
        self._head_weight = model.lm_head.weight
        rotary = model.model.rotary_emb
        self.inv_freq = rotary.inv_freq.detach().float().clone()
        self.rope_scaling = float(rotary.attention_scaling)

    @cached_property
    def native_decoder(self) -> cpu_kernels.NativeDecoder | None:
        """The whole layer stack as one native call, where the kernels built and the sizes fit."""
        if not self.layers[0].qkv.native or (
                self.hidden % cpu_kernels.GROUP or self.n_heads * self.head_dim % cpu_kernels.GROUP):
            return None
        layers = [{name: getattr(layer, name) for name in cpu_kernels.NativeDecoder.GEMMS}
                  | {"input_norm": layer.input_norm, "post_norm": layer.post_norm} for layer in self.layers]
        return cpu_kernels.NativeDecoder(layers, self.norm, mlp=self.layers[0].gate_up.out_features // 2,
                                         heads=self.n_heads, kv_heads=self.n_kv_heads, head_dim=self.head_dim,
                                         eps=self.eps)

    @cached_property
    def target_step(self) -> cpu_kernels.TargetStep | None:
        """A whole forward (embedding rows, layers, head) as one native call, where the layers and the
        head both run on the kernels."""
        if self.native_decoder is None or not self.lm_head.native:
            return None
        return cpu_kernels.TargetStep(self.embed, self.lm_head, self.native_decoder)

    @cached_property
    def lm_head(self) -> PackedLinear:
        """Converted on first use: a feature draft runs its layers through this backend but never
        this head (it has its own reduced one), so it should not pay for converting it."""
        with torch.inference_mode():
            head = PackedLinear(self._head_weight, self.weight_dtype)
            onto_huge_pages([head])
            return head

    def rope_table(self, length: int) -> torch.Tensor:
        """Rotations [length, head_dim/2, 2] as (cos, sin) pairs, from transformers' float32 cos/sin."""
        freqs = torch.arange(length, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        return torch.stack([freqs.cos() * self.rope_scaling, freqs.sin() * self.rope_scaling], dim=-1)


_WEIGHTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def fast_weights(model: PreTrainedModel, weight_dtype: str = "float32") -> FastLlamaWeights:
    """Converted weights for `model`, built on first use and cached for the model's lifetime."""
    per_model = _WEIGHTS.setdefault(model, {})
    if weight_dtype not in per_model:
        per_model[weight_dtype] = FastLlamaWeights(model, weight_dtype)
    return per_model[weight_dtype]


def _add_rms_norm(x: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Residual add (in place: x is ours), then the next RMSNorm."""
    if y is not None:
        x += y
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _attention(qkv: torch.Tensor, rope: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               pos: int, mask: torch.Tensor | None, n_heads: int, n_kv_heads: int) -> torch.Tensor:
    """RoPE, write K/V into the cache at [pos, pos+n), attend over [0, pos+n). Returns [n, heads*head_dim].

    rope: [n, head_dim/2, 2] (cos, sin); mask: additive [n, pos+n], or None for causal (query i
    sees keys 0..pos+i).

    q/k rows come interleaved and q pre-scaled (see `_Layer`). Grouped-query attention runs as
    two bmm's over [kv_heads, group*n, head_dim] queries: no K/V repeat, and at a handful of
    queries this is ~2x faster than F.scaled_dot_product_attention on this CPU.
    """
    n, hd = qkv.shape[0], k_cache.shape[-1]
    end, group, n_qk = pos + n, n_heads // n_kv_heads, n_heads + n_kv_heads
    if mask is None and n > 1:
        mask = torch.full((n, end), float("-inf")).triu_(diagonal=pos + 1)
    qk = torch.view_as_complex(qkv[:, : n_qk * hd].view(n, n_qk, hd // 2, 2)) * torch.view_as_complex(rope)[:, None]
    qk = torch.view_as_real(qk).view(n, n_qk, hd)
    k_cache[:, pos:end] = qk[:, n_heads:].transpose(0, 1)
    v_cache[:, pos:end] = qkv[:, n_qk * hd:].view(n, n_kv_heads, hd).transpose(0, 1)
    q = qk[:, :n_heads].view(n, n_kv_heads, group, hd).permute(1, 2, 0, 3).reshape(n_kv_heads, group * n, hd)
    scores = torch.bmm(q, k_cache[:, :end].transpose(1, 2))
    if mask is not None:
        scores = (scores.view(n_kv_heads, group, n, end) + mask).view(n_kv_heads, group * n, end)
    out = torch.bmm(scores.softmax(dim=-1), v_cache[:, :end])
    return out.view(n_kv_heads, group, n, hd).permute(2, 0, 1, 3).reshape(n, n_heads * hd)


class _TorchGlue:
    """The decoder's glue in plain torch ops: the reference, and the fallback without a C compiler."""

    add_rms_norm = staticmethod(_add_rms_norm)
    silu_mul = staticmethod(_silu_mul)
    attention = staticmethod(_attention)


def _glue():
    """The native kernels (cpu_kernels.c: one call per norm / MLP activation / attention instead of
    ~25 small torch ops per layer) where they built, else the torch versions."""
    return cpu_kernels if cpu_kernels.available() else _TorchGlue


INITIAL_CACHE_POSITIONS = 256  # a target's cache before `reserve` (FastLlamaCausalLM)


class FastLlamaCausalLM(CausalLM):
    """A Llama `CausalLM` with a static KV cache; see the module docstring for why it is fast.

    `max_length` sizes the cache allocated up front; `reserve` grows it to a generation's length
    before its prefill, and a forward past it doubles it (a one-off copy), up to the model's
    `max_position_embeddings`, beyond which it raises ValueError. The default is small because the
    cache is zeroed float32 (K and V: 94 MB for 2,048 positions of the default target, 61 ms to
    allocate on AMD EPYC Zen 3), and the playground makes a target per run: a 96-token run needs
    ~140 positions, and its first token came those 61 ms later.
    """

    backend = "fast"
    supports_tree = True

    def __init__(self, model: PreTrainedModel, name: str = "fast", vocab_size: int | None = None,
                 weight_dtype: str = "float32", max_length: int = INITIAL_CACHE_POSITIONS) -> None:
        super().__init__()
        self.w = fast_weights(model, weight_dtype)
        self.name = name
        self.weight_dtype = weight_dtype
        self.vocab_size = vocab_size or model.config.vocab_size
        self.max_length = 0
        self._allocate(min(max_length, self.w.max_position_embeddings))

    @property
    def backend_label(self) -> str:
        return f"fast/{self.weight_dtype}"

    def _allocate(self, max_length: int) -> None:
        w = self.w
        shape = (len(w.layers), w.n_kv_heads, max_length, w.head_dim)
        k, v = torch.zeros(shape), torch.zeros(shape)
        if self.max_length:  # growing: keep what is cached, tree scratch slots included
            k[:, :, : self.max_length] = self.k
            v[:, :, : self.max_length] = self.v
            cpu_kernels.quiesce()  # no kernel thread still reads the caches about to be freed
        else:
            cpu_kernels.release_guard(self)
        self.k, self.v = k, v
        self.rope = w.rope_table(max_length)
        self.max_length = max_length
        self._pointers = (k.data_ptr(), v.data_ptr(), self.rope.data_ptr(), self.rope.stride(0) * self.rope.element_size())

    def reserve(self, length: int) -> None:
        if length > self.max_length:
            self._allocate(min(length, self.w.max_position_embeddings))

    def _ensure_capacity(self, needed: int) -> None:
        if needed <= self.max_length:
            return
        limit = self.w.max_position_embeddings
        if needed > limit:
            raise ValueError(f"sequence of {needed} tokens exceeds the model's max_position_embeddings ({limit})")
        self._allocate(min(max(needed, 2 * self.max_length), limit))

    @torch.inference_mode()
    def _forward(self, tokens: Sequence[int], last_n: int) -> torch.Tensor:
        n = len(tokens)
        if not 1 <= last_n <= n:
            raise ValueError(f"last_n must be in [1, {n}], got {last_n}")
        if self._step is not None:
            self.last_hidden, logits = self._step(tokens, self.native_slots(n), last_n)
        else:
            h = self._decode(self.w.embed[torch.tensor(list(tokens))])
            self.last_hidden = h
            logits = self.w.lm_head(h[n - last_n:])
        return logits if logits.shape[1] == self.vocab_size else logits[:, : self.vocab_size]

    def forward_after(self, first: torch.Tensor, tokens: Sequence[int]) -> torch.Tensor:
        """The forward's rows written after a copy of `first` in one buffer: no torch op after the
        forward. The first round's `torch.cat` there took 0.12 ms a generation, and 2 ms where it
        woke an OpenMP team while the kernels' pool was still spinning (Intel Xeon, 2 cores)."""
        n = len(tokens)
        if not self._one_call_with_vocabulary(n) or first.shape != (1, self.vocab_size):
            return super().forward_after(first, tokens)
        logits, row = torch.empty(1 + n, self.vocab_size), first.detach().float().contiguous()  # row: alive for the copy
        ctypes.memmove(logits.data_ptr(), row.data_ptr(), 4 * self.vocab_size)
        start = time.perf_counter()
        self.last_hidden, _ = self._step(tokens, self.native_slots(n), n, hidden_at=self._hidden_at(n),
                                         logits_at=logits.data_ptr() + 4 * self.vocab_size)
        self.book_forward(n, start)
        return logits

    def forward_with_rule(self, tokens: Sequence[int], rule: NativeRule) -> torch.Tensor | None:
        n = len(tokens)
        if not self._one_call_with_vocabulary(n):
            return None
        start = time.perf_counter()
        self.last_hidden, logits = self._step(tokens, self.native_slots(n), n, rule.pointers, self._hidden_at(n))
        self.book_forward(n, start)
        self.forward_seconds -= rule.seconds
        return logits

    def _one_call_with_vocabulary(self, n: int) -> bool:
        """Whether n fed tokens can go through the native step with its head's rows the vocabulary
        (what `forward_after` and `forward_with_rule` write their logits for)."""
        return self._step is not None and self._step.head_rows == self.vocab_size and n > 0

    def _hidden_at(self, n: int) -> int | None:
        """Where a native step writes the hidden states of n fed positions: the draft's rows
        (`feature_rows`), a scratch nobody reads (`keep_hidden` off), or a new tensor (None)."""
        if self.feature_rows is not None:
            return self.feature_rows.rows_at(self.length, n)
        return None if self.keep_hidden else self._step.scratch("hidden", n)[1]

    @cached_property
    def _step(self) -> cpu_kernels.TargetStep | None:
        """The weights' one-call forward (looked up on the first forward: a feature draft that runs its
        layers here never converts the head)."""
        return self.w.target_step

    @torch.inference_mode()
    def _forward_embeds(self, embeds: torch.Tensor) -> torch.Tensor:
        return self._decode(embeds.float().clone())

    def native_slots(self, n: int) -> tuple[int, int, int, int, int, bool]:
        """Where n more input vectors go through the native decoder, as `cpu_kernels.FeatureStep` and
        `TargetStep` take them: (k cache, v cache, capacity, rope rows from position `length`, first slot,
        wide), the cache grown first if needed (pointers kept from the allocation: no torch op here,
        which after a forward would cost tens of microseconds). For callers that hold a native step,
        which exists only where `w.native_decoder` does. The caller books the forward (`book_forward`)."""
        pos = self.length
        self._ensure_capacity(pos + n)
        k, v, rope, row_bytes = self._pointers
        return k, v, self.max_length, rope + pos * row_bytes, pos, pos == 0 and n >= cpu_kernels.WIDE_MIN_ROWS

    def native_tree_slots(self, positions: Sequence[int], slot: int, visible: torch.Tensor
                          ) -> tuple[tuple[int, int, int], torch.Tensor, torch.Tensor]:
        """What a tree step through a native step (`cpu_kernels.FeatureStep.tree`) needs, as `forward_tree`
        lays it out: ((k cache, v cache, capacity), the positions' rope rows, the additive mask)."""
        rope, mask = self._tree_layout(positions, slot, visible)
        k, v, _, _ = self._pointers
        return (k, v, self.max_length), rope, mask

    def _decode(self, x: torch.Tensor, tree: tuple[torch.Tensor, int, torch.Tensor] | None = None) -> torch.Tensor:
        """Run the layers on input vectors x [n, hidden] at positions length..length+n; return the
        final-norm hidden states [n, hidden]. x is consumed (the residual stream is updated in place).
        `tree` = (rope rows, first cache slot, additive mask) replaces the causal layout (forward_tree)."""
        w, n = self.w, x.shape[0]
        if tree is None:
            pos = self.length
            end = pos + n
            self._ensure_capacity(end)
            rope = self.rope[pos:end]
            mask = None  # causal: queries sit at the end of the key range
        else:
            rope, pos, mask = tree
        glue = _glue()
        wide = tree is None and pos == 0 and n >= cpu_kernels.WIDE_MIN_ROWS
        if glue is cpu_kernels and w.native_decoder is not None:
            return w.native_decoder(x, rope, self.k, self.v, pos, mask, wide)
        h = glue.add_rms_norm(x, None, w.layers[0].input_norm, w.eps)
        for i, layer in enumerate(w.layers):
            attn = glue.attention(layer.qkv(h, wide), rope, self.k[i], self.v[i], pos, mask, w.n_heads, w.n_kv_heads)
            h = glue.add_rms_norm(x, layer.o(attn, wide), layer.post_norm, w.eps)
            out = layer.down(glue.silu_mul(layer.gate_up(h, wide)), wide)
            h = glue.add_rms_norm(x, out, w.layers[i + 1].input_norm if i + 1 < len(w.layers) else w.norm, w.eps)
        return h

    @torch.inference_mode()
    def forward_tree(self, tokens: Sequence[int], positions: Sequence[int], slot: int,
                     visible: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        h = self._tree_hidden(self.w.embed[torch.tensor(list(tokens))], positions, slot, visible)
        self.last_hidden = h
        logits = self.w.lm_head(h)[:, : self.vocab_size]
        self.forward_seconds += time.perf_counter() - start
        self.num_forwards += 1
        return logits

    @torch.inference_mode()
    def forward_tree_embeds(self, embeds: torch.Tensor, positions: Sequence[int], slot: int,
                            visible: torch.Tensor) -> torch.Tensor:
        """`forward_tree` on input vectors (feature drafts); returns final-norm hidden states [n, H]."""
        start = time.perf_counter()
        h = self._tree_hidden(embeds.float().clone(), positions, slot, visible)
        self.forward_seconds += time.perf_counter() - start
        self.num_forwards += 1
        return h

    def _tree_hidden(self, x: torch.Tensor, positions: Sequence[int], slot: int, visible: torch.Tensor) -> torch.Tensor:
        if len(positions) != x.shape[0]:
            raise ValueError(f"tree forward needs one position per input row: {x.shape[0]} rows, {len(positions)} positions")
        rope, mask = self._tree_layout(positions, slot, visible)
        return self._decode(x, (rope, slot, mask))

    def _tree_layout(self, positions: Sequence[int], slot: int, visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rope rows of `positions`, additive mask from `visible`), the cache grown to hold the tree."""
        n = len(positions)
        if slot < self.length or tuple(visible.shape) != (n, slot + n):
            raise ValueError(f"tree forward needs slot >= length ({self.length}) and a [{n}, {slot + n}] "
                             f"visibility mask; got slot {slot}, mask {tuple(visible.shape)}")
        self._ensure_capacity(max(slot + n, max(positions) + 1))
        mask = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
        return self.rope[torch.tensor(list(positions))], mask

    def _crop(self, tokens_to_remove: int) -> None:
        pass  # positions >= self.length are simply overwritten by the next forward

    def _reset(self) -> None:
        pass

"""Native CPU kernels (cpu_kernels.c), compiled on first use and loaded with ctypes.

Why C and not a torch extension: the kernel needs no ATen, so a plain `cc -O3 -mavx2` build takes
about a second (a torch C++ extension takes a minute of header parsing), and a ctypes call costs a
few microseconds. The library links `libgomp.so.1`, the OpenMP runtime torch itself loads, so it
shares torch's thread pool and follows `torch.set_num_threads`.

Everything here is optional: `available()` is False without a C compiler or without AVX2/FMA/F16C, and
callers then fall back to plain torch ops (and, for float16 GEMMs, fbgemm).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.models.cache_dir import cache_root

GROUP = 32  # int8 quantization group along the input dimension, as in cpu_kernels.c
PANEL = 16  # output channels per panel of the float weight layout (`pack_panels`), as in cpu_kernels.c
# A prefill of at least this many rows into an empty cache runs its GEMMs through `linear_wide`
# (faster from about 20 rows on in fp16 and int8). Every engine prefills a prompt that way, so AR,
# SpS and SSD still share the prompt's KV cache bit for bit; everything after the prefill
# (decoding, verification, trees) keeps the batch-invariant kernels (`panel_linear`, `q8_linear`).
WIDE_MIN_ROWS = 24
# The formats `linear_wide` runs its own GEMM for; cpu_kernels.c sends the others (fp32 and bf16
# panels, nothing to widen) on to `panel_linear`.
WIDE_FORMATS = ("float16", "int8")
_SOURCE = Path(__file__).with_name("cpu_kernels.c")
_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC"]


def _cpu_supported() -> bool:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return False
    return {"avx2", "fma", "f16c"} <= set(flags.split())


def _build() -> Path:
    """Compile cpu_kernels.c into the cache, keyed by the source and flags (a no-op once built)."""
    source = _SOURCE.read_bytes()
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    key = hashlib.sha256(source + " ".join(_FLAGS).encode()).hexdigest()[:16]
    target = cache_root() / "kernels" / f"cpu_kernels-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # atomic: concurrent builders race safely
            out = Path(tmp) / target.name
            subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", str(out)], check=True, capture_output=True)
            os.replace(out, target)
    return target


class _DecoderLayout(ctypes.Structure):
    """Mirror of `Decoder` in cpu_kernels.c: per-layer pointer arrays and the model's sizes."""

    _fields_ = [(name, ctypes.POINTER(ctypes.c_void_p)) for name in
                ("qkv_q", "o_q", "gate_up_q", "down_q", "qkv_s", "o_s", "gate_up_s", "down_s",
                 "input_norm", "post_norm")] + [("final_norm", ctypes.c_void_p)] + [
                (name, ctypes.c_int64) for name in
                ("format", "layers", "hidden", "mlp", "mlp_padded", "heads", "kv_heads", "head_dim")] + [
                ("eps", ctypes.c_float)]


@cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("SPECPLAY_NO_NATIVE") or not _cpu_supported():
        return None
    try:
        lib = ctypes.CDLL(str(_build()))
    except (OSError, RuntimeError, subprocess.CalledProcessError):
        return None
    ptr, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    signatures = {
        "q8_linear": [ptr, i64, i64, ptr, ptr, i64, ptr],
        "panel_linear": [ptr, i64, i64, ptr, i64, ptr, ctypes.c_int],
        "linear_wide": [ptr, i64, i64, ptr, ptr, ctypes.c_int, i64, ptr],
        "add_rms_norm": [ptr, ptr, ptr, f32, ptr, i64, i64],
        "silu_mul": [ptr, ptr, i64, i64],
        "attention": [ptr, i64, ptr, ptr, ptr, i64, i64, ptr, i64, i64, i64, ptr],
        "decoder_forward": [ctypes.POINTER(_DecoderLayout), ptr, i64, ptr, ptr, i64, ptr, i64, ptr, ctypes.c_int,
                            ptr],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = None, argtypes
    return lib


def available() -> bool:
    """True when the native kernels compiled and loaded on this machine."""
    return _library() is not None


def quantize_q8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 in groups of GROUP input columns: weight [N, K] -> (q [N, K'], scales [N, K'/GROUP]).

    K is zero-padded to K' (a multiple of GROUP); callers pad x to match. The scale is max|w|/127
    per group, as llama.cpp's Q8_0.
    """
    weight = pad_to_group(weight.detach().float())
    groups = weight.view(weight.shape[0], -1, GROUP)
    scales = (groups.abs().amax(dim=-1) / 127.0).clamp_min(1e-12)
    q = (groups / scales[..., None]).round().clamp(-127, 127).to(torch.int8)
    return q.view(weight.shape).contiguous(), scales.contiguous()


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of GROUP) -> int16 per group of GROUP, scale max|x|/32767, as the kernel does."""
    groups = x.view(x.shape[0], -1, GROUP)
    scales = (groups.abs().amax(dim=-1) / 32767.0).clamp_min(1e-12)
    q = (groups / scales[..., None]).round().clamp(-32767, 32767).to(torch.int16)
    return q.view(x.shape), scales


def dequantize_q8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Back to float32 from either quantizer: q [N, K] (int8 or int16), one scale per group of GROUP."""
    return (q.view(q.shape[0], -1, GROUP).float() * scales[..., None]).view(q.shape)


def pad_to_group(t: torch.Tensor) -> torch.Tensor:
    pad = -t.shape[-1] % GROUP
    return F.pad(t, (0, pad)) if pad else t


def q8_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 x [M, K] @ Q8_0 weights (q [N, K'], scales from `quantize_q8`)^T -> float32 [M, N].

    x is quantized to int16 per row and group of GROUP (so each row's result depends on that row
    alone, and the activations add ~250x less rounding error than the int8 weights), the group
    dot products are exact in int32, and groups are summed in float32. Without the native kernel
    the same math runs in torch: slower, and equal up to float summation order.
    """
    x = pad_to_group(x.float()).contiguous()
    m, k = x.shape
    if k != q.shape[1]:
        raise ValueError(f"x has {k} columns (after padding to {GROUP}), the weights {q.shape[1]}")
    lib = _library()
    if lib is None:  # the same product: the scales factor out of each group's dot product
        return F.linear(dequantize_q8(*quantize_activations(x)), dequantize_q8(q, scales))
    y = torch.empty(m, q.shape[0])
    lib.q8_linear(x.data_ptr(), m, k, q.data_ptr(), scales.data_ptr(), q.shape[0], y.data_ptr())
    return y


def pack_panels(weight: torch.Tensor, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """float weight [N, K] -> panels [ceil(N / PANEL), K', PANEL] in `dtype` (float16, bfloat16 or
    float32), the layout `panel_linear` streams.

    For each input k a panel's PANEL output channels sit in one load, so a GEMM reads the weights
    front to back and multiplies each by a broadcast activation (no horizontal sums). K is
    zero-padded to K' (a multiple of GROUP), N to a multiple of PANEL. bfloat16 stores channel c
    next to c + 8 (the kernel widens the even and odd halves with a shift and a mask).
    """
    w = pad_to_group(weight.detach().float())
    k = w.shape[1]
    w = F.pad(w, (0, 0, 0, -w.shape[0] % PANEL))
    panels = w.to(dtype).view(-1, PANEL, k).transpose(1, 2)
    if dtype == torch.bfloat16:
        panels = panels.reshape(-1, k, 2, PANEL // 2).transpose(2, 3)
    return panels.contiguous().view(-1, k, PANEL)


_PANEL_FORMATS = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}  # cpu_kernels.c's codes (0: int8)


def panel_linear(x: torch.Tensor, panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """float32 x [M, K] @ W^T, W [out_features, K] stored by `pack_panels` -> float32 [M, out_features],
    accumulated in float32 on the native kernel (rows independent, as `q8_linear`)."""
    x = pad_to_group(x.float()).contiguous()
    y = torch.empty(x.shape[0], out_features)
    _library().panel_linear(x.data_ptr(), x.shape[0], x.shape[1], panels.data_ptr(), out_features, y.data_ptr(),
                            _PANEL_FORMATS[panels.dtype])
    return y


def linear_wide(x: torch.Tensor, weight: torch.Tensor, out_features: int,
                scales: torch.Tensor | None = None) -> torch.Tensor:
    """The prefill GEMM: `panel_linear` (weight: `pack_panels`) or `q8_linear` (weight and scales:
    `quantize_q8`) for many rows. fp16 and int8 weights are widened to float32 once per panel of 16
    channels and a 6 x 16 register block runs near the FMA peak; fp32 and bf16 panels stay on
    `panel_linear`. fp16 rows equal `panel_linear`'s bit for bit; int8 weights meet float32
    activations here, so int8 rows differ from `q8_linear`'s (prefills only: `WIDE_MIN_ROWS`)."""
    x = pad_to_group(x.float()).contiguous()
    y = torch.empty(x.shape[0], out_features)
    weight_format = 0 if scales is not None else _PANEL_FORMATS[weight.dtype]
    _library().linear_wide(x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(),
                           None if scales is None else scales.data_ptr(), weight_format, out_features, y.data_ptr())
    return y


# The decoder's glue ops, for fast_llama's native path. Inputs are float32 and contiguous where it
# matters (the caller's own buffers); each call replaces several small torch ops.

def add_rms_norm(x: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x += y in place (the residual stream), then return RMSNorm(x) * weight."""
    out = torch.empty_like(x)
    _library().add_rms_norm(x.data_ptr(), None if y is None else y.data_ptr(), weight.data_ptr(), eps,
                            out.data_ptr(), x.shape[0], x.shape[1])
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for gate_up = [gate | up] along the last dimension."""
    m, f = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(m, f)
    _library().silu_mul(gate_up.data_ptr(), out.data_ptr(), m, f)
    return out


def attention(qkv: torch.Tensor, rope: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot: int,
              mask: torch.Tensor | None, n_heads: int, n_kv_heads: int) -> torch.Tensor:
    """RoPE, K/V cache write at [slot, slot+n) and grouped-query attention in one call; see
    fast_llama._attention (the torch version) for the layout. rope: [n, head_dim/2, 2] (cos, sin)."""
    n, hd = qkv.shape[0], k_cache.shape[-1]
    out = torch.empty(n, n_heads * hd)
    rope, mask = rope.contiguous(), None if mask is None else mask.contiguous()  # kept alive across the call
    _library().attention(qkv.data_ptr(), n, rope.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                         k_cache.shape[1], slot, None if mask is None else mask.data_ptr(), n_heads, n_kv_heads, hd,
                         out.data_ptr())
    return out


class NativeDecoder:
    """A whole Llama decoder stack as one native call (`decoder_forward` in cpu_kernels.c), with
    int8 (`quantize_q8`) or float16, bfloat16 and float32 panels (`pack_panels`).

    Between the ops of a decode step there is then no Python, no ctypes call and no OpenMP
    wake-up: on the default target that was ~4 of ~17 ms per int8 token. The weights stay owned
    by the caller's tensors (referenced here so they outlive the pointers).
    """

    FORMATS = {"int8": 0, "float16": 1, "bfloat16": 2, "float32": 3}

    def __init__(self, weight_format: str, layers: Sequence[dict[str, torch.Tensor | None]], final_norm: torch.Tensor,
                 *, mlp: int, heads: int, kv_heads: int, head_dim: int, eps: float) -> None:
        """layers: per layer, the weights qkv_q, o_q, gate_up_q, down_q (int8 [N, K'] or panels
        [N / PANEL, K', PANEL], K' padded to GROUP), their scales qkv_s, ... (int8; None
        otherwise) and the norm weights input_norm, post_norm."""
        hidden = final_norm.shape[0]
        if hidden % GROUP or heads * head_dim % GROUP:
            raise ValueError(f"the native decoder needs hidden size and heads x head_dim divisible by {GROUP}")
        self._keep = [layers, final_norm]
        arrays = {}
        for name in ("qkv_q", "o_q", "gate_up_q", "down_q", "qkv_s", "o_s", "gate_up_s", "down_s",
                     "input_norm", "post_norm"):
            ptrs = [None if layer[name] is None else layer[name].data_ptr() for layer in layers]
            arrays[name] = (ctypes.c_void_p * len(layers))(*ptrs)
        self._keep.append(arrays)
        self.layout = _DecoderLayout(**arrays, final_norm=final_norm.data_ptr(), format=self.FORMATS[weight_format],
                                     layers=len(layers), hidden=hidden, mlp=mlp,
                                     mlp_padded=mlp + -mlp % GROUP, heads=heads, kv_heads=kv_heads,
                                     head_dim=head_dim, eps=eps)

    def __call__(self, x: torch.Tensor, rope: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot: int,
                 mask: torch.Tensor | None, wide: bool = False) -> torch.Tensor:
        """x [n, hidden] (consumed: the residual stream) at cache slots [slot, slot+n) -> final-norm
        hidden states [n, hidden]; caches [layers, kv_heads, cap, head_dim]; rope and mask as `attention`;
        wide: a prefill whose GEMMs may use `linear_wide`."""
        x = x.contiguous()
        out = torch.empty_like(x)
        rope, mask = rope.contiguous(), None if mask is None else mask.contiguous()  # kept alive across the call
        _library().decoder_forward(ctypes.byref(self.layout), x.data_ptr(), x.shape[0], k_cache.data_ptr(),
                                   v_cache.data_ptr(), k_cache.shape[2], rope.data_ptr(), slot,
                                   None if mask is None else mask.data_ptr(), int(wide), out.data_ptr())
        return out

"""Native CPU kernels (cpu_kernels.c), compiled on first use and loaded with ctypes.

Why C and not a torch extension: the kernel needs no ATen, so a plain `cc -O3` build takes
about a second (a torch C++ extension takes a minute of header parsing), and a ctypes call costs a
few microseconds. Its threads are its own (work_pool.h): a forward's phases are split into items
that whichever thread is running takes, so a thread the OS preempts no longer holds the others at
the end of each of a forward's ~240 parallel steps (as OpenMP's did). It uses as many threads as
`torch.get_num_threads()` (libgomp's setting, which `torch.set_num_threads` changes). A thread that
was preempted may read a job's weights and KV caches after the job returned: whoever frees them
calls `quiesce()` first (`release_guard`).

One source, one build per instruction set (`ISAS`): the machines this project runs on range from
Zen 1 (AVX2 only) to Xeons with AVX-512, and a kernel built for the wider vectors dies with
"Illegal instruction" on the narrower CPU. `selected_isa()` picks the widest set whose flags the
kernel reports in /proc/cpuinfo (flags the OS has not enabled are not listed there);
`SPECPLAY_KERNEL_ISA=avx2` forces a narrower one. The "avx512vnni" build differs from "avx512"
only in the int16-activation formats' dot products (vpdpwssd instead of vpmaddwd + vpaddd: the same
integers). AMX and AVX512-FP16 variants would be further entries of `ISAS`; none is written: AMX's
tile steps cost more than VNNI below about 16 rows on both Xeons it was measured on (sessions 20 and
40, assets/FAST_BACKEND.md), and fp16 arithmetic would round what the formats keep exact.

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
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
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
WIDE_FORMATS = ("float16", "int8", "q4_1")
# Storage formats of one GEMM's weights, as cpu_kernels.c's codes: int8 is Q8_0 rows for int16
# activations (`quantize_q8`); float16 to q8_0 are 16-channel panels for fp32 activations
# (`pack_panels`, and engine.models.q4_1_blocks for GGUF's Q4_1 and Q8_0 blocks); the *_a16 formats
# are those GGUF blocks in panels laid out for integer dot products with int16 activations.
FORMAT_CODES = {"int8": 0, "float16": 1, "bfloat16": 2, "float32": 3, "q4_1": 4, "q8_0": 5, "q4_1_a16": 6,
                "q8_0_a16": 7}
_SOURCE = Path(__file__).with_name("cpu_kernels.c")
_HEADERS = (Path(__file__).with_name("work_pool.h"),)
_COMMON_FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC"]


@dataclass(frozen=True)
class ISA:
    """One build of cpu_kernels.c: the /proc/cpuinfo flags it needs and the compiler flags that
    enable them; `vector_width` (floats) is what the build reports, as a check that it is this one."""

    cpu_flags: frozenset[str]
    compiler_flags: tuple[str, ...]
    vector_width: int


_AVX512 = ISA(frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"}),
              ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
               "-mprefer-vector-width=512"), 16)
ISAS = {  # widest first
    "avx512vnni": ISA(_AVX512.cpu_flags | {"avx512_vnni"}, (*_AVX512.compiler_flags, "-mavx512vnni"), 16),
    "avx512": _AVX512,
    "avx2": ISA(frozenset({"avx2", "fma", "f16c"}), ("-mavx2", "-mfma", "-mf16c"), 8),
}


@cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (only what the OS has enabled)."""
    try:
        line = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return frozenset()
    return frozenset(line.split(":", 1)[1].split())


def runnable_isas() -> list[str]:
    """The builds this CPU can run, widest first."""
    return [name for name, isa in ISAS.items() if isa.cpu_flags <= cpu_flags()]


def selected_isa() -> str | None:
    """The build the kernels run: `SPECPLAY_KERNEL_ISA` if set (and runnable), else the widest runnable."""
    runnable = runnable_isas()
    forced = os.environ.get("SPECPLAY_KERNEL_ISA")
    if forced:
        if forced not in runnable:
            raise RuntimeError(f"SPECPLAY_KERNEL_ISA={forced!r}: this CPU runs {runnable or 'none'} of {list(ISAS)}")
        return forced
    return runnable[0] if runnable else None


def build(isa: str) -> Path:
    """Compile cpu_kernels.c for `isa` into the cache, keyed by the source and flags (a no-op once built)."""
    flags = [*_COMMON_FLAGS, *ISAS[isa].compiler_flags]
    source = _SOURCE.read_bytes() + b"".join(header.read_bytes() for header in _HEADERS)
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    key = hashlib.sha256(source + " ".join(flags).encode()).hexdigest()[:16]
    target = cache_root() / "kernels" / f"cpu_kernels-{isa}-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # atomic: concurrent builders race safely
            out = Path(tmp) / target.name
            subprocess.run([compiler, *flags, str(_SOURCE), "-o", str(out)], check=True, capture_output=True)
            os.replace(out, target)
    return target


class _Linear(ctypes.Structure):
    """Mirror of `Linear` in cpu_kernels.c: one GEMM's weights, scales (int8 only) and format code."""

    _fields_ = [("w", ctypes.c_void_p), ("s", ctypes.c_void_p), ("format", ctypes.c_int64)]


class _DecoderLayout(ctypes.Structure):
    """Mirror of `Decoder` in cpu_kernels.c: per-layer arrays and the model's sizes."""

    _fields_ = [(name, ctypes.POINTER(_Linear)) for name in ("qkv", "o", "gate_up", "down")] + [
                (name, ctypes.POINTER(ctypes.c_void_p)) for name in ("input_norm", "post_norm")] + [
                ("final_norm", ctypes.c_void_p)] + [
                (name, ctypes.c_int64) for name in
                ("layers", "hidden", "mlp", "mlp_padded", "heads", "kv_heads", "head_dim")] + [
                ("eps", ctypes.c_float)]


class _FeatureStepLayout(ctypes.Structure):
    """Mirror of `FeatureStep` in cpu_kernels.c: a feature draft's embedding, fc, head and decoder."""

    _fields_ = [("embed", ctypes.c_void_p), ("fc", _Linear), ("head", _Linear), ("head_ids", ctypes.c_void_p),
                ("decoder", ctypes.POINTER(_DecoderLayout)), ("embed_dim", ctypes.c_int64),
                ("head_rows", ctypes.c_int64)]


class RoundRuleArgs(ctypes.Structure):
    """Mirror of `RoundRule` in cpu_kernels.c: a verify round's rule settings, inputs and outputs
    (`engine.acceptance.NativeRule` fills it)."""

    _fields_ = [("w", ctypes.c_int64), ("temperature", ctypes.c_float), ("top_p", ctypes.c_float),
                ("method", ctypes.c_int64), ("k", ctypes.c_int64), ("d_ids", ctypes.c_void_p),
                ("d_probs", ctypes.c_void_p), ("d_w", ctypes.c_int64), ("tokens", ctypes.c_void_p),
                ("u_accept", ctypes.c_void_p), ("u_sample", ctypes.c_void_p), ("delta", ctypes.c_float),
                ("posterior_threshold", ctypes.c_float), ("posterior_alpha", ctypes.c_float),
                ("t_ids", ctypes.c_void_p), ("t_probs", ctypes.c_void_p), ("result", ctypes.c_void_p)]


@cache
def load(isa: str) -> ctypes.CDLL | None:
    """The kernels built for `isa` (which this CPU must run), or None where they do not build."""
    try:
        lib = ctypes.CDLL(str(build(isa)))
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
    lib.feature_draft_step.restype = i64
    lib.feature_draft_step.argtypes = [ctypes.POINTER(_FeatureStepLayout), ptr, i64, ptr, ptr, ptr, i64, ptr, i64,
                                       ctypes.c_int, ptr, i64, f32, f32, f32, ptr, ptr]
    lib.feature_tree_step.restype = None
    lib.feature_tree_step.argtypes = [ctypes.POINTER(_FeatureStepLayout), ptr, i64, ptr, ptr, ptr, i64, ptr, i64, ptr,
                                      ptr, i64, f32, f32, ptr, ptr, ptr, ptr]
    lib.target_forward.restype = None
    lib.target_forward.argtypes = [ctypes.POINTER(_DecoderLayout), ptr, ctypes.POINTER(_Linear), i64, ptr, i64, ptr,
                                   ptr, i64, ptr, i64, ctypes.c_int, i64, ptr, ptr, ctypes.POINTER(RoundRuleArgs),
                                   ctypes.POINTER(ctypes.c_double)]
    lib.kernel_quiesce.restype, lib.kernel_quiesce.argtypes = None, []
    lib.kernel_steal_grace.restype, lib.kernel_steal_grace.argtypes = i64, [i64]
    lib.kernel_pool_counts.restype, lib.kernel_pool_counts.argtypes = None, [ptr]
    lib.kernel_vector_width.restype, lib.kernel_vector_width.argtypes = ctypes.c_int, []
    if lib.kernel_vector_width() != ISAS[isa].vector_width:
        raise RuntimeError(f"the {isa} build of cpu_kernels.c reports {lib.kernel_vector_width()}-float vectors")
    return lib


@cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("SPECPLAY_NO_NATIVE"):
        return None
    isa = selected_isa()
    return None if isa is None else load(isa)


def quiesce() -> None:
    """Wait until no kernel thread can still be reading a finished forward's inputs (weights, KV
    caches): call it before freeing them. Returns at once when the threads are idle."""
    lib = _library()
    if lib is not None:
        lib.kernel_quiesce()


def release_guard(owner: object) -> None:
    """Make `owner`'s garbage collection call `quiesce` before its attributes (the tensors the
    kernels read) are released: CPython runs weakref callbacks before it clears an object's dict."""
    weakref.finalize(owner, quiesce)


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


_PANEL_DTYPE_FORMATS = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def panel_linear(x: torch.Tensor, panels: torch.Tensor, out_features: int, weight_format: str | None = None
                 ) -> torch.Tensor:
    """float32 x [M, K] @ W^T, W [out_features, K] stored by `pack_panels` (format: the panels' dtype)
    or as GGUF blocks by engine.models.q4_1_blocks (weight_format "q4_1" or "q8_0"; their "_a16"
    layouts take x rounded to int16 per row and group, as `q8_linear`) -> float32 [M, out_features],
    accumulated in float32 on the native kernel (rows independent, as `q8_linear`)."""
    x = pad_to_group(x.float()).contiguous()
    y = torch.empty(x.shape[0], out_features)
    code = FORMAT_CODES[weight_format or _PANEL_DTYPE_FORMATS[panels.dtype]]
    _library().panel_linear(x.data_ptr(), x.shape[0], x.shape[1], panels.data_ptr(), out_features, y.data_ptr(), code)
    return y


def linear_wide(x: torch.Tensor, weight: torch.Tensor, out_features: int,
                scales: torch.Tensor | None = None, weight_format: str | None = None) -> torch.Tensor:
    """The prefill GEMM: `panel_linear` (weight: panels, `weight_format` as there) or `q8_linear`
    (weight and scales: `quantize_q8`) for many rows. fp16, Q4_1 and Q8_0 weights are widened to
    float32 once per panel of 16 channels and a register block of 6 (AVX2) or 12 (AVX-512) rows x 16
    channels runs near the FMA peak; fp32 and bf16 panels stay on `panel_linear`. Panel formats'
    rows equal `panel_linear`'s bit for bit; int8 weights meet float32 activations here, so int8 rows
    differ from `q8_linear`'s (prefills only: `WIDE_MIN_ROWS`)."""
    x = pad_to_group(x.float()).contiguous()
    y = torch.empty(x.shape[0], out_features)
    code = 0 if scales is not None else FORMAT_CODES[weight_format or _PANEL_DTYPE_FORMATS[weight.dtype]]
    _library().linear_wide(x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(),
                           None if scales is None else scales.data_ptr(), code, out_features, y.data_ptr())
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


def _linear(lin) -> _Linear:
    """A GEMM's native descriptor: its weight (and scales) pointers and storage format."""
    return _Linear(lin.weight.data_ptr(), None if lin.scales is None else lin.scales.data_ptr(),
                   FORMAT_CODES[lin.format])


class NativeDecoder:
    """A whole Llama decoder stack as one native call (`decoder_forward` in cpu_kernels.c), each GEMM
    in its own storage format (`FORMAT_CODES`).

    Between the ops of a decode step there is then no Python, no ctypes call and no OpenMP
    wake-up: on the default target that was ~4 of ~17 ms per int8 token. The weights stay owned
    by the caller's tensors (referenced here so they outlive the pointers).
    """

    GEMMS = ("qkv", "o", "gate_up", "down")
    MAX_LAYERS = 100  # a forward's phases (8 or 9 a layer, and a few more) fit work_pool.h's POOL_PHASES

    def __init__(self, layers: Sequence[dict], final_norm: torch.Tensor, *, mlp: int, heads: int, kv_heads: int,
                 head_dim: int, eps: float) -> None:
        """layers: per layer, the GEMMs qkv, o, gate_up, down as objects with `weight` (int8 [N, K'] or
        panels, K' padded to GROUP), `scales` (int8; else None) and `format` (a key of FORMAT_CODES),
        and the norm weights input_norm, post_norm."""
        hidden = final_norm.shape[0]
        if hidden % GROUP or heads * head_dim % GROUP:
            raise ValueError(f"the native decoder needs hidden size and heads x head_dim divisible by {GROUP}")
        if len(layers) > self.MAX_LAYERS:
            raise ValueError(f"the native decoder runs at most {self.MAX_LAYERS} layers, got {len(layers)}")
        self._keep = [layers, final_norm]
        release_guard(self)
        arrays = {}
        for name in self.GEMMS:
            arrays[name] = (_Linear * len(layers))(*[_linear(layer[name]) for layer in layers])
        for name in ("input_norm", "post_norm"):
            arrays[name] = (ctypes.c_void_p * len(layers))(*[layer[name].data_ptr() for layer in layers])
        self._keep.append(arrays)
        self.layout = _DecoderLayout(**arrays, final_norm=final_norm.data_ptr(), layers=len(layers), hidden=hidden,
                                     mlp=mlp, mlp_padded=mlp + -mlp % GROUP, heads=heads, kv_heads=kv_heads,
                                     head_dim=head_dim, eps=eps)

    def __call__(self, x: torch.Tensor, rope: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot: int,
                 mask: torch.Tensor | None, wide: bool = False) -> torch.Tensor:
        """x [n, hidden] at cache slots [slot, slot+n) -> final-norm
        hidden states [n, hidden]; caches [layers, kv_heads, cap, head_dim]; rope and mask as `attention`;
        wide: a prefill whose GEMMs may use `linear_wide`."""
        x = x.contiguous()
        out = torch.empty_like(x)
        rope, mask = rope.contiguous(), None if mask is None else mask.contiguous()  # kept alive across the call
        _library().decoder_forward(ctypes.byref(self.layout), x.data_ptr(), x.shape[0], k_cache.data_ptr(),
                                   v_cache.data_ptr(), k_cache.shape[2], rope.data_ptr(), slot,
                                   None if mask is None else mask.data_ptr(), int(wide), out.data_ptr())
        return out


class _PerThread(threading.local):
    """The buffers a native step reuses from call to call, one set per calling thread: two threads'
    forwards through one step (the weights, and so the step, are shared) must not write each
    other's tokens or logits."""

    def __init__(self) -> None:
        self.tokens = (ctypes.c_int64 * 64)()
        self.scratch: dict[tuple[str, int], tuple[torch.Tensor, int]] = {}  # (what, rows) -> (buffer, address)

    def tokens_for(self, tokens: Sequence[int]) -> ctypes.Array:
        """`tokens` in this thread's token buffer (grown as needed)."""
        if len(tokens) > len(self.tokens):
            self.tokens = (ctypes.c_int64 * (2 * len(tokens)))()
        self.tokens[:len(tokens)] = tokens
        return self.tokens


class TargetStep:
    """A target forward as one native call (`target_forward` in cpu_kernels.c): the embedding rows,
    the decoder stack and the head on the last rows, bit for bit what `FastLlamaCausalLM._forward`
    computes one call at a time. The weights stay owned by the caller's tensors (referenced here)."""

    def __init__(self, embed: torch.Tensor, head, decoder: NativeDecoder) -> None:
        """embed float32 [vocab, H]; head [rows, H] as `NativeDecoder`'s GEMMs (`weight`, `scales`, `format`)."""
        embed = embed.detach().float().contiguous()
        self._keep = [embed, head, decoder]
        release_guard(self)
        self.hidden, self.vocab, self.head_rows = decoder.layout.hidden, embed.shape[0], head.out_features
        self._embed, self._head, self._decoder = embed.data_ptr(), _linear(head), ctypes.pointer(decoder.layout)
        self._lib = _library()  # looked up once: `_library` reads the environment
        self._mine = _PerThread()

    def __call__(self, tokens: Sequence[int], cache: tuple[int, int, int, int, int, bool], last_n: int,
                 rule: tuple | None = None, hidden_at: int | None = None, logits_at: int | None = None
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Feed `tokens` at `cache` (`FastLlamaCausalLM.native_slots`): (hidden [n, H], logits [last_n, rows]).
        `rule`: (pointer to `RoundRuleArgs`, pointer to a double for its seconds) to run on the logits
        in the same call (`engine.acceptance.NativeRule.pointers`; rows must be the vocabulary). The
        logits are then the rule's input only: they are written to a buffer the next such call reuses
        (a decode round allocates no 200 KB of logits). `hidden_at`: the address of n float32 rows
        to write the hidden states to (`causal_lm.FeatureRows`, or a `scratch` buffer where nobody
        reads them); hidden is then None. `logits_at`: likewise for the last_n rows of logits
        (without a rule); logits is then None."""
        n = len(tokens)
        if min(tokens) < 0 or max(tokens) >= self.vocab:
            raise IndexError(f"token ids must be in [0, {self.vocab}), got {list(tokens)}")
        ids = self._mine.tokens_for(tokens)
        hidden = None
        if hidden_at is None:
            hidden = torch.empty(n, self.hidden)
            hidden_at = hidden.data_ptr()
        if logits_at is not None:
            logits, at = None, logits_at
        elif rule is None:
            logits = torch.empty(last_n, self.head_rows)
            at = logits.data_ptr()
        else:
            logits, at = self.scratch("logits", last_n)
        self._lib.target_forward(self._decoder, self._embed, ctypes.byref(self._head), self.head_rows, ids, n,
                                  *cache, last_n, hidden_at, at, *(rule or (None, None)))
        return hidden, logits

    def scratch(self, what: str, rows: int) -> tuple[torch.Tensor, int]:
        """A buffer of `rows` rows of "logits" or "hidden" that every call asking for the same is
        handed again, and its address: for outputs no caller keeps past the next call."""
        scratch = self._mine.scratch
        buffer = scratch.get((what, rows))
        if buffer is None:
            tensor = torch.empty(rows, self.head_rows if what == "logits" else self.hidden)
            buffer = scratch[what, rows] = tensor, tensor.data_ptr()
        return buffer


class FeatureStep:
    """A feature draft's step as one native call (`feature_draft_step` in cpu_kernels.c): the
    entries' inputs fc([embed(t_j); f_{j-1}]), the draft's decoder stack, the head on the last
    output and the draw from it, bit for bit what the same GEMMs and `engine.sampling.sample_sparse`
    give one call at a time. The weights stay owned by the caller's tensors (referenced here)."""

    def __init__(self, embed: torch.Tensor, fc, head, head_ids: torch.Tensor | None, decoder: NativeDecoder) -> None:
        """embed float32 [vocab, E]; fc [H, E + H] and head [rows, H] as `NativeDecoder`'s GEMMs (`weight`,
        `scales`, `format`); head_ids: the head rows' token ids (None: the rows are the vocabulary)."""
        embed = embed.detach().float().contiguous()
        head_ids = None if head_ids is None else head_ids.to(torch.int64).contiguous()
        self._keep = [embed, fc, head, head_ids, decoder]
        release_guard(self)
        self.hidden = decoder.layout.hidden
        self.layout = _FeatureStepLayout(
            embed.data_ptr(), _linear(fc), _linear(head),
            None if head_ids is None else head_ids.data_ptr(), ctypes.pointer(decoder.layout), embed.shape[1],
            head.out_features)
        self._lib = _library()  # looked up once: `_library` reads the environment
        self._mine = _PerThread()  # the fed tokens, reused: a step feeds one token, a resync a few

    def __call__(self, tokens: Sequence[int], features: int, cache: tuple[int, int, int, int, int, bool], out: int,
                 width: int, temperature: float, top_p: float, uniform: float, ids: int, probs: int) -> int:
        """Feed `tokens` with input features [n, H] (contiguous float32, at address `features`) at `cache` =
        (k cache, v cache, capacity, rope rows, first slot, wide) as pointers and sizes
        (`FastLlamaCausalLM.native_slots`), writing their f̂ [n, H] at address `out`, then draw one token
        from the top-`width` support at `temperature`, `top_p` with `uniform`, writing its support's ids
        (int64) and probs (float32) [width] at the addresses `ids` and `probs` (a `SupportRows` row):
        the token."""
        n = len(tokens)
        return self._lib.feature_draft_step(ctypes.byref(self.layout), self._mine.tokens_for(tokens), n, features, *cache, out,
                                            width, temperature, top_p, uniform, ids, probs)

    def tree(self, tokens: torch.Tensor, features: torch.Tensor, cache: tuple[int, int, int], rope: torch.Tensor,
             slot: int, mask: torch.Tensor, width: int, temperature: float, top_p: float, uniforms: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One tree depth (`feature_tree_step`): branch tokens [n] with input features [n, H] at cache slots
        [slot, slot + n) of `cache` = (k cache, v cache, capacity) as pointers and size, with rope rows
        [n, ...] and the additive mask [n, slot + n] (contiguous float32), one draw per branch with
        uniforms [n]: (tokens [n], ids [n, width], probs [n, width], f̂ [n, H])."""
        n = len(tokens)
        tokens = tokens.to(torch.int64).contiguous()
        uniforms = uniforms.float().contiguous()
        out, drawn = torch.empty(n, self.hidden), torch.empty(n, dtype=torch.long)
        ids, probs = torch.empty(n, width, dtype=torch.long), torch.empty(n, width)
        self._lib.feature_tree_step(
            ctypes.byref(self.layout), tokens.data_ptr(), n, features.data_ptr(), *cache, rope.data_ptr(), slot,
            mask.data_ptr(), out.data_ptr(), width, temperature, top_p, uniforms.data_ptr(), drawn.data_ptr(),
            ids.data_ptr(), probs.data_ptr())
        return drawn, ids, probs, out


# ---- sampling kernels ----
# Bindings for the per-round sampling and acceptance kernels at the end of cpu_kernels.c; the
# wrappers with the torch references beside them are engine.sampling and engine.acceptance.


@cache
def sampling_library() -> ctypes.CDLL | None:
    """The kernel library with the sampling kernels' signatures set, or None without the kernels."""
    lib = _library()
    if lib is None:
        return None
    ptr, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.sample_support.restype, lib.sample_support.argtypes = None, [ptr, i64, i64, i64, f32, f32, ptr, ptr]
    lib.draw_support.restype, lib.draw_support.argtypes = i64, [ptr, ptr, i64, f32]
    lib.verify_logits.restype = None
    lib.verify_logits.argtypes = [ptr, i64, ctypes.POINTER(RoundRuleArgs)]
    lib.sample_draw.restype, lib.sample_draw.argtypes = i64, [ptr, i64, i64, f32, f32, ptr, f32, ptr, ptr]
    f64 = ctypes.c_double
    lib.position_divergences.restype = None
    lib.position_divergences.argtypes = [i64, ptr, ptr, i64, ptr, ptr, i64, i64, f64, f64, f64, ptr]
    return lib

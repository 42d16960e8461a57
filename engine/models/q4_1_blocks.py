"""GGUF's Q4_1 and Q8_0 blocks found from float weights, in the panel layout of cpu_kernels.c.

The embedded target's float32 weights are its GGUF's blocks dequantised (`gguf_weights`), so every
tensor has blocks that reproduce it bit for bit: Q4_1 for the linears (32 weights, an fp16 scale d
and minimum m, w = d * q + m with q in 0..15), Q8_0 for the tied embedding (fp16 d, w = d * q with q
in -127..127). `exact_blocks` finds them the way ggml's quantisers do (the minimum and range of each
group of 32, or its largest magnitude), checks the round trip, and keeps a tensor that no blocks
reproduce in float32 panels. So the `q4_1` weight format computes the float32 reference's products
for any model, at 0.625 (Q4_1) or 1.06 (Q8_0) bytes a weight instead of 4, and for the embedded
target the blocks are the GGUF's own (a test compares them byte for byte).

Recovering the blocks from the floats, rather than reading the GGUF, needs no link from a loaded
model back to its file, and works the same for the q/k rows fast_llama permutes and scales by
1/sqrt(head_dim) (a power of two: d and m scale exactly).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.models.cpu_kernels import GROUP, PANEL, pack_panels, pad_to_group


def quantize_q4_1(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float [N, K] (K % GROUP == 0) -> (d, m fp16 [N, K/GROUP], q uint8 [N, K]): per group m = min,
    d = (max - min) / 15 (as ggml's quantize_row_q4_1), q = round((w - m) / d) in 0..15."""
    groups = weight.float().view(weight.shape[0], -1, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    m, d = low.half(), ((high - low) / 15).half()
    scale = d.float()[..., None]
    q = torch.where(scale > 0, (groups - m.float()[..., None]) / scale.clamp_min(1e-30), 0.0)
    return d, m, q.round().clamp(0, 15).to(torch.uint8).view(weight.shape)


def dequantize_q4_1(d: torch.Tensor, m: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The float32 weights, as gguf's dequantiser computes them: (d * q) + m (d * q is exact)."""
    groups = q.view(q.shape[0], -1, GROUP).float()
    return (d.float()[..., None] * groups + m.float()[..., None]).view(q.shape)


def quantize_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (d fp16 [N, K/GROUP], q int8 [N, K]): d = max|w| / 127 per group, as ggml's Q8_0."""
    groups = weight.float().view(weight.shape[0], -1, GROUP)
    d = (groups.abs().amax(-1) / 127).half()
    scale = d.float()[..., None]
    q = torch.where(scale > 0, groups / scale.clamp_min(1e-30), 0.0)
    return d, q.round().clamp(-127, 127).to(torch.int8).view(weight.shape)


def dequantize_q8_0(d: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return (d.float()[..., None] * q.view(q.shape[0], -1, GROUP).float()).view(q.shape)


def _panel_scales(s: torch.Tensor) -> torch.Tensor:
    """fp16 [N, G] -> bytes [N / PANEL, G, 2 * PANEL]: each panel's 16 channel values per block."""
    return s.view(-1, PANEL, s.shape[1]).transpose(1, 2).contiguous().view(torch.uint8)


def pack_q4_1(d: torch.Tensor, m: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_1 blocks (N % PANEL == 0) -> uint8 [N / PANEL, K / GROUP, 320]: per panel and block d[16],
    m[16], then 16 pairs of k as 16 bytes (channel c's byte: k = 2p low nibble, 2p + 1 high)."""
    n, k = q.shape
    pairs = q.view(n // PANEL, PANEL, k // GROUP, GROUP // 2, 2)
    nibbles = (pairs[..., 0] | (pairs[..., 1] << 4)).permute(0, 2, 3, 1)  # [panel, block, pair, channel]
    return torch.cat([_panel_scales(d), _panel_scales(m), nibbles.reshape(n // PANEL, k // GROUP, -1)], -1).contiguous()


def pack_q8_0(d: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q8_0 blocks (N % PANEL == 0) -> uint8 [N / PANEL, K / GROUP, 544]: d[16], then 32 k x 16 channels."""
    n, k = q.shape
    values = q.view(n // PANEL, PANEL, k // GROUP, GROUP).permute(0, 2, 3, 1).contiguous().view(torch.uint8)
    return torch.cat([_panel_scales(d), values.reshape(n // PANEL, k // GROUP, -1)], -1).contiguous()


# Where channel c's q(k = 8 g + j) sits in its dword of line g, for the int16-activation layout:
# the two k of a pair (j = 2 s, 2 s + 1) in the two 16-bit halves, so one shift and one mask give the
# int16 pairs vpdpwssd multiplies with the activations' (x[k], x[k + 1]).
_A16_SHIFTS = torch.tensor([16 * (j % 2) + 4 * (j // 2) for j in range(8)], dtype=torch.int64)


def pack_q4_1_a16(d: torch.Tensor, m: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_1 blocks (N % PANEL == 0) -> uint8 [N / PANEL, K / GROUP, 320] for int16 activations: per panel
    and block d[16], m[16], then 4 lines of 16 little-endian dwords (dword c of line g: channel c's
    q(k = 8 g + j) at bit `_A16_SHIFTS[j]`)."""
    n, k = q.shape
    eights = q.view(n // PANEL, PANEL, k // GROUP, 4, 8).to(torch.int64)  # [panel, channel, block, line, j]
    dwords = (eights << _A16_SHIFTS).sum(-1).permute(0, 2, 3, 1)  # [panel, block, line, channel] < 2^32
    lines = (dwords - (dwords >> 31 << 32)).to(torch.int32).contiguous().view(torch.uint8)  # the same bits
    return torch.cat([_panel_scales(d), _panel_scales(m), lines.reshape(n // PANEL, k // GROUP, -1)], -1).contiguous()


def pack_q8_0_a16(d: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q8_0 blocks (N % PANEL == 0) -> uint8 [N / PANEL, K / GROUP, 544] for int16 activations: d[16],
    then 16 pairs of k as 32 bytes (byte 2 c + r: q(k = 2 p + r) of channel c)."""
    n, k = q.shape
    pairs = q.view(n // PANEL, PANEL, k // GROUP, GROUP // 2, 2).permute(0, 2, 3, 1, 4)  # [panel, block, p, c, r]
    values = pairs.contiguous().view(torch.uint8).reshape(n // PANEL, k // GROUP, -1)
    return torch.cat([_panel_scales(d), values], -1).contiguous()


def exact_blocks(weight: torch.Tensor, int16_activations: bool = False) -> tuple[str, torch.Tensor]:
    """float weight [N, K] -> (format, panels) for `cpu_kernels.panel_linear`: "q4_1" or "q8_0" blocks
    where they reproduce every weight bit for bit (K and N zero-padded as `pack_panels`), else
    "float32" panels. `int16_activations`: the same blocks laid out for int16 activations
    ("q4_1_a16", "q8_0_a16"; products exact in integers, the activations' rounding the only change)."""
    w = pad_to_group(weight.detach().float())
    w = F.pad(w, (0, 0, 0, -w.shape[0] % PANEL))
    suffix = "_a16" if int16_activations else ""
    d, m, q = quantize_q4_1(w)
    if torch.equal(dequantize_q4_1(d, m, q), w):
        return "q4_1" + suffix, (pack_q4_1_a16 if int16_activations else pack_q4_1)(d, m, q)
    d, q = quantize_q8_0(w)
    if torch.equal(dequantize_q8_0(d, q), w):
        return "q8_0" + suffix, (pack_q8_0_a16 if int16_activations else pack_q8_0)(d, q)
    return "float32", pack_panels(weight, torch.float32)


def round_to_q4_1(weight: torch.Tensor) -> torch.Tensor:
    """The nearest weights Q4_1 blocks hold exactly (a lossy quantisation, for models without a GGUF)."""
    w = pad_to_group(weight.detach().float())
    return dequantize_q4_1(*quantize_q4_1(w))[:, : weight.shape[1]]

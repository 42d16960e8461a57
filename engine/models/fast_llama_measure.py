"""Measure the fast Llama backend against the transformers backend on the default target.

    PYTHONPATH=. python -m engine.models.fast_llama_measure [--reps 15] [--threads 2] [--llama-cpp] [--small-pages]

Speed: after a chat prompt is prefilled, each round times one 1-token forward (AR decode) and
one 5-token forward (verifying 4 drafts + bonus), rolling back after each; backends are
interleaved round by round so background load hits them alike; medians are reported.
`--llama-cpp` adds llama.cpp (llama-cpp-python, `deploy/install_llama_cpp.sh`) on the GGUF the
default target comes from, timed the same way at the same context: `eval` of 1 and of 5 tokens
(on a CPU with AMX five one-token steps: `engine.peers.llama_cpp`).
`--small-pages` adds each format with its weights on 4 KB pages, outside the huge-page arenas.
Prefill: a prompt of 30 / 60 / 120 tokens into an empty cache, with the prefill GEMM
(`cpu_kernels.linear_wide`, the default from `WIDE_MIN_ROWS` rows) and with the batch-invariant
decode kernels, interleaved; for the formats it serves (`cpu_kernels.WIDE_FORMATS`).
Quality: each weight format is teacher-forced along fast-float32's greedy continuation of a few
prompts; we report top-1 agreement with float32 and the mean KL(float32 || format) per position.
`--bandwidth`: this machine's memory read bandwidth (a GEMV over 1 GB, the threads given),
and for each format the bytes a decode step streams (every GEMM's packed weights and the head)
divided by it: the time a decode would take if it did nothing but read its weights.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from engine.models import HFCausalLM, cpu_kernels, load_pair
from engine.models.fast_llama import WEIGHT_DTYPES, FastLlamaCausalLM, FastLlamaWeights, fast_weights
from engine.models.huge_pages import huge_page_bytes
from engine.peers.llama_cpp import load_llama, one_token_batches

PROMPTS = (
    "Write a short story about a robot who learns to paint, in three paragraphs.",
    "What is the capital of France? Answer in one sentence.",
    "Explain how a hash map works to a beginner programmer.",
    "List five fruits and one fact about each.",
)


class _LlamaCpp:
    """llama.cpp behind the two calls measure_speed makes: a forward of n tokens, and a rollback
    (llama-cpp-python's `eval` drops the KV cache past `n_tokens` before it decodes)."""

    def __init__(self, threads: int) -> None:
        self.llm = load_llama(threads)

    def forward(self, tokens, last_n: int = 1) -> None:
        self.llm.eval(list(tokens))

    def rollback(self, length: int) -> None:
        self.llm.n_tokens = length


SMALL_PAGES = " on 4 KB pages"


def read_bandwidth(reps: int = 7) -> float:
    """Bytes a second a one-row GEMV reads from 1 GB of float32 weights (far beyond any L3), median:
    our own kernel (`panel_linear`, one FMA per 64 bytes) where it built, which reads faster than
    torch's sum (27 against 21 GB/s on the Xeon of session 19), else torch's sum."""
    k = n = 2**14
    panels = torch.ones(n // cpu_kernels.PANEL, k, cpu_kernels.PANEL)
    x = torch.ones(1, k)
    read = (lambda: cpu_kernels.panel_linear(x, panels, n, "float32")) if cpu_kernels.available() else panels.sum
    read()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        read()
        times.append(time.perf_counter() - start)
    return panels.numel() * panels.element_size() / statistics.median(times)


def decode_bytes(pair, weight_dtype: str) -> int:
    """The packed weight bytes one decode step reads: every layer's GEMMs (weights and scales) and the head."""
    weights = fast_weights(pair.target_model, weight_dtype)
    linears = [getattr(layer, name) for layer in weights.layers for name in cpu_kernels.NativeDecoder.GEMMS]
    return sum(t.numel() * t.element_size() for lin in [*linears, weights.lm_head]
               for t in (lin.weight, lin.scales) if isinstance(t, torch.Tensor))


def _make(pair, backend: str):
    if backend == "transformers":
        return HFCausalLM(pair.target_model, "hf", pair.vocab_size)
    if backend == "llama.cpp":
        return _LlamaCpp(torch.get_num_threads())
    if backend.endswith(SMALL_PAGES):
        return _on_small_pages(pair, backend.removesuffix(SMALL_PAGES))
    return FastLlamaCausalLM(pair.target_model, backend, pair.vocab_size, weight_dtype=backend)


def _on_small_pages(pair, weight_dtype: str) -> FastLlamaCausalLM:
    """The fast backend with its GEMM weights cloned out of the huge-page arenas (engine.models.huge_pages)
    into torch's own allocations: the same bytes on 4 KB pages, to measure what the arenas are worth."""
    lm = FastLlamaCausalLM(pair.target_model, weight_dtype + SMALL_PAGES, pair.vocab_size, weight_dtype=weight_dtype)
    weights = FastLlamaWeights(pair.target_model, weight_dtype)
    for gemm in [getattr(layer, name) for layer in weights.layers for name in cpu_kernels.NativeDecoder.GEMMS] + [
            weights.lm_head]:
        gemm.weight = gemm.weight.clone()
        gemm.scales = None if gemm.scales is None else gemm.scales.clone()
    lm.w = weights
    return lm


def measure_speed(pair, backends, reps: int) -> dict[str, tuple[float, float]]:
    prompt = pair.encode_prompt(PROMPTS[0])
    lms = {b: _make(pair, b) for b in backends}
    for lm in lms.values():
        lm.forward(prompt)
        for n in (1, 5, 1, 5):  # warm-up
            lm.forward(list(range(100, 100 + n)), n)
            lm.rollback(len(prompt))
    times = {b: {1: [], 5: []} for b in backends}
    for _ in range(reps):
        for b, lm in lms.items():
            for n in (1, 5):
                start = time.perf_counter()
                lm.forward(list(range(100, 100 + n)), n)
                times[b][n].append(time.perf_counter() - start)
                lm.rollback(len(prompt))
    return {b: (statistics.median(t[1]) * 1e3, statistics.median(t[5]) * 1e3) for b, t in times.items()}


def measure_prefill(pair, formats, reps: int, lengths=(30, 60, 120)) -> dict[tuple[str, int], tuple[float, float]]:
    """(format, prompt length) -> median ms of (prefill GEMM, decode kernels) for one prefill."""
    out = {}
    default = cpu_kernels.WIDE_MIN_ROWS
    try:
        for f in formats:
            lm = _make(pair, f)
            for n in lengths:
                prompt, times = list(range(1000, 1000 + n)), {default: [], n + 1: []}
                for _ in range(reps):
                    for threshold, ts in times.items():  # n + 1: this prompt is too short for the wide GEMM
                        cpu_kernels.WIDE_MIN_ROWS = threshold
                        lm.reset()
                        start = time.perf_counter()
                        lm.forward(prompt)
                        ts.append(time.perf_counter() - start)
                out[f, n] = tuple(statistics.median(times[t]) * 1e3 for t in (default, n + 1))
    finally:
        cpu_kernels.WIDE_MIN_ROWS = default
    return out


def _greedy(lm, prompt, steps):
    out, logits = [], lm.forward(prompt)
    for _ in range(steps):
        out.append(int(logits[-1].argmax()))
        logits = lm.forward([out[-1]])
    return out


def _decode_path_logits(lm, seq, last_n):
    """Log-probs of the last `last_n - 1` positions as decoding computes them: the first token goes
    in alone, so the rest never takes the prefill-only GEMM (`cpu_kernels.linear_wide`)."""
    lm.forward(seq[:1])
    return lm.forward(seq[1:], last_n=last_n)[:-1].log_softmax(-1)


def measure_quality(pair, formats, steps: int = 32) -> dict[str, tuple[float, float]]:
    """Teacher-forced along fp32's greedy path: (top-1 agreement, mean KL) per format."""
    agree, kls = {f: [] for f in formats}, {f: [] for f in formats}
    for text in PROMPTS:
        prompt = pair.encode_prompt(text)
        gen = _greedy(_make(pair, "float32"), prompt, steps)
        seq = prompt + gen
        ref = _decode_path_logits(_make(pair, "float32"), seq, steps + 1)
        for f in formats:
            got = _decode_path_logits(_make(pair, f), seq, steps + 1)
            agree[f].append((got.argmax(-1) == ref.argmax(-1)).float().mean().item())
            kls[f].append(F.kl_div(got, ref, log_target=True, reduction="batchmean").item())
    return {f: (statistics.mean(agree[f]), statistics.mean(kls[f])) for f in formats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--formats", default=",".join(WEIGHT_DTYPES))
    parser.add_argument("--no-quality", action="store_true")
    parser.add_argument("--llama-cpp", action="store_true", help="add llama.cpp's row (needs llama-cpp-python)")
    parser.add_argument("--small-pages", action="store_true",
                        help="add a row per format with the weights on 4 KB pages instead of the 2 MB arenas")
    parser.add_argument("--bandwidth", action="store_true",
                        help="measure the memory read bandwidth and each format's decode time at that bound")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    formats = args.formats.split(",")
    pair = load_pair("default")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, native kernels: "
          f"{cpu_kernels.selected_isa() if cpu_kernels.available() else 'none'}, median of {args.reps} rounds")
    arena = fast_weights(pair.target_model, formats[0]).layers[0].qkv.weight
    print(f"the target's {formats[0]} layer weights: {huge_page_bytes(arena) / 2**20:.0f} MB of their arena on 2 MB pages")

    prompt = pair.encode_prompt(PROMPTS[1])
    diff = (HFCausalLM(pair.target_model, "hf", pair.vocab_size).forward(prompt, last_n=len(prompt))
            - _make(pair, "float32").forward(prompt, last_n=len(prompt))).abs().max().item()
    print(f"max |logit diff| transformers vs fast float32 over a {len(prompt)}-token prompt: {diff:.2e}")

    small = [f + SMALL_PAGES for f in formats] if args.small_pages and cpu_kernels.available() else []
    speed = measure_speed(pair, ["transformers", *formats, *small] + ["llama.cpp"] * args.llama_cpp, args.reps)
    base = speed["transformers"][0]
    print("| backend | 1-token decode (ms) | 5-token verify (ms) | verify / decode | decode speed-up |")
    print("|---|---|---|---|---|")
    for b, (one, five) in speed.items():
        print(f"| {b} | {one:.1f} | {five:.1f} | {five / one:.2f} | {base / one:.2f}x |")
    if args.llama_cpp and one_token_batches():
        print("llama.cpp runs one token per micro-batch on this CPU (AMX: engine.peers.llama_cpp), so its "
              "5-token column is five one-token steps")

    if args.bandwidth:
        bandwidth = read_bandwidth()
        print(f"\nmemory read bandwidth: {bandwidth / 1e9:.1f} GB/s (a one-row GEMV over 1 GB, {args.threads} threads)")
        print("| format | bytes a decode step reads (MB) | at that bandwidth (ms) | measured decode / bound |")
        print("|---|---|---|---|")
        for f in formats:
            read = decode_bytes(pair, f)
            bound = read / bandwidth * 1e3
            print(f"| {f} | {read / 1e6:.1f} | {bound:.2f} | {speed[f][0] / bound:.2f} |")

    native = [f for f in formats if f in cpu_kernels.WIDE_FORMATS]
    if native and cpu_kernels.available():
        print("\n| format | prompt tokens | prefill, wide GEMM (ms) | prefill, decode kernels (ms) | speed-up |")
        print("|---|---|---|---|---|")
        for (f, n), (wide, exact) in measure_prefill(pair, native, max(3, args.reps // 3)).items():
            print(f"| {f} | {n} | {wide:.1f} ({wide / n:.2f}/token) | {exact:.1f} ({exact / n:.2f}/token) | "
                  f"{exact / wide:.2f}x |")

    if not args.no_quality:
        lower = [f for f in formats if f != "float32"]
        print("\n| format | greedy top-1 agreement with fast float32 | mean KL(fp32 || format) |")
        print("|---|---|---|")
        for f, (agreement, kl) in measure_quality(pair, lower).items():
            print(f"| {f} | {agreement:.1%} | {kl:.2e} |")


if __name__ == "__main__":
    main()

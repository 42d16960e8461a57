"""`python -m engine.bench`: every number the project reports comes from here.

All rows (method × K × weight format, the peers, SSD) run in one process on the same prompts with
the same seeds (prompt i at seed + 1000·r + i in repeat r), interleaved prompt by prompt: within each
repeat every row decodes prompt i (with SSD rows: the --batch-size batch starting at i) before any
row moves on, and the row that goes first rotates from one prompt to the next, across repeats too
(acceptance columns are means over the repeats' seeds, see SEED_STRIDE). A 2-core VM's speed
drifts by 20-40% over tens of seconds; whole rows one after another each landed in their own speed
window, while prompt by prompt drift hits every row alike. Each row is built once (target, drafter,
SSD worker, llama.cpp model) and, SSD aside (its caches learn online), decodes the first prompt once
untimed, so that no row pays the first forward's one-off setup. A row's raw counters are summed over
a repeat's prompts and its per-repeat row is derived from those sums; timing columns are medians
over repeats. `speedup_vs_ar_runs` is each repeat's tok/s over AR's in the same repeat and weight
format (peers: the first format's AR), and `speedup_vs_ar` is the median of those per-repeat
ratios, which cancels the drift between repeats that a ratio of medians keeps. The vLLM rows
(engine.peers.vllm_peer.bench_rows) run whole, in their own venv, after ours: their
`speedup_vs_ar` is their median over AR's median, with no per-repeat ratios.

Peer rows run Hugging Face `generate()` on the same weights and threads: `hf-ar` (plain decoding)
and `hf-assisted` (`assistant_model=` with the same draft and K, or `prompt_lookup_num_tokens=K`
for the n-gram drafter), so we know where we stand against what users already have; `llama.cpp`
(optional, needs llama-cpp-python) runs the default target's own GGUF. `ssd` runs Saguaro SSD
(engine.ssd) with the draft in a worker pinned to its own device (`--devices`) and the acceptance
rule `--ssd-rule`; its rows add the cache hit rate and the Theorem-7 speedups. `--k` and
`--weight-dtype` take comma lists: every engine row then runs at each K / weight format, side by
side in the same repeats, and each row's `speedup_vs_ar` is against AR in its own format.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from functools import lru_cache

import numpy as np
import pandas as pd
import torch
from transformers import GenerationConfig

from engine.busy_core import competitor
from engine.cli import add_spec_arguments, spec_config_from_args
from engine.config import DECODE_METHODS, SSD_BACKUPS, SSD_FANOUT_MODES, SpecConfig
from engine.decoding import describe_device, generate
from engine.events import FinishEvent, TokenEvent
from engine.metrics import ROUND_PHASES, DivergenceTally
from engine.models.causal_lm import CausalLM
from engine.models.fast_llama import WEIGHT_DTYPES
from engine.models.registry import BACKENDS, DEFAULT_FAST_WEIGHTS, DRAFTER_KINDS, GENERIC_K, PAIRS, ModelPair, load_pair
from engine.peers.llama_cpp import load_llama, one_token_batches
from engine.prompts import held_out_prompts
from engine.ssd.devices import parse_device, parse_devices, pinned
from engine.ssd.projection import PHASES as SSD_PHASES
from engine.sampling import REPORTED_SAMPLING

PEER_METHODS = ("hf-ar", "hf-assisted", "llama.cpp")
UNDRAFTED = ("ar", "hf-ar", "llama.cpp")  # rows that do not depend on K
SSD_METHOD = "ssd"
SUM_KEYS = ("new_tokens", "num_rounds", "target_forwards", "num_drafts", "num_draft_tokens", "num_accepted_tokens",
            "elapsed_seconds", "prefill_seconds", "draft_seconds", "verify_seconds", "overhead_seconds")
# --profile: ms per round of each round phase (engine.metrics.ROUND_PHASES), then the decoding
# time outside every round (the consumer between rounds, the final text decode).
PROFILE_COLUMNS = ROUND_PHASES + ("between_rounds",)
# Repeat r decodes prompt i at seed + SEED_STRIDE·r + i, every row of the repeat alike. One seed's text is
# one draw of a method's acceptance: SpS's tokens a round at K = 3 on the default pair's 4 prompts ranged
# 1.49-1.74 over eight seeds (mean 1.63), and the first seed gave 1.74. With one seed for every repeat,
# a row whose text varies from run to run (SSD: its fills depend on timing) was compared with that one
# lucky draw. So the statistics below are means over the repeats' texts.
SEED_STRIDE = 1000
STATISTIC_KEYS = ("mean_acceptance_length", "draft_acceptance_rate", "target_forwards_per_token", "mean_induced_kl")
TIMED_KEYS = ("tokens_per_s", "decode_tokens_per_s", "overhead_fraction", "draft_ms_per_token",
              "verify_ms_per_round")
SSD_PHASE_KEYS = tuple(f"round_{name}_ms" for name in SSD_PHASES)  # where an SSD round goes (ms a round)
SSD_KEYS = ("cache_hit_rate", "theoretical_speedup", "measured_speedup", "projected_tokens_per_s", "model_tokens_per_s",
            "mean_budget_used", "mean_budget_requested", "mean_cache_depth") + SSD_PHASE_KEYS


class BenchRow:
    """One row, built once (models, worker), then fed prompts a few at a time so that main() can
    interleave rows prompt by prompt: `begin` zeroes a repeat's counters, `add` decodes prompts
    (prompt i at seed + i) and sums their raw counters, `result` derives the repeat's row from the sums."""

    step = 1  # prompts per `add` call when run alone (SSD: its batch size)

    def begin(self) -> None:
        raise NotImplementedError

    def add(self, prompts: Sequence[list[int]], start: int) -> None:
        raise NotImplementedError

    def result(self) -> dict:
        raise NotImplementedError

    def run(self, prompts: Sequence[list[int]]) -> dict:
        """This row alone over all prompts: one repeat."""
        self.begin()
        for start in range(0, len(prompts), self.step):
            self.add(prompts[start:start + self.step], start)
        return self.result()


class EngineRow(BenchRow):
    """AR or a speculative method through engine.decoding on our own backend."""

    def __init__(self, pair: ModelPair, method: str, cfg: SpecConfig, drafter: str, ignore_eos: bool,
                 backend: str = "auto", weight_dtype: str = DEFAULT_FAST_WEIGHTS):
        self.pair, self.cfg = pair, replace(cfg, method=method)
        self.target = pair.make_target(backend, weight_dtype)
        self.draft = None if method == "ar" else pair.make_drafter(drafter, backend, weight_dtype)
        self.eos = frozenset() if ignore_eos else pair.eos_token_ids

    def begin(self) -> None:
        self.totals = dict.fromkeys(SUM_KEYS, 0.0)
        self.phases = dict.fromkeys(PROFILE_COLUMNS, 0.0)
        self.divergence = DivergenceTally()
        self.prompts = 0

    def add(self, prompts: Sequence[list[int]], start: int) -> None:
        for i, ids in enumerate(prompts, start):
            run_cfg = replace(self.cfg, seed=self.cfg.seed + i)
            tested = []  # kept for the divergence, computed after the generation so it is not timed
            for event in generate(self.target, self.draft, self.pair.tokenizer, ids, run_cfg, eos_token_ids=self.eos):
                if isinstance(event, TokenEvent) and event.draft_prob is not None:
                    tested.append(event)
                elif isinstance(event, FinishEvent):
                    finish = event
            for token in tested:
                self.divergence.add(token)
            for key in SUM_KEYS:
                self.totals[key] += finish.metrics[key]
            for phase, seconds in finish.metrics["phase_seconds"].items():
                self.phases[phase] += seconds
            self.phases["between_rounds"] += finish.metrics["between_rounds_seconds"]
            self.prompts += 1

    def result(self) -> dict:
        rounds = max(self.totals["num_rounds"], 1)
        profile = {phase: 1e3 * seconds / rounds for phase, seconds in self.phases.items()}
        return _derive(self.totals, describe_device(self.target)) | {
            "mean_induced_kl": self.divergence.summary()["mean_induced_kl"], "backend": self.target.backend_label,
            "profile_ms_per_round": profile, "prefill_ms": 1e3 * self.totals["prefill_seconds"] / self.prompts}


def run_engine(pair: ModelPair, method: str, prompts: Sequence[list[int]], cfg: SpecConfig, drafter: str,
               ignore_eos: bool, backend: str = "auto", weight_dtype: str = DEFAULT_FAST_WEIGHTS) -> dict:
    """Run one method over all prompts; return summed counters and derived rates."""
    return EngineRow(pair, method, cfg, drafter, ignore_eos, backend, weight_dtype).run(prompts)


def _derive(t: dict, devices: str) -> dict:
    new, drafts, drafted = t["new_tokens"], t["num_drafts"], t["num_draft_tokens"]
    rounds_time = t["draft_seconds"] + t["verify_seconds"] + t["overhead_seconds"]
    return {
        "new_tokens": int(new),
        "tokens_per_s": new / t["elapsed_seconds"],
        "decode_tokens_per_s": new / max(t["elapsed_seconds"] - t["prefill_seconds"], 1e-9),
        "mean_acceptance_length": 1 + t["num_accepted_tokens"] / drafts if drafts else None,
        "draft_acceptance_rate": t["num_accepted_tokens"] / drafted if drafted else None,
        "target_forwards_per_token": t["target_forwards"] / new if new else None,
        "overhead_fraction": t["overhead_seconds"] / rounds_time if rounds_time else None,
        "draft_ms_per_token": 1e3 * t["draft_seconds"] / drafted if drafted else None,
        "verify_ms_per_round": 1e3 * t["verify_seconds"] / t["target_forwards"] if t["target_forwards"] else None,
        "devices": devices,
    }


_SSD_ENGINES: dict = {}


class SSDRow(BenchRow):
    """SSD in batches of `batch_size` (batch at prompt i: seed + i); one worker per (pair, drafter,
    devices), kept across rows and repeats until close_ssd_engines()."""

    def __init__(self, pair: ModelPair, method: str, cfg: SpecConfig, drafter: str, ignore_eos: bool,
                 backend: str = "auto", weight_dtype: str = DEFAULT_FAST_WEIGHTS, *, devices: str = "",
                 batch_size: int = 1, rule: str = "sps"):
        from engine.ssd.devices import default_devices
        from engine.ssd.ssd_decoding import SSDEngine, WorkerLost

        target_device, draft_device = parse_devices(devices) if devices else default_devices()
        key = (pair.name, drafter, backend, weight_dtype, str(target_device), str(draft_device))
        if key not in _SSD_ENGINES:
            _SSD_ENGINES[key] = SSDEngine(pair, drafter_kind=drafter, backend=backend, weight_dtype=weight_dtype,
                                          target_device=target_device, draft_device=draft_device)
        self.engine = _SSD_ENGINES[key]
        try:  # spawn and load the draft worker before any timing (seconds, once per engine)
            self.engine.start()
        except WorkerLost as err:  # main() turns a ValueError into a one-line error, not a traceback
            raise ValueError(f"the SSD row cannot run: {err}") from err
        self.cfg, self.step, self.rule = replace(cfg, method=rule), batch_size, rule
        self.eos = frozenset() if ignore_eos else pair.eos_token_ids

    def begin(self) -> None:
        self.totals = dict.fromkeys(SUM_KEYS, 0.0)
        self.hits = self.lookups = 0
        self.theory, self.measured = [], []
        self.projected = {"projected_tokens_per_s": 0.0, "model_tokens_per_s": 0.0}  # Σ seconds each model gives
        self.fill = {"mean_budget_used": 0.0, "mean_budget_requested": 0.0, "mean_cache_depth": 0.0}
        self.phases, self.rounds = dict.fromkeys(SSD_PHASE_KEYS, 0.0), 0  # Σ ms per round × rounds
        self.divergence = DivergenceTally()

    def add(self, prompts: Sequence[list[int]], start: int) -> None:
        for offset in range(0, len(prompts), self.step):
            run_cfg = replace(self.cfg, seed=self.cfg.seed + start + offset)
            events = list(self.engine.generate(prompts[offset:offset + self.step], run_cfg, eos_token_ids=self.eos))
            finishes = [e for e in events if isinstance(e, FinishEvent)]
            for event in events:
                if isinstance(event, TokenEvent):
                    self.divergence.add(event)
            for i, finish in enumerate(finishes):
                for k in SUM_KEYS:  # the batch shares one clock: count its time once
                    if i == 0 or k not in ("elapsed_seconds", "prefill_seconds"):
                        self.totals[k] += finish.metrics[k]
            m = finishes[0].metrics
            self.hits, self.lookups = self.hits + m["cache_hits"], self.lookups + m["cache_lookups"]
            self.theory += [m["theoretical_speedup"]] if m["theoretical_speedup"] is not None else []
            self.measured += [m["measured_speedup"]] if m["measured_speedup"] is not None else []
            batch_tokens = sum(f.metrics["new_tokens"] for f in finishes)
            for name in self.projected:
                self.projected[name] += batch_tokens / m[name] if m[name] else 0.0
            for name in self.fill:
                self.fill[name] += m[name] * m["cache_lookups"]
            rounds = max(f.metrics["num_rounds"] for f in finishes)  # the batch's rounds share one trace
            for name in self.phases:
                self.phases[name] += (m[name] or 0.0) * rounds
            self.rounds += rounds

    def result(self) -> dict:
        row = _derive(self.totals, self.engine.devices()) | {
            "backend": self.engine.backend_label,
            "mean_induced_kl": self.divergence.summary()["mean_induced_kl"]}
        # A projection, never a measurement: this run's trace with the target at its full-machine speed
        # (engine.ssd.projection); model_tokens_per_s is the same model at the measured speed, its check.
        new, lookups = self.totals["new_tokens"], self.lookups
        rates = {name: new / seconds if seconds else None for name, seconds in self.projected.items()}
        return row | rates | {name: value / lookups if lookups else None for name, value in self.fill.items()} | {
            **{name: total / self.rounds if self.rounds else None for name, total in self.phases.items()},
            "cache_hit_rate": self.hits / lookups if lookups else None, "batch_size": self.step,
            "ssd_rule": self.rule,
            "theoretical_speedup": statistics.mean(self.theory) if self.theory else None,
            "measured_speedup": statistics.mean(self.measured) if self.measured else None}


def run_ssd(pair: ModelPair, method: str, prompts: Sequence[list[int]], cfg: SpecConfig, drafter: str,
            ignore_eos: bool, backend: str = "auto", weight_dtype: str = DEFAULT_FAST_WEIGHTS, *,
            devices: str = "", batch_size: int = 1, rule: str = "sps") -> dict:
    """SSD over all prompts in batches; one worker per (pair, drafter, devices), kept across repeats."""
    return SSDRow(pair, method, cfg, drafter, ignore_eos, backend, weight_dtype, devices=devices,
                  batch_size=batch_size, rule=rule).run(prompts)


def close_ssd_engines() -> None:
    for engine in _SSD_ENGINES.values():
        engine.close()
    _SSD_ENGINES.clear()


class PeerRow(BenchRow):
    """Hugging Face `generate()` on the same weights: plain, or assisted with the same draft and K."""

    def __init__(self, pair: ModelPair, method: str, cfg: SpecConfig, drafter: str, ignore_eos: bool,
                 backend: str = "", weight_dtype: str = ""):
        self.model, self.method, self.drafter, self.cfg = pair.target_model, method, drafter, cfg
        sampling = cfg.temperature > 0
        self.gen_cfg = GenerationConfig(
            max_new_tokens=cfg.max_new_tokens,
            min_new_tokens=cfg.max_new_tokens if ignore_eos else 0,
            do_sample=sampling,
            temperature=cfg.temperature if sampling else None,
            top_k=(cfg.top_k or None) if sampling else None,
            top_p=cfg.top_p if sampling else None,
            eos_token_id=sorted(pair.eos_token_ids) or None,
            pad_token_id=pair.tokenizer.pad_token_id or 0,
        )
        self.kwargs = {}
        if method == "hf-assisted":
            self.gen_cfg.num_assistant_tokens = cfg.num_speculative_tokens
            self.gen_cfg.num_assistant_tokens_schedule = "constant"
            self.gen_cfg.assistant_confidence_threshold = 0.0
            if drafter == "ngram":
                self.gen_cfg.prompt_lookup_num_tokens = cfg.num_speculative_tokens
            else:
                assistant = {"self": pair.target_model, "model": pair.draft_model}.get(drafter)
                if assistant is None:
                    raise ValueError(f"hf-assisted cannot run the {drafter!r} drafter of pair {pair.name!r}: HF "
                                     "assisted generation needs a standalone draft model (the default pair's draft "
                                     "reads the target's features, EAGLE-style); use --peers hf-ar, or --drafter "
                                     "ngram/self")
                self.kwargs["assistant_model"] = assistant

    def begin(self) -> None:
        self.new = self.elapsed = 0.0
        self.forwards = 0

    def _count_forward(self, *_) -> None:
        self.forwards += 1

    def add(self, prompts: Sequence[list[int]], start: int) -> None:
        # Hooked only while this row runs: other rows may run the same model object.
        hook = self.model.register_forward_hook(self._count_forward)
        try:
            for i, ids in enumerate(prompts, start):
                torch.manual_seed(self.cfg.seed + i)
                input_ids = torch.tensor([ids])
                begun = time.perf_counter()
                with torch.inference_mode():
                    out = self.model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                              generation_config=self.gen_cfg, **self.kwargs)
                self.elapsed += time.perf_counter() - begun
                self.new += out.shape[1] - input_ids.shape[1]
                self.forwards -= 1  # the prefill forward is not a decoding step
        finally:
            hook.remove()

    def result(self) -> dict:
        # HF reports no acceptance counters; derive them from target forwards, assuming every round
        # drafted K tokens (true with the constant schedule, except a capped last round).
        # With the target drafting for itself the hook also counts draft forwards: no estimate then.
        new, k = self.new, self.cfg.num_speculative_tokens
        rounds = self.forwards if self.method == "hf-ar" or self.drafter != "self" else 0
        assisted = self.method == "hf-assisted" and rounds > 0
        return {
            "new_tokens": int(new),
            "tokens_per_s": new / self.elapsed,
            "mean_acceptance_length": new / rounds if assisted else None,
            "draft_acceptance_rate": (new - rounds) / (rounds * k) if assisted else None,
            "target_forwards_per_token": rounds / new if new and rounds else None,
            "mean_induced_kl": None,
            "devices": f"cpu ({torch.get_num_threads()} threads)",
            "backend": "transformers generate()",
        }


_llama = lru_cache(maxsize=1)(load_llama)  # the embedded GGUF loaded once by llama.cpp


class LlamaCppRow(BenchRow):
    """llama.cpp on the very GGUF our default target is converted from: the bar for CPU decoding.
    Same prompts, seeds, sampling (no min-p) and lengths as the engine rows, so its decode_tokens_per_s
    (the time after the first token, which comes right after the prefill) is at the same contexts."""

    def __init__(self, pair: ModelPair, method: str, cfg: SpecConfig, drafter: str, ignore_eos: bool,
                 backend: str = "", weight_dtype: str = ""):
        if pair.name != "default":
            raise SystemExit("the llama.cpp peer row runs the embedded GGUF: use --pair default")
        self.llm, self.cfg, self.pair_eos = _llama(torch.get_num_threads()), cfg, pair.eos_token_ids
        eos = sorted(pair.eos_token_ids)

        def ban_eos(ids, scores):
            scores[eos] = -np.inf
            return scores

        self.processors = [ban_eos] if ignore_eos else None

    def begin(self) -> None:
        self.new = self.elapsed = self.prefill = 0.0

    def add(self, prompts: Sequence[list[int]], start: int) -> None:
        cfg = self.cfg
        for i, ids in enumerate(prompts, start):
            self.llm.reset()  # no prompt-cache reuse across prompts: every row pays its own prefill
            self.llm.set_seed(cfg.seed + i)
            begun = time.perf_counter()
            tokens = self.llm.generate(ids, top_k=cfg.top_k, top_p=cfg.top_p, min_p=0.0, temp=cfg.temperature,
                                       logits_processor=self.processors)
            for n, token in enumerate(tokens):  # the first token comes right after the prefill
                if n == 0:
                    self.prefill += time.perf_counter() - begun
                if token in self.pair_eos:
                    break
                self.new += 1
                if n + 1 == cfg.max_new_tokens:
                    break
            self.elapsed += time.perf_counter() - begun

    def result(self) -> dict:
        new, elapsed = self.new, self.elapsed
        return {"new_tokens": int(new), "tokens_per_s": new / elapsed,
                "decode_tokens_per_s": new / (elapsed - self.prefill), "mean_acceptance_length": None,
                "draft_acceptance_rate": None, "target_forwards_per_token": None, "mean_induced_kl": None,
                "devices": f"cpu ({torch.get_num_threads()} threads)",
                "backend": "llama.cpp (GGUF Q4_1, one token per micro-batch)" if one_token_batches()
                else "llama.cpp (GGUF Q4_1)"}


ROW_KINDS = {"hf-ar": PeerRow, "hf-assisted": PeerRow, "llama.cpp": LlamaCppRow, SSD_METHOD: SSDRow}


def _weight_dtypes(text: str) -> list[str]:
    formats = list(dict.fromkeys(f for f in text.split(",") if f))
    bad = [f for f in formats if f not in WEIGHT_DTYPES]
    if bad or not formats:
        raise argparse.ArgumentTypeError(
            f"--weight-dtype wants a comma list of {', '.join(WEIGHT_DTYPES)}; got {text!r}")
    return formats


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m engine.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default="default", choices=PAIRS)
    ap.add_argument("--target", help="Hugging Face target name/path (instead of --pair)")
    ap.add_argument("--draft", help="Hugging Face draft name/path (with --target)")
    ap.add_argument("--drafter", default="model", choices=DRAFTER_KINDS)
    ap.add_argument("--backend", default="auto", choices=BACKENDS,
                    help="our engine's model backend (auto = fast where supported); peers always use transformers")
    ap.add_argument("--weight-dtype", default=[DEFAULT_FAST_WEIGHTS], type=_weight_dtypes,
                    help=f"weight format(s) of the fast backend, a comma list of {', '.join(WEIGHT_DTYPES)} "
                    "(float32 is the reference); with several, every engine row runs in each, side by side")
    ap.add_argument("--methods", default="ar,sps,tas,cactus",
                    help=f"comma list of {', '.join(DECODE_METHODS + (SSD_METHOD,))}")
    ap.add_argument("--peers", default="hf-ar",
                    help="comma list of hf-ar, hf-assisted, llama.cpp (needs llama-cpp-python), vllm (needs the "
                    "plugin venv: bash integrations/vllm/install.sh) ('' for none)")
    ap.add_argument("--vllm-batch", default="1,8", help="batch sizes of the vllm peer rows (requests given at once)")
    # The sampling every default-pair number is reported at (the draft issue's setting), so that a
    # command copied from a model card reproduces its numbers without extra flags.
    add_spec_arguments(ap, k_sweep=True, temperature=REPORTED_SAMPLING.temperature, top_p=REPORTED_SAMPLING.top_p,
                       top_k=REPORTED_SAMPLING.top_k)
    ssd = ap.add_argument_group("SSD (method ssd)")
    ssd.add_argument("--devices", default="", help="target=<dev>,draft=<dev> with dev cpu:N, cpu:N-M or cuda:N "
                     "(default: the draft gets the last core, the target the others)")
    ssd.add_argument("--sync-device", default="", help="cpu:N or cpu:N-M: pin the synchronous rows (ar, sps, tas, "
                     "cactus) to these cores, one thread each, e.g. SpS on the SSD target's own core")
    ssd.add_argument("--ssd-rule", default="sps", choices=("sps", "tas", "cactus"), help="acceptance rule inside SSD")
    ssd.add_argument("--fanout", type=int, default=3, help="uniform fan-out F per position")
    ssd.add_argument("--fanout-mode", default="uniform", choices=SSD_FANOUT_MODES)
    ssd.add_argument("--budget", type=int, default=0, help="cache budget B = Σ F_k (0 = F·(K+1))")
    ssd.add_argument("--power-r", type=float, default=0.0, help="power-law exponent r (0 = fitted online)")
    ssd.add_argument("--downweight-c", type=float, default=1.0, help="Saguaro sampling C in (0, 1] (1 = off)")
    ssd.add_argument("--backup", default="neural", choices=SSD_BACKUPS)
    ssd.add_argument("--batch-size", type=int, default=1, help="sequences SSD decodes together")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3, help="timing columns are medians over repeats")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = all cores)")
    ap.add_argument("--competitor", type=float, default=0.0,
                    help="run the timed repeats beside a process that keeps this share of a core busy "
                    "(engine.busy_core: spinning that share of every 8 ms), as a browser or a neighbour would")
    ap.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    ap.add_argument("--json", help="write the rows as JSON to this file")
    ap.add_argument("--profile", action="store_true",
                    help="also print where a round goes: ms per round of each phase (median over repeats), "
                    "the overhead outside the model forwards, and the prefill")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> pd.DataFrame:
    args = parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    peers = [m for m in args.peers.split(",") if m]
    vllm = "vllm" in peers  # whole rows from its own venv (engine/peers/vllm_peer.py), not per-repeat calls
    peers = [m for m in peers if m != "vllm"]
    for m in methods:
        if m not in DECODE_METHODS + (SSD_METHOD,):
            raise SystemExit(f"unknown method {m!r}; expected one of {', '.join(DECODE_METHODS + (SSD_METHOD,))}")
    for m in peers:
        if m not in PEER_METHODS:
            raise SystemExit(f"unknown peer {m!r}; expected one of {', '.join(PEER_METHODS)}")
    if args.prompts < 1 or args.repeats < 1 or args.batch_size < 1:
        raise SystemExit("--prompts, --repeats and --batch-size must be >= 1")
    if not 0 <= args.competitor <= 1:
        raise SystemExit(f"--competitor is a share of one core, in [0, 1]; got {args.competitor}")
    if args.threads:
        torch.set_num_threads(args.threads)
    # Every K of the sweep is checked before any model loads; without --k the pair's recommended K
    # (a measured value) is used once the pair is known.
    cfg = replace(spec_config_from_args(args, k=GENERIC_K), ssd_fanout=args.fanout, ssd_fanout_mode=args.fanout_mode,
                  ssd_budget=args.budget, ssd_power_r=args.power_r, downweight_c=args.downweight_c,
                  ssd_backup=args.backup)
    try:
        for k in args.k or [GENERIC_K]:
            replace(cfg, num_speculative_tokens=k).validate()
        if SSD_METHOD in methods and args.devices:
            parse_devices(args.devices)
        sync_device = parse_device(args.sync_device) if args.sync_device else None
        pair = load_pair(args.pair, args.target, args.draft)
        prompts = [pair.encode_prompt(p) for p in held_out_prompts(args.prompts)]
    except ValueError as err:
        raise SystemExit(f"error: {err}") from err

    ks = list(dict.fromkeys(args.k or [pair.recommended_k(args.drafter)]))
    formats = args.weight_dtype
    # One row per (method, K, weight format); rows that never draft run at the first K only, and
    # the peers (which do not use our backend) in the first format only.
    keys = [(m, k, wd) for m in methods + peers for k in (ks[:1] if m in UNDRAFTED else ks)
            for wd in (formats[:1] if m in PEER_METHODS else formats)]
    labels = {(m, k, wd): m + (f" K={k}" if len(ks) > 1 and m not in UNDRAFTED else "")
              + (f" [{wd}]" if len(formats) > 1 and m not in PEER_METHODS else "") for m, k, wd in keys}
    runs: dict[tuple[str, int, str], list[dict]] = {key: [] for key in labels}
    ssd_args = dict(devices=args.devices, batch_size=args.batch_size, rule=args.ssd_rule)

    def where(m: str) -> contextlib.AbstractContextManager:
        return pinned(sync_device) if sync_device and m != SSD_METHOD else contextlib.nullcontext()

    # The unit of the interleave: one prompt, or one SSD batch that every row decodes before the next.
    step = args.batch_size if SSD_METHOD in methods else 1
    starts = range(0, len(prompts), step)
    order = list(labels)
    try:
        built: dict[tuple[str, int, str], BenchRow] = {}
        for m, k, wd in order:
            with where(m):
                row = built[m, k, wd] = ROW_KINDS.get(m, EngineRow)(
                    pair, m, replace(cfg, num_speculative_tokens=k), args.drafter, args.ignore_eos, args.backend, wd,
                    **(ssd_args if m == SSD_METHOD else {}))
                # Untimed warm-up on the first prompt: a first forward pays one-off setup (about 2 s on the
                # default pair) that would land on whichever row goes first. Not SSD: its caches learn online.
                if m != SSD_METHOD:
                    row.begin()
                    row.add(prompts[:1], 0)
        with competitor(args.competitor):
            for rep in range(args.repeats):
                for key in order:
                    built[key].begin()
                for u, start in enumerate(starts):
                    first = (rep * len(starts) + u) % len(order)  # who goes first rotates, across repeats too
                    for m, k, wd in order[first:] + order[:first]:
                        with where(m):
                            built[m, k, wd].add(prompts[start:start + step], start + SEED_STRIDE * rep)
                for (m, k, wd), label in labels.items():
                    with where(m):  # a row's devices column reads the cores it ran on
                        runs[m, k, wd].append(built[m, k, wd].result())
                    tps = runs[m, k, wd][-1]["tokens_per_s"]
                    print(f"[bench] repeat {rep + 1}/{args.repeats} {label}: {tps:.2f} tok/s", file=sys.stderr,
                          flush=True)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from err
    finally:
        close_ssd_engines()

    rows = []
    for (m, k, wd), reps in runs.items():
        row = dict(reps[0])
        for key in TIMED_KEYS + (SSD_KEYS if m == SSD_METHOD else ()):
            values = [r[key] for r in reps if r.get(key) is not None]
            row[key] = statistics.median(values) if values else None
        for key in STATISTIC_KEYS:  # one draw per repeat's seeds: their mean
            values = [r[key] for r in reps if r.get(key) is not None]
            row[key] = statistics.fmean(values) if values else None
        row["mean_acceptance_length_runs"] = [r["mean_acceptance_length"] for r in reps]
        if "profile_ms_per_round" in row:
            row["profile_ms_per_round"] = {phase: statistics.median(r["profile_ms_per_round"][phase] for r in reps)
                                           for phase in PROFILE_COLUMNS}
            row["prefill_ms"] = statistics.median(r["prefill_ms"] for r in reps)
        row.update(label=labels[m, k, wd], method=m, weight_dtype=None if m in PEER_METHODS else wd, pair=pair.name,
                   drafter="-" if m in UNDRAFTED else args.drafter,
                   k=None if m in UNDRAFTED else k, delta=args.delta if m == "cactus" else None,
                   temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, prompts=args.prompts,
                   repeats=args.repeats, threads=torch.get_num_threads(), competitor=args.competitor,
                   tokens_per_s_runs=[r["tokens_per_s"] for r in reps])
        # Each row against AR in the same repeat and weight format (peers run in the first format only).
        ar_reps = runs.get(("ar", ks[0], wd))
        if ar_reps:
            row["speedup_vs_ar_runs"] = [r["tokens_per_s"] / a["tokens_per_s"] for r, a in zip(reps, ar_reps)]
            row["speedup_vs_ar"] = statistics.median(row["speedup_vs_ar_runs"])
        else:
            row["speedup_vs_ar_runs"] = row["speedup_vs_ar"] = None
        if m == SSD_METHOD:
            row.update(fanout=args.fanout, fanout_mode=args.fanout_mode,
                       budget=replace(cfg, num_speculative_tokens=k).ssd_cache_budget,  # B = F·(K+1) at this row's K
                       downweight_c=args.downweight_c, backup=args.backup)
            sps_reps = runs.get(("sps", k, wd))
            if sps_reps:
                row.update(ssd_against_sps(row, reps, sps_reps))
        rows.append(row)
    if vllm:
        from engine.peers.vllm_peer import bench_rows

        rows += bench_rows(pair.name, methods, prompts, replace(cfg, num_speculative_tokens=ks[0]), args.ignore_eos,
                           args.repeats, [int(b) for b in args.vllm_batch.split(",")],
                           formats[0] if formats[0] in ("float32", "bfloat16") else "bfloat16")
        # Not in our repeats: against AR's median, with no per-repeat ratios.
        ar_tps = runs.get(("ar", ks[0], formats[0]))
        base = statistics.median(r["tokens_per_s"] for r in ar_tps) if ar_tps else None
        for row in rows:
            if "speedup_vs_ar" not in row:
                row.update(speedup_vs_ar=row["tokens_per_s"] / base if base else None, speedup_vs_ar_runs=None)
    table = pd.DataFrame(rows).set_index("label")
    cols = ["tokens_per_s", "speedup_vs_ar", "speedup_vs_ar_runs", "new_tokens", "mean_acceptance_length",
            "draft_acceptance_rate", "target_forwards_per_token", "mean_induced_kl", "overhead_fraction",
            "draft_ms_per_token", "verify_ms_per_round", "cache_hit_rate", "mean_budget_used", "mean_cache_depth",
            "projected_tokens_per_s", "model_tokens_per_s", "theoretical_speedup", "measured_speedup",
            "vs_sps", "vs_sps_runs", "hit_ceiling_vs_sps", *SSD_PHASE_KEYS, "backend", "devices"]
    with pd.option_context("display.width", 200, "display.max_columns", 40, "display.float_format", "{:.3f}".format):
        shown = table[[c for c in cols if c in table.columns]].copy()
        for runs_column in ("speedup_vs_ar_runs", "vs_sps_runs"):
            if runs_column in shown:
                shown[runs_column] = shown[runs_column].map(
                    lambda ratios: "/".join(f"{x:.2f}" for x in ratios) if isinstance(ratios, list) else None)
        print(shown)
    if args.profile:
        for row in rows:
            ar_row = next((r for r in rows if r["method"] == "ar" and r["weight_dtype"] == row["weight_dtype"]), None)
            row["forwards_only_speedup"] = forwards_only_speedup(row, ar_row) if ar_row else None
        engine_rows = [row for row in built.values() if isinstance(row, EngineRow)]
        print_profile(rows, cold_op_microseconds(engine_rows[0].target, prompts[0]) if engine_rows else None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2, default=float)
    return table


def ssd_against_sps(row: dict, reps: Sequence[dict], sps_reps: Sequence[dict]) -> dict:
    """An SSD row against SpS at the same K in the same repeats: `vs_sps` (the median of the per-repeat
    ratios, `vs_sps_runs`) and `hit_ceiling_vs_sps`, the most SSD can gain over that SpS, Corollary 9's
    upper bound (ALGORITHMS.md §4.2) with every round a hit and as many tokens a round as SpS:
    1 + T_SD, SpS's draft time a round over its verification. A hit hides the draft and nothing else,
    so where drafting is a tenth of SpS's round no hit rate makes SSD 1.1x; the worker slowing the
    verification it shares the machine with only lowers the bound further. It assumes SSD verifies
    SpS's K rows: a hit that serves a shorter branch (a cut fill, a redrawn first token) verifies fewer,
    and where each row costs more (AVX2: about 40 % a row) that alone can pass it at the same tokens a
    round (session 35, K = 3: 13.0 against 15.9 ms a verification)."""
    sps = {key: statistics.median(r[key] for r in sps_reps if r.get(key) is not None)
           for key in ("draft_ms_per_token", "verify_ms_per_round") if any(r.get(key) is not None for r in sps_reps)}
    ratios = [r["tokens_per_s"] / base["tokens_per_s"] for r, base in zip(reps, sps_reps)]
    ceiling = (1 + sps["draft_ms_per_token"] * row["k"] / sps["verify_ms_per_round"]
               if len(sps) == 2 and sps["verify_ms_per_round"] else None)
    return {"vs_sps_runs": ratios, "vs_sps": statistics.median(ratios), "hit_ceiling_vs_sps": ceiling}


def forwards_only_speedup(row: dict, ar_row: dict) -> float | None:
    """The row's speedup over AR were every phase of a round but the models' forwards free, in both:
    its tokens a round (the mean accepted length, bonus included) over its draft and verify forwards,
    against AR's one token a forward. Cutting a round's overhead moves the measured speedup towards this
    ceiling and no further; above it only a better draft (a longer accepted length) or a cheaper verify
    of the extra rows helps (the Leviathan et al. speedup with the measured forward costs)."""
    profile, ar_profile = row.get("profile_ms_per_round"), ar_row.get("profile_ms_per_round")
    if not profile or not ar_profile:
        return None
    forwards = profile["draft_forward"] + profile["verify_forward"]
    tokens = 1.0 if row["method"] == "ar" else row.get("mean_acceptance_length")
    if not forwards or tokens is None or tokens != tokens:  # no rounds, or NaN
        return None
    return tokens * ar_profile["verify_forward"] / forwards


def cold_op_microseconds(target: CausalLM, prompt: Sequence[int], rounds: int = 31) -> tuple[float, float]:
    """Median µs of one small torch op (`torch.empty(2, 20)`) right after a one-token target forward,
    and of the same op right after it: what the first Python step between two forwards pays here.

    Why it is in the profile: on the 2-core KVM Xeons of this project the cold op took 30-90 µs
    against 3-5 warm, and a C spin or a sleep of the same 7 ms did the same as the forward (FAST_BACKEND.md,
    "Cold Python between forwards"), so a round's overhead phases there are mostly the number of
    Python steps a round takes, not what each step computes. (Every generation resets the target.)"""
    target.reset()
    target.forward(prompt)
    cold, warm = [], []
    for _ in range(rounds):
        target.forward(prompt[-1:])
        target.rollback(len(prompt))
        start = time.perf_counter()
        torch.empty(2, 20)
        middle = time.perf_counter()
        torch.empty(2, 20)
        cold.append(middle - start)
        warm.append(time.perf_counter() - middle)
    return 1e6 * statistics.median(cold), 1e6 * statistics.median(warm)


def print_profile(rows: Sequence[dict], cold_op: tuple[float, float] | None = None) -> None:
    """Where a round goes, per engine row: ms per round of each phase (the *_forward phases are the
    models' forwards; the rest is overhead), the overhead's share of the round, and the prefill; then
    `cold_op_microseconds` when given."""
    profiled = [r for r in rows if r.get("profile_ms_per_round")]
    if not profiled:
        return
    table = pd.DataFrame([{"label": r["label"], **r["profile_ms_per_round"],
                           "round_ms": sum(r["profile_ms_per_round"][p] for p in ROUND_PHASES),
                           "overhead_fraction": r["overhead_fraction"], "prefill_ms": r["prefill_ms"],
                           "forwards_only_vs_ar": r.get("forwards_only_speedup")}
                          for r in profiled]).set_index("label")
    print("\nper-round profile (ms per round, median over repeats; overhead = all but the two *_forward phases;\n"
          "forwards_only_vs_ar = the row's speedup over AR were every phase but the forwards free, in both)")
    with pd.option_context("display.width", 250, "display.max_columns", 20, "display.float_format", "{:.3f}".format):
        print(table)
    if cold_op is not None:
        print(f"one small torch op right after a target forward: {cold_op[0]:.1f} us; right after another: "
              f"{cold_op[1]:.1f} us (medians of 31)")


if __name__ == "__main__":
    main()

"""Running the engine for the playground: one generation, a comparison, a sweep, the AR baseline.

These functions own the engine calls and the limits (time, stop Event); the Gradio handlers only
call them and render. Every run gets fresh target/drafter state from the shared `ModelPair`, so
concurrent sessions share weights but never KV caches or random generators.
"""

from __future__ import annotations

import csv
import io
import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import pandas as pd

from engine.config import SpecConfig
from engine.decoding import generate
from engine.events import RoundEvent
from engine.models.registry import DEFAULT_FAST_WEIGHTS, ModelPair
from engine.ssd.ssd_decoding import SSDEngine
from playground.limits import Limits, inspector_width
from playground.session import Session, SessionStore
from playground.state import RunState, reduce, summary

YIELD_INTERVAL_SECONDS = 0.1  # token view refresh; charts have their own timer
AR_BASELINE_TOKENS = 32  # an AR run at least this long (EOS ignored or not) measures the "x AR" baseline
VLLM_TARGET_NAMES = {"default": "HuggingFaceTB/SmolLM2-135M-Instruct", "tiny": "./tiny-target (test pair)"}


@dataclass
class PlaygroundContext:
    """Everything the handlers share: the loaded pair (read-only), limits, sessions, AR baseline."""

    pair_name: str
    pair: ModelPair
    limits: Limits = field(default_factory=Limits)
    sessions: SessionStore = field(default_factory=SessionStore)
    drafter_kind: str = "model"
    devices: str = "cpu"
    ar_baseline_tps: float | None = None
    ar_baseline_note: str = "not measured yet"
    active_runs: int = 0  # engine loops running right now (for the health line and tests)
    ssd_devices: str = ""  # "target=cpu:0,draft=cpu:1"; empty = the engine's default split
    weight_dtype: str = DEFAULT_FAST_WEIGHTS  # the fast backend's weight format (app.py --weights)
    _ssd: SSDEngine | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def make_models(self, method: str):
        target = self.pair.make_target(weight_dtype=self.weight_dtype)
        if method == "ar":
            return target, None
        return target, self.pair.make_drafter(self.drafter_kind, weight_dtype=self.weight_dtype)

    def ssd_engine(self) -> SSDEngine:
        """The one SSD engine (one draft worker) of this app, started on first use; one SSD run at a time."""
        with self._lock:
            if self._ssd is None:
                target, draft = (dict(p.split("=", 1) for p in self.ssd_devices.split(",")).values()
                                 if self.ssd_devices else (None, None))
                self._ssd = SSDEngine(self.pair, drafter_kind=self.drafter_kind, weight_dtype=self.weight_dtype,
                                      target_device=target, draft_device=draft)
            return self._ssd

    def with_inspector(self, cfg: SpecConfig) -> SpecConfig:
        return replace(cfg, inspect_top_n=inspector_width(self.pair.vocab_size, cfg.top_k))

    def run_count(self, delta: int) -> None:
        with self._lock:
            self.active_runs += delta

    def refresh_ar_baseline(self, metrics: dict) -> None:
        """An AR run of at least AR_BASELINE_TOKENS that had the machine to itself becomes the
        baseline: the start-up measurement comes out low when the machine was busy then."""
        if metrics.get("new_tokens", 0) >= AR_BASELINE_TOKENS and metrics.get("decode_tokens_per_s"):
            self.ar_baseline_tps = metrics["decode_tokens_per_s"]
            self.ar_baseline_note = (f"AR baseline {self.ar_baseline_tps:.1f} tok/s (the last AR run alone on the "
                                     f"machine, {metrics['new_tokens']} tokens)")


def measure_ar_baseline(ctx: PlaygroundContext, prompt_ids: Sequence[int], new_tokens: int = AR_BASELINE_TOKENS) -> float:
    """Plain AR tokens/s of this target on this machine (greedy, EOS ignored): the speedup reference."""
    cfg = SpecConfig(method="ar", max_new_tokens=new_tokens, temperature=0.0)
    warm_up = SpecConfig(method="ar", max_new_tokens=8)
    list(generate(ctx.make_models("ar")[0], None, ctx.pair.tokenizer, prompt_ids, warm_up))
    finish = list(generate(ctx.make_models("ar")[0], None, ctx.pair.tokenizer, prompt_ids, cfg))[-1]
    tps = finish.metrics["decode_tokens_per_s"]
    ctx.ar_baseline_tps = tps
    ctx.ar_baseline_note = f"AR baseline {tps:.1f} tok/s (greedy, {new_tokens} tokens after a warm-up, measured at start-up)"
    return tps


def stream_run(ctx: PlaygroundContext, control: SpecConfig, prompt_ids: Sequence[int], stop: threading.Event,
               run: RunState, deadline: float, yield_every: float = YIELD_INTERVAL_SECONDS,
               outer_stop: threading.Event | None = None, ssd: bool = False) -> Iterator[RunState]:
    """Drive one engine generation into `run`, yielding it at most every `yield_every` seconds.

    The engine reads `control` at every round (live tuning) and checks `stop` before every round;
    past `deadline` (monotonic) we set `stop` ourselves. Closing this generator (Gradio cancel,
    client disconnect) also sets `stop`, so the engine never runs on unseen. `outer_stop` is a
    whole-job Stop (compare, sweep) forwarded to this run's own `stop`. `ssd` runs the SSD engine
    (draft worker on its own device) with `control.method` as its acceptance rule.
    """
    ctx.run_count(+1)
    alone = ctx.active_runs == 1
    last = 0.0
    try:
        if ssd:
            events = ctx.ssd_engine().generate([prompt_ids], control, eos_token_ids=ctx.pair.eos_token_ids, stop=stop)
        else:
            target, drafter = ctx.make_models(control.method)
            events = generate(target, drafter, ctx.pair.tokenizer, prompt_ids, control,
                              eos_token_ids=ctx.pair.eos_token_ids, stop=stop)
        for event in events:
            reduce(run, event)
            if outer_stop is not None and outer_stop.is_set():
                stop.set()
            now = time.monotonic()
            if now > deadline and not stop.is_set():
                stop.set()
                run.error = f"time limit of {ctx.limits.max_seconds:.0f} s reached; stopped"
            if isinstance(event, RoundEvent) and now - last >= yield_every:
                last = now
                yield run
        if control.method == "ar" and not ssd and run.finish and alone and ctx.active_runs == 1:
            ctx.refresh_ar_baseline(run.finish.metrics)
    except ValueError as err:  # a bad setting the limits did not catch: say it, do not crash the session
        run.error = str(err)
    finally:
        stop.set()
        ctx.run_count(-1)
    yield run


def start_session_run(ctx: PlaygroundContext, session: Session, cfg: SpecConfig, prompt_ids: Sequence[int],
                      ssd: bool = False) -> Iterator[RunState]:
    """A Generate-tab run: installs a fresh control object, stop Event and run state in the session."""
    session.stop.set()  # a previous run of this session, if any, stops at its next round
    stop = threading.Event()
    control = ctx.with_inspector(cfg)
    run = RunState(method="ssd" if ssd else cfg.method, config=control.as_dict())
    session.stop, session.control, session.run, session.rendered_version = stop, control, run, -1
    yield from stream_run(ctx, control, prompt_ids, stop, run, time.monotonic() + ctx.limits.max_seconds, ssd=ssd)


def run_compare(ctx: PlaygroundContext, methods: Sequence[str], cfg: SpecConfig, prompt_ids: Sequence[int],
                stop: threading.Event) -> Iterator[tuple[str, RunState, dict[str, RunState]]]:
    """The same prompt, seed and settings through each method in turn, in one queue slot.

    The engine draws every round's uniforms (draft sampling, acceptance tests, recovery) from one
    generator seeded by `cfg.seed`, so methods with the same K consume identical draws round by
    round and see identical drafts until their outputs first differ.
    """
    deadline = time.monotonic() + ctx.limits.max_seconds
    runs: dict[str, RunState] = {}
    for method in methods:
        # SSD verifies with SpS here, so it lines up with the synchronous SpS row.
        control = ctx.with_inspector(replace(cfg, method="sps" if method == "ssd" else method))
        run = runs[method] = RunState(method=method, config=control.as_dict())
        for _ in stream_run(ctx, control, prompt_ids, threading.Event(), run, deadline, yield_every=0.25,
                            outer_stop=stop, ssd=method == "ssd"):
            yield method, run, runs
        if stop.is_set() or time.monotonic() > deadline:
            break
    yield "", RunState(), runs


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_table(runs: dict[str, RunState]) -> pd.DataFrame:
    """One row per method; `first_difference` is the first token index that differs from the first method."""
    rows = []
    reference = next(iter(runs.values())).token_ids if runs else []
    for method, run in runs.items():
        m = summary(run)
        rows.append({
            "method": method,
            "new_tokens": m.get("new_tokens"),
            "tokens_per_s": m.get("decode_tokens_per_s", m.get("tokens_per_s")),
            "mean_acceptance_length": m.get("mean_acceptance_length"),
            "draft_acceptance_rate": m.get("draft_acceptance_rate"),
            "mean_kl_per_token": m.get("mean_kl_per_token"),
            "mean_induced_kl": m.get("mean_induced_kl"),
            "cache_hit_rate": m.get("cache_hit_rate"),
            "first_difference": first_difference(reference, run.token_ids),
            "finish": run.finish.reason if run.finish else ("error: " + run.error if run.error else "running"),
        })
    df = pd.DataFrame(rows)
    return df.round(4) if not df.empty else df


def tokens_csv(runs: dict[str, RunState]) -> str:
    """Per-token data of every compared method (one row per emitted token)."""
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["method", "index", "token_id", "text", "status", "round", "draft_position", "target_prob",
                     "draft_prob", "acceptance_prob", "gamma", "kl", "target_entropy", "induced_kl", "induced_exact"])
    for method, run in runs.items():
        for t in run.tokens:
            d = run.induced.get(t.index)
            writer.writerow([method, t.index, t.token_id, t.text, t.status, t.round_index, t.draft_position,
                             t.target_prob, t.draft_prob, t.acceptance_prob, t.gamma, t.kl, t.target_entropy,
                             d.kl if d else None, d.exact if d else None])
    return out.getvalue()


def run_config_json(ctx: PlaygroundContext, prompt: str, prompt_ids: Sequence[int], cfg: SpecConfig,
                    runs: dict[str, RunState]) -> str:
    first = next((r for r in runs.values() if r.start), None)
    return json.dumps({
        "pair": ctx.pair_name, "drafter": ctx.drafter_kind, "prompt": prompt, "prompt_tokens": len(prompt_ids),
        "methods": list(runs), "config": {k: v for k, v in cfg.as_dict().items() if k != "method"},
        "devices": first.start.devices if first else None,
        "finish": {m: (r.finish.reason if r.finish else r.error) for m, r in runs.items()},
    }, indent=2)


def sweep_points(delta_values: Sequence[float], epsilon_values: Sequence[float]) -> list[tuple[str, str, dict]]:
    """(method, label, config overrides) per point: SpS as the zero-divergence reference, then δ and ε."""
    points = [("sps", "SpS", {})]
    points += [("cactus", f"δ={d:g}", {"delta": float(d)}) for d in delta_values]
    points += [("tas", f"ε={e:g}", {"posterior_threshold": float(e)}) for e in epsilon_values]
    return points


def run_sweep(ctx: PlaygroundContext, cfg: SpecConfig, prompt_ids: Sequence[int],
              points: Sequence[tuple[str, str, dict]], stop: threading.Event,
              progress: Callable[[float, str], None] = lambda f, d: None) -> list[dict]:
    """Acceptance and throughput against the exact induced divergence, one generation per point."""
    deadline = time.monotonic() + ctx.limits.max_seconds
    results = []
    for i, (method, label, overrides) in enumerate(points):
        if stop.is_set() or time.monotonic() > deadline:
            break
        progress(i / len(points), f"{label} ({i + 1}/{len(points)})")
        control = ctx.with_inspector(replace(cfg, method=method, **overrides))
        run = RunState(method=method, config=control.as_dict())
        for _ in stream_run(ctx, control, prompt_ids, threading.Event(), run, deadline, yield_every=1e9,
                            outer_stop=stop):
            pass
        m = summary(run)
        results.append({
            "method": method, "label": label, **overrides,
            "mean_acceptance_length": m.get("mean_acceptance_length") or 1.0,
            "draft_acceptance_rate": m.get("draft_acceptance_rate"),
            "tokens_per_s": m.get("decode_tokens_per_s"),
            "mean_kl_per_token": m.get("mean_kl_per_token"),
            "divergence": m.get("mean_induced_kl") or 0.0,
            "divergence_exact": m.get("induced_kl_exact"),
        })
    progress(1.0, "done")
    return results

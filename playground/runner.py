"""Running the engine for the playground: one generation, a comparison, a sweep, the AR baseline.

These functions own the engine calls and the limits (time, stop Event); the Gradio handlers only
call them and render. Every run gets fresh target/drafter state from the shared `ModelPair`, so
concurrent sessions share weights but never KV caches or random generators.
"""

from __future__ import annotations

import csv
import io
import json
import statistics
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import pandas as pd

from engine.config import SpecConfig
from engine.decoding import generate
from engine.models.registry import DEFAULT_FAST_WEIGHTS, ModelPair
from engine.ssd.ssd_decoding import SSDEngine
from playground.engine_loop import EngineLoop, RunHandle
from playground.limits import Limits, inspector_width
from playground.live_feed import LiveFeeds
from playground.session import Session, SessionStore
from playground.state import RunState, reduce, summary

FRAME_SECONDS = 0.15  # how often a waiting handler hands the page a new snapshot of its run (each costs the browser a redraw)
AR_REFERENCE_TOKENS = 32  # an AR run at least this long, alone on the engine, becomes its session's reference
AR_REFERENCE_RUNS = 5  # a session's reference: the median of its last this many such runs
VLLM_TARGET_NAMES = {"default": "HuggingFaceTB/SmolLM2-135M-Instruct", "tiny": "./tiny-target (test pair)"}


@dataclass(frozen=True)
class ARReference:
    """The AR speed a "x AR" readout divides by, and how and when it was measured (shown on the page)."""

    tokens_per_s: float
    how: str


@dataclass
class PlaygroundContext:
    """Everything the handlers share: the loaded pair (read-only), limits, sessions, the engine threads."""

    pair_name: str
    pair: ModelPair
    limits: Limits = field(default_factory=Limits)
    sessions: SessionStore = field(default_factory=SessionStore)
    drafter_kind: str = "model"
    devices: str = "cpu"
    ssd_devices: str = ""  # "target=cpu:0,draft=cpu:1"; empty = the engine's default split
    weight_dtype: str = DEFAULT_FAST_WEIGHTS  # the fast backend's weight format (app.py --weights)
    startup_reference: ARReference | None = None  # a session's reference until it runs AR itself
    feeds: LiveFeeds = field(default_factory=LiveFeeds)  # the Generate tab's live token feeds
    engine: EngineLoop = field(default_factory=EngineLoop)  # owns every torch call of the synchronous methods
    # SSD pins its thread to the target's cores and torch threads for a whole generation, so it gets
    # its own thread rather than leaking that pinning into other sessions' rounds.
    ssd_loop: EngineLoop = field(default_factory=lambda: EngineLoop("specplay-ssd"))
    _ssd: SSDEngine | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def active_runs(self) -> int:
        """Engine runs in progress right now (for the health line and tests)."""
        return self.engine.active_runs + self.ssd_loop.active_runs

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

    def loop_for(self, ssd: bool) -> EngineLoop:
        return self.ssd_loop if ssd else self.engine

    def reference_for(self, session: Session | None) -> ARReference | None:
        """The session's own AR measurement, else the start-up one: never another visitor's."""
        return (session.ar_reference if session is not None and session.ar_reference else None) \
            or self.startup_reference


def start_run(ctx: PlaygroundContext, control: SpecConfig, prompt_ids: Sequence[int], run: RunState,
              deadline: float, *, ssd: bool = False, paused: bool = False, steps: int = 1) -> RunHandle:
    """Put one generation on its engine thread. The engine reads `control` at every round (live
    tuning); the models are made on the engine thread too, so no other thread opens a parallel region.
    A `paused` run parks after `steps` rounds (0: before its prefill)."""
    def events():
        if ssd:
            return ctx.ssd_engine().generate([prompt_ids], control, eos_token_ids=ctx.pair.eos_token_ids,
                                             stop=handle.stop)
        target, drafter = ctx.make_models(control.method)
        return generate(target, drafter, ctx.pair.tokenizer, prompt_ids, control,
                        eos_token_ids=ctx.pair.eos_token_ids, stop=handle.stop)

    handle = RunHandle(events, run, deadline, paused=paused, steps=steps if paused else 0,
                       time_limit_note=f"time limit of {ctx.limits.max_seconds:.0f} s reached; stopped")
    return ctx.loop_for(ssd).start(handle)


def follow(ctx: PlaygroundContext, handle: RunHandle, *, frame_seconds: float = FRAME_SECONDS,
           outer_stop: threading.Event | None = None, ssd: bool = False) -> Iterator[RunState]:
    """The run's folded state once per frame until it ends (then once more, complete).

    Closing this generator (Gradio cancel, client disconnect) stops the run, so the engine never
    runs on unseen; `outer_stop` is a whole-job Stop (compare, sweep) forwarded to the run.
    """
    loop = ctx.loop_for(ssd)
    def first_round(h: RunHandle) -> bool:
        return h.rounds_done > 0 or h.parked or h.done.is_set()

    try:
        # The first tokens go out the moment the first round ends, not at the next frame tick.
        while not handle.wait(first_round, frame_seconds):
            if outer_stop is not None and outer_stop.is_set():
                loop.stop(handle)
        yield handle.state()
        while not handle.done.wait(frame_seconds):
            if outer_stop is not None and outer_stop.is_set():
                loop.stop(handle)
            yield handle.state()
    finally:
        if not handle.done.is_set():
            loop.stop(handle)
    yield handle.state()


def stream_run(ctx: PlaygroundContext, control: SpecConfig, prompt_ids: Sequence[int], run: RunState,
               deadline: float, *, frame_seconds: float = FRAME_SECONDS, outer_stop: threading.Event | None = None,
               ssd: bool = False) -> Iterator[RunState]:
    """Start a run and follow it (compare, sweep and tests; the Generate tab keeps the handle)."""
    handle = start_run(ctx, control, prompt_ids, run, deadline, ssd=ssd)
    yield from follow(ctx, handle, frame_seconds=frame_seconds, outer_stop=outer_stop, ssd=ssd)


def measure_ar_reference(ctx: PlaygroundContext, prompt_ids: Sequence[int], cfg: SpecConfig,
                         repeats: int = 2) -> ARReference:
    """AR on the page's own pipeline (engine thread, inspector on, the page's default settings),
    after a warm-up: the "x AR" reference of every session until it times AR itself."""
    control = ctx.with_inspector(replace(cfg, method="ar"))
    deadline = time.monotonic() + ctx.limits.max_seconds
    for _ in stream_run(ctx, replace(control, max_new_tokens=8), prompt_ids, RunState(), deadline):
        pass
    speeds = []
    for _ in range(repeats):
        run = RunState(method="ar", config=control.as_dict())
        for run in stream_run(ctx, control, prompt_ids, run, deadline):
            pass
        if run.finish is None:
            raise RuntimeError(f"the AR reference run failed: {run.error}")
        speeds.append(run.finish.metrics["decode_tokens_per_s"])
    tps = sorted(speeds)[len(speeds) // 2]
    ctx.startup_reference = ARReference(tps, f"AR {tps:.1f} tok/s: this page's pipeline at start-up "
                                             f"({time.strftime('%H:%M UTC', time.gmtime())}, {control.max_new_tokens} "
                                             f"tokens at T {control.temperature:g}, median of {repeats})")
    return ctx.startup_reference


def timed_ar_speed(handle: RunHandle, ssd: bool) -> float | None:
    """The decode speed of a finished AR run that had the engine to itself, unpaused and long
    enough; None for any other run, which would compare unlike with like."""
    run = handle.run
    m = run.finish.metrics if run.finish else {}
    if (run.method != "ar" or ssd or handle.max_concurrent > 1 or handle.paused_seconds > 0
            or m.get("new_tokens", 0) < AR_REFERENCE_TOKENS or not m.get("decode_tokens_per_s")):
        return None
    return m["decode_tokens_per_s"]


def add_ar_run(session: Session, tokens_per_s: float, new_tokens: int, reference_run: bool = False) -> ARReference:
    """The session's reference after one more timed AR run: the median of its last AR_REFERENCE_RUNS.
    One 96-token run's speed moves by about ±10 % on these 2-core VMs (AMD EPYC Zen 3: 177-207 tok/s
    in three engine runs of the same request), and a one-run reference passed that on to every "x AR".
    `reference_run`: the run was the page's AR reference run (`wants_ar_reference_run`)."""
    speeds = session.ar_speeds
    speeds.append(tokens_per_s)
    del speeds[:-AR_REFERENCE_RUNS]
    tps = statistics.median(speeds)
    latest = f"at {time.strftime('%H:%M:%S UTC', time.gmtime())} ({new_tokens} tokens, alone on the engine)"
    what = "AR reference run, before your first run on this page," if reference_run else "AR run"
    how = (f"AR {tps:.1f} tok/s: your {what} {latest}" if len(speeds) == 1 else
           f"AR {tps:.1f} tok/s: the median of your last {len(speeds)} AR runs, the latest {latest}")
    return ARReference(tps, how)


def wants_ar_reference_run(session: Session, cfg: SpecConfig) -> bool:
    """Whether a page's Generate click runs plain AR on the same prompt and settings before the method
    it asked for: once per session, for its first run of a speculative method while it has no AR
    reference of its own (not when Pause is armed: that parks the run the user asked for).

    Why: the start-up reference is measured with no browser on the machine, and a page on the same
    cores costs every run it watches. With Chromium on this 2-core VM, AR through the page ran at
    126-148 tok/s against the start-up reference's 203, so a first Cactus run read 0.68x AR where
    the same page's AR gave 1.41-1.49x (AMD EPYC Zen 3). API clients watch nothing: the start-up
    reference is theirs."""
    return (cfg.method != "ar" and session.ar_reference is None and not session.ar_reference_run
            and not session.pause_next)


def ar_reference_config(cfg: SpecConfig) -> SpecConfig:
    """The AR reference run's settings: the user's, as AR, long enough to count (`timed_ar_speed`)."""
    return replace(cfg, method="ar", max_new_tokens=max(cfg.max_new_tokens, AR_REFERENCE_TOKENS))


def start_session_run(ctx: PlaygroundContext, session: Session, cfg: SpecConfig, prompt_ids: Sequence[int],
                      ssd: bool = False, reference_run: bool = False) -> Iterator[RunState]:
    """A Generate-tab run: installs a fresh control object, handle and run state in the session.

    If the session armed Pause before the run, the run parks after its first round. `reference_run`:
    the page's AR reference run (`wants_ar_reference_run`).
    """
    if session.handle is not None:
        ctx.loop_for(session.handle_ssd).stop(session.handle)  # a previous run stops at its next round
    control = ctx.with_inspector(cfg)
    run = RunState(method="ssd" if ssd else cfg.method, config=control.as_dict())
    session.control, session.run, session.rendered_version = control, run, None
    handle = start_run(ctx, control, prompt_ids, run, time.monotonic() + ctx.limits.max_seconds, ssd=ssd,
                       paused=session.pause_next)
    session.handle, session.handle_ssd, session.pause_next = handle, ssd, False
    yield run
    yield from follow(ctx, handle, ssd=ssd)
    speed = timed_ar_speed(handle, ssd)
    if speed is not None:
        session.ar_reference = add_ar_run(session, speed, handle.run.finish.metrics["new_tokens"], reference_run)


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
        for _ in stream_run(ctx, control, prompt_ids, run, deadline, frame_seconds=0.25, outer_stop=stop,
                            ssd=method == "ssd"):
            yield method, run, runs
        if stop.is_set() or time.monotonic() > deadline:
            break
    yield "", RunState(), runs


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


COMPARE_COLUMNS = ("method", "new_tokens", "tokens_per_s", "x_ar", "mean_acceptance_length", "draft_acceptance_rate",
                   "mean_induced_kl", "mean_draft_kl", "constraint_kl_total", "cache_hit_rate", "first_difference",
                   "finish")


def compare_table(runs: dict[str, RunState]) -> pd.DataFrame:
    """One row per method; `first_difference` is the first token index that differs from the first method,
    `x_ar` the speed against this comparison's own AR row (same prompt, settings and moment)."""
    rows = []
    reference = next(iter(runs.values())).token_ids if runs else []
    ar = runs.get("ar")
    ar_tps = summary(ar).get("decode_tokens_per_s") if ar is not None and ar.finish is not None else None
    for method, run in runs.items():
        m = summary(run)
        tps = m.get("decode_tokens_per_s", m.get("tokens_per_s"))
        rows.append({
            "method": method,
            "new_tokens": m.get("new_tokens"),
            "tokens_per_s": tps,
            "x_ar": tps / ar_tps if ar_tps and tps else None,  # against the AR row of this same comparison
            "mean_acceptance_length": m.get("mean_acceptance_length"),
            "draft_acceptance_rate": m.get("draft_acceptance_rate"),
            "mean_induced_kl": m.get("mean_induced_kl"),
            "mean_draft_kl": m.get("mean_draft_kl"),
            "constraint_kl_total": m.get("constraint_kl_total") if method == "cactus" else None,
            "cache_hit_rate": m.get("cache_hit_rate"),
            "first_difference": first_difference(reference, run.token_ids),
            "finish": run.finish.reason if run.finish else ("error: " + run.error if run.error else "running"),
        })
    return pd.DataFrame(rows, columns=COMPARE_COLUMNS).round(4)  # the headers stand before the first run too


def tokens_csv(runs: dict[str, RunState]) -> str:
    """Per-token data of every compared method (one row per emitted token)."""
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["method", "index", "token_id", "text", "status", "round", "draft_position", "target_prob",
                     "draft_prob", "acceptance_prob", "gamma", "constraint_kl", "target_entropy", "induced_kl",
                     "draft_kl"])
    for method, run in runs.items():
        for t in run.tokens:
            d = run.divergence.get(t.index)
            writer.writerow([method, t.index, t.token_id, t.text, t.status, t.round_index, t.draft_position,
                             t.target_prob, t.draft_prob, t.acceptance_prob, t.gamma,
                             t.constraint_kl if t.gamma is not None else None, t.target_entropy,
                             d.induced_kl if d else None, d.draft_kl if d else None])
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


SWEEP_COLUMNS = ("method", "label", "delta", "posterior_threshold", "mean_acceptance_length", "draft_acceptance_rate",
                 "tokens_per_s", "divergence", "tested_positions")


def sweep_table(results: Sequence[dict]) -> pd.DataFrame:
    """The finished sweep points, one row each, in a fixed column order (headers before the first point).
    A point sets only the knob it sweeps: δ for Cactus, ε for TAS, neither for SpS."""
    return pd.DataFrame(list(results), columns=SWEEP_COLUMNS).round(4)


def run_sweep(ctx: PlaygroundContext, cfg: SpecConfig, prompt_ids: Sequence[int],
              points: Sequence[tuple[str, str, dict]], stop: threading.Event) -> Iterator[tuple[list[dict], str]]:
    """Acceptance and throughput against the exact induced divergence, one generation per point.

    Yields (finished points, what runs next) after every point, so a page shows them as they come and
    Stop keeps them: a point cut short by Stop or the time limit is left out, not plotted half-done.
    """
    deadline = time.monotonic() + ctx.limits.max_seconds
    results: list[dict] = []
    for i, (method, label, overrides) in enumerate(points):
        yield results, f"running {label} ({i + 1}/{len(points)})"
        if stop.is_set() or time.monotonic() > deadline:
            break
        control = ctx.with_inspector(replace(cfg, method=method, **overrides))
        run = RunState(method=method, config=control.as_dict())
        for _ in stream_run(ctx, control, prompt_ids, run, deadline, frame_seconds=0.5, outer_stop=stop):
            pass
        if run.finish is None or run.finish.reason not in ("eos", "max_new_tokens"):
            break
        m = summary(run)
        results.append({
            "method": method, "label": label, **overrides,
            "mean_acceptance_length": m.get("mean_acceptance_length") or 1.0,
            "draft_acceptance_rate": m.get("draft_acceptance_rate"),
            "tokens_per_s": m.get("decode_tokens_per_s"),
            "divergence": m.get("mean_induced_kl") or 0.0,
            "tested_positions": m.get("tested_positions"),
        })
    yield results, f"done: {len(results)} of {len(points)} points" + ("" if len(results) == len(points) else
                                                                       " (stopped)")

"""The SSD decoding loop: the target verifies in this process while the draft worker fills its cache.

Per round and sequence: send the last verified outcome (k, y) to the worker, which answers at once
from its speculation cache (a hit) or with a backup speculation (a miss), then — while the target
verifies that speculation here — drafts the next speculation for every likely outcome. Verification
is the ordinary rule (SpS by default; TAS and Cactus as options) against the exact distribution D'
each token was sampled from (Saguaro-modified or not), so SSD with SpS is lossless.

Batches: several sequences are decoded together and every sequence has its own hit or miss, but
what is batched is the protocol, not the arithmetic. The target verifies the sequences one after
another (a `CausalLM` holds one sequence's cache), and the worker fills each sequence's cache with
one tree pass of its own. With the neural backup any miss delays the reply for the whole batch,
as in the released engine; that is the effect Theorem 17's adaptive backup weighs.

Where no fill could save a draft step (a feature draft at K = 1: its hit redraws the only token
from the real features, `fill_budget.min_fill_depth`), a round asks the worker nothing and drafts
here, exactly as SpS does: the worker could only add its two messages. Its cache is then stale, so
the next request after such rounds carries every committed token and feature, and no lookup.

If the worker dies or stops answering, the loop says so in a `WorkerEvent` and finishes the
generation with synchronous drafting in this process (the next generation starts a new worker).
"""

from __future__ import annotations

import contextlib
import copy
import multiprocessing as mp
import statistics
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from engine.config import SpecConfig
from engine.acceptance import NativeRule, RandomDraws, TargetRows, VerifyResult
from engine.decoding import _token_events, round_rule, verify_round
from engine.detokenize import IncrementalDetokenizer
from engine.drafters import Drafter, Proposal
from engine.events import FinishEvent, RoundEvent, SSDRoundEvent, StartEvent, TimelineSpan, TokenEvent, WorkerEvent
from engine.metrics import SpecMetrics, SSDMetrics
from engine.models.causal_lm import CausalLM, HFCausalLM
from engine.models.registry import DEFAULT_FAST_WEIGHTS, ModelPair
from engine.ssd.backups import resolve_backup
from engine.ssd.devices import DeviceSpec, default_devices, parse_device, pinned
from engine.ssd.fanout import FanoutPlanner
from engine.ssd.fill_budget import LOCAL_NOTE, min_fill_depth
from engine.ssd.projection import ProjectionTrace, RoundTiming
from engine.ssd.speculation_cache import Key
from engine.uniform_stream import UniformStream
from engine.ssd import wire
from engine.ssd.worker import (REPLY_SPIN_SECONDS, BuildReport, DrafterSpec, RoundReply, RoundRequest, SeqReply,
                               SeqRequest, StartRequest, WorkerInfo, spin_poll, worker_main)

SSDEvent = StartEvent | TokenEvent | RoundEvent | SSDRoundEvent | WorkerEvent | FinishEvent
POLL_SECONDS = 0.02
LOCAL = "local"  # a round's source and backup when it is drafted here by choice: no fill could save a step
PREFILL_ROWS = 64  # the prefill row count the full-machine ratio is calibrated at
CALIBRATION_RUNS = 3


class WorkerLost(RuntimeError):
    """The draft worker exited, crashed, or did not answer in time."""


@dataclass
class _Row:
    """One sequence of the batch: its target, text and what the worker must be told next."""

    target: CausalLM
    context: list[int]
    uniforms: UniformStream
    detok: IncrementalDetokenizer
    metrics: SpecMetrics = field(default_factory=SpecMetrics)
    generated: list[int] = field(default_factory=list)
    pending_logits: torch.Tensor | None = None
    rule_settings: SpecConfig | None = None  # the config snapshot `rule` was built for
    rule: NativeRule | None = None
    commit: list[int] = field(default_factory=list)
    outcome: tuple[int, int] | None = None
    lookup: tuple[int, int] | None = None  # the outcome the last request asked the worker's cache for
    drafted_here: bool = False  # a local round since the last request: the worker's cache is stale
    served_length: int = 0  # length of the speculation the worker served last (before any cut)
    hidden: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # all target features (local drafts)
    unsent_hidden: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    reserved: int = 0  # uniforms the worker draws for the speculation in flight (SeqRequest.reserved)
    index: int = 0  # the row's place in the batch (and in the engine's pools of targets and drafters)
    local_drafter: Drafter | None = None
    local_seen: int = 0  # entries of `hidden` the local drafter has observed
    degraded: bool = False  # the worker is gone: every draft from here on is local
    finished: str | None = None


class SSDEngine:
    """Target here, draft in a worker process on its own device; reusable across generations.

    `target_device` / `draft_device` take `cpu:N`, `cpu:N-M` or `cuda:N` (default: the draft gets
    the last core, the target the others). `fill_to_verify` sizes each round's cache fill to the
    verification it overlaps (engine.ssd.fill_budget); False fills every branch to depth K as the
    released engine does, however long that takes. The worker rebuilds the drafter from the registry pair
    name, so SSD runs on registry pairs (`tiny`, `default`).
    """

    def __init__(self, pair: ModelPair, *, drafter_kind: str = "model", backend: str = "auto",
                 weight_dtype: str = DEFAULT_FAST_WEIGHTS, target_device: str | DeviceSpec | None = None,
                 draft_device: str | DeviceSpec | None = None, reply_timeout: float = 120.0,
                 start_timeout: float = 300.0, fill_to_verify: bool = True) -> None:
        if pair.name not in ("tiny", "default"):
            raise ValueError(f"SSD runs on the registry pairs 'tiny' and 'default' (the draft worker loads the pair "
                             f"by name); got {pair.name!r}")
        default_target, default_draft = default_devices() if not (target_device and draft_device) else (None, None)
        self.target_device = _device(target_device, default_target)
        self.draft_device = _device(draft_device, default_draft)
        if set(self.target_device.cores) & set(self.draft_device.cores):
            raise ValueError(f"target {self.target_device} and draft {self.draft_device} share cores; SSD needs them apart")
        self.pair = pair
        self.spec = DrafterSpec(pair.name, drafter_kind, backend, weight_dtype)
        self.backend, self.weight_dtype = backend, weight_dtype
        self.reply_timeout, self.start_timeout = reply_timeout, start_timeout
        self.fill_to_verify = fill_to_verify
        self.info: WorkerInfo | None = None
        self._process: mp.process.BaseProcess | None = None
        self._conn = None
        self._targets: list[CausalLM] = []
        self._drafters: list[Drafter] = []  # drafters in this process, for rounds drafted here
        self._generation = 0
        self._calibration: dict[int, float] = {}  # target rows -> forward time on every core / pinned
        self._lock = threading.Lock()  # one generation at a time per engine (one worker)
        self._packer = wire.RequestPacker()
        # One token's text, decoded once: a round names up to B cache keys, its lookup and its rejection.
        self._token_text = lru_cache(maxsize=None)(lambda token: pair.tokenizer.decode([token]))

    # -- worker lifecycle ------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    @property
    def worker_pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def devices(self) -> str:
        return f"target={self.target_device.describe()}, draft={self.draft_device.describe()}"

    @property
    def backend_label(self) -> str:
        """The target's backend and weight format, then the draft worker's (they can differ: a draft
        takes bfloat16 where the target takes q4_1)."""
        target = self._targets[0].backend_label if self._targets else f"{self.backend}/{self.weight_dtype}"
        return f"{target}, draft {self.info.backend}" if self.info is not None else target

    def start(self) -> WorkerInfo:
        """Spawn the worker (a fresh interpreter: forking a process with torch threads can deadlock)."""
        if self.alive and self.info is not None:
            return self.info
        self.close()
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        process = ctx.Process(target=worker_main, args=(self.spec, self.draft_device, child), daemon=True,
                              name="ssd-draft-worker")
        try:
            process.start()
        except (OSError, RuntimeError) as err:  # no process to join: say why, as a lost worker does
            parent.close()
            raise WorkerLost(f"the draft worker could not be started ({type(err).__name__}: {err})") from err
        finally:
            child.close()
        self._process, self._conn = process, parent
        self.info = self._receive(WorkerInfo, self.start_timeout)
        return self.info

    def close(self) -> None:
        """Ask the worker to exit; kill it if it does not."""
        if self._conn is not None:
            try:
                self._conn.send(None)
            except (OSError, EOFError):
                pass
        if self._process is not None:
            self._process.join(timeout=5)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(timeout=5)
        if self._conn is not None:
            self._conn.close()
        self._process, self._conn, self.info = None, None, None

    def __enter__(self) -> "SSDEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, msg: object) -> None:
        try:
            if isinstance(msg, RoundRequest):  # the critical path's message: packed, not pickled (wire.py)
                self._conn.send_bytes(self._packer.pack(msg))
            else:
                self._conn.send(msg)
        except (OSError, EOFError, ValueError, AttributeError) as err:
            raise WorkerLost(self._lost(f"could not be reached ({type(err).__name__})")) from err

    def _lost(self, what: str) -> str:
        if self.alive and self._process is not None:
            # A closed pipe usually means the process is dying: give it a moment to be reaped, so
            # the message says "exited" (with its exit code) rather than "running".
            self._process.join(timeout=1.0)
        if self.alive:
            return f"the draft worker is running but {what}"
        code = self._process.exitcode if self._process is not None else None
        return f"the draft worker exited (exit code {code}; {what})"

    def _receive(self, kind: type, timeout: float, builds: list[BuildReport] | None = None):
        """The next message of type `kind` for this generation; BuildReports met on the way are collected
        in `builds`; anything left over from an abandoned generation is dropped. The first
        `REPLY_SPIN_SECONDS` are busy-polled (`worker.spin_poll`): the reply usually comes within them."""
        deadline, spin_until = time.monotonic() + timeout, time.perf_counter() + REPLY_SPIN_SECONDS
        while True:
            try:
                ready = spin_poll(self._conn, spin_until - time.perf_counter()) or self._conn.poll(POLL_SECONDS)
                msg = wire.loads(self._conn.recv_bytes()) if ready else None
            except (OSError, EOFError, AttributeError) as err:
                raise WorkerLost(self._lost(f"its pipe closed ({type(err).__name__})")) from err
            if isinstance(msg, Exception):
                raise WorkerLost(f"the draft worker failed: {msg}")
            if getattr(msg, "generation", self._generation) != self._generation:
                continue
            if isinstance(msg, kind):
                return msg
            if isinstance(msg, BuildReport) and builds is not None:
                builds.append(msg)
                continue
            if msg is None:
                if not self.alive:
                    raise WorkerLost(self._lost("no reply"))
                if time.monotonic() > deadline:
                    raise WorkerLost(f"the draft worker did not answer within {timeout:.0f} s")

    # -- generation ------------------------------------------------------------------------------
    def _make_targets(self, n: int) -> list[CausalLM]:
        while len(self._targets) < n:
            if self.target_device.kind == "cuda":
                model = copy.deepcopy(self.pair.target_model).to(self.target_device.torch_device)
                self._targets.append(HFCausalLM(model, f"{self.pair.name}/target", self.pair.vocab_size))
            else:
                self._targets.append(self.pair.make_target(self.backend, self.weight_dtype))
        return self._targets[:n]

    def _make_drafters(self, n: int) -> list[Drafter]:
        while len(self._drafters) < n:
            self._drafters.append(self.pair.make_drafter(self.spec.kind, self.backend, self.weight_dtype))
        return self._drafters[:n]

    def _drafts_here(self, cfg: SpecConfig) -> bool:
        """Whether a round at these settings is drafted in this process: no fill could save a step."""
        return self.fill_to_verify and cfg.num_speculative_tokens < min_fill_depth(
            self._drafters[0].needs_target_features)

    def generate(self, prompts: Sequence[Sequence[int]], config: SpecConfig, *,
                 eos_token_ids: frozenset[int] = frozenset(), stop: threading.Event | None = None) -> Iterator[SSDEvent]:
        """Decode every prompt of the batch; events carry `sequence` (the prompt's index)."""
        cfg = config.snapshot()
        if cfg.method == "ar":
            raise ValueError("SSD verifies speculations: choose an acceptance rule (sps, tas or cactus), not 'ar'")
        if not prompts or any(not p for p in prompts):
            raise ValueError("every prompt of the batch needs at least one token")
        vocab = self.pair.vocab_size
        if any(not 0 <= t < vocab for p in prompts for t in p):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if not self._lock.acquire(blocking=False):
            raise ValueError("this SSD engine is already generating; one generation at a time per draft worker")
        try:
            self.calibrate(cfg.num_speculative_tokens + 1)
            self._make_drafters(len(prompts))  # for rounds drafted here: loaded before the clock starts, as SpS's
            with pinned(self.target_device):
                yield from self._generate([list(p) for p in prompts], config, cfg, eos_token_ids, stop)
        finally:
            self._lock.release()

    def _generate(self, prompts: list[list[int]], config: SpecConfig, cfg: SpecConfig, eos: frozenset[int],
                  stop: threading.Event | None) -> Iterator[SSDEvent]:
        start = time.perf_counter()
        worker_ok = True
        try:
            if not self.alive:
                info = self.start()
                yield WorkerEvent("started", f"draft worker {info.drafter} ({info.backend}) on {info.device}",
                                  self.devices())
            self._generation += 1
            self._send(StartRequest(prompts, int(cfg.seed), self._generation))
        except WorkerLost as err:
            worker_ok = False
            yield WorkerEvent("degraded", f"{err}; drafting synchronously in the target process", self.devices())
        observes = bool(self.info and self.info.needs_target_features)
        rows = []
        for i, (prompt, target) in enumerate(zip(prompts, self._make_targets(len(prompts)))):
            target.reset()
            target.reserve(len(prompt) + cfg.max_new_tokens)
            target.keep_hidden = observes
            row = _Row(target, list(prompt), UniformStream(int(cfg.seed) + i),
                       IncrementalDetokenizer(self.pair.tokenizer), commit=list(prompt), index=i)
            row.pending_logits = target.forward(prompt)
            if observes:
                row.hidden.append((0, target.last_hidden))
                row.unsent_hidden.append((0, target.last_hidden))
            rows.append(row)
        if not worker_ok:
            self._degrade(rows)
        prefill_seconds = time.perf_counter() - start
        first_target = rows[0].target
        yield StartEvent(sum(map(len, prompts)), prefill_seconds, first_target.name,
                         self.info.drafter if self.info else self.spec.kind, first_target.backend_label, self.devices())

        planner, ssd, trace = FanoutPlanner(), SSDMetrics(), ProjectionTrace(prefill_seconds)
        fills = [0, 0, 0, 0]  # rounds that looked a cache up; Σ budget used, Σ budget requested, Σ depth
        trace.prefill_full = prefill_seconds * self._full_machine_ratio(PREFILL_ROWS)
        previous, round_index, sent, cfg_dict = cfg, 0, None, None
        if worker_ok:
            worker_ok, sent, events = self._ask(rows, cfg, planner, ssd)
            yield from events
        while any(r.finished is None for r in rows):
            if stop is not None and stop.is_set():
                for r in rows:
                    r.finished = r.finished or "stopped"
                break
            round_start = time.perf_counter()
            if sent is not None:  # the settings the worker drafted this round's speculations with
                cfg, fanouts, backup = sent
            else:
                cfg = self._snapshot(config, previous)
                fanouts, backup = (), "sync"
            k = cfg.num_speculative_tokens
            spans: list[TimelineSpan] = []
            reply, builds, wait_seconds = None, [], 0.0
            if worker_ok and backup != LOCAL:
                try:
                    wait_start = time.perf_counter()
                    reply = self._receive(RoundReply, self.reply_timeout, builds)
                    wait_seconds = time.perf_counter() - wait_start
                    spans.append(TimelineSpan("wait", "waiting for the draft", wait_start - start,
                                              wait_start + wait_seconds - start))
                    spans.append(TimelineSpan("draft", "serve", reply.serve[0] - start, reply.serve[1] - start))
                except WorkerLost as err:
                    worker_ok, reply = False, None
                    yield WorkerEvent("degraded", f"{err}; finishing with synchronous drafting in the target process",
                                      self.devices())
                    self._degrade(rows)
            fill_seconds, budget_used, fill_depth, fill_cut, window = 0.0, 0, 0, False, None
            fill_note = LOCAL_NOTE if backup == LOCAL else ""
            for b in builds:
                spans.append(TimelineSpan("draft", f"cache fill ({b.branches} branches, depth {b.depth})",
                                          b.interval[0] - start, b.interval[1] - start))
                ssd.add_fill(b.interval[1] - b.interval[0])
                fill_seconds += b.interval[1] - b.interval[0]
                budget_used, fill_depth, fill_cut, window, fill_note = b.branches, b.depth, b.cut, b.window, b.note

            verified: list[tuple[int, _Row, _Verified, str, Key | None, SeqReply | None]] = []
            verify_seconds = verify_full = 0.0
            for i, row in enumerate(rows):
                if row.finished is not None:
                    continue
                item = reply.items[i] if reply is not None else None
                # Every served round after a sequence's first (or after a local one) is a lookup; a fill
                # cut to nothing is a miss.
                looked_up = item is not None and row.lookup is not None
                if item is not None:
                    proposal = (item.probs.proposal(list(item.tokens)) if item.probs is not None
                                else Proposal(list(item.tokens), _point_masses(item.tokens, self.pair.vocab_size)))
                    source = item.source
                    if looked_up:
                        planner.observe_lookup(_fanout_at(item.cache_fanouts, row.lookup[0], row.served_length),
                                               source == "cache")
                    row.served_length = len(item.tokens)
                else:  # drafted here: by choice (LOCAL), or the worker is gone
                    proposal, source = None, LOCAL if worker_ok and backup == LOCAL else "sync"
                    row.drafted_here = True
                # The draft time on the critical path is the wait for the reply (charged to the first row).
                lookup = row.lookup if looked_up else None
                v = self._verify(row, cfg, proposal, wait_seconds if not verified else 0.0, start, i, spans, eos)
                verify_seconds += v.verify_seconds
                verify_full += v.verify_seconds * self._full_machine_ratio(v.rows)
                planner.observe_round(v.num_accepted, len(v.proposal.tokens))
                verified.append((i, row, v, source, lookup, item))
            # The outcome is known: ask for the next speculation now, so that the worker serves it
            # while this process turns the round into events.
            asked_at, next_sent = time.perf_counter(), None
            if worker_ok and any(r.finished is None for r in rows):
                worker_ok, next_sent, events = self._ask(rows, config, planner, ssd, cfg)
                if not worker_ok:
                    self._degrade(rows)
                yield from events

            hits, sources, lookup_keys, lookup_texts, cache_keys, key_texts, emitted, seq_ids, events = (
                [], [], [], [], [], [], [], [], [])
            searched, depth, kept = (), 0, []
            if cfg is not previous or cfg_dict is None:  # a snapshot keeps its identity while nothing changed
                cfg_dict = cfg.as_dict()
            changes = cfg.changed_fields(previous) if round_index and cfg is not previous else ()
            for i, row, v, source, lookup, item in verified:
                events += self._events(row, i, cfg, cfg_dict, changes, v, round_index, round_start, start)
                ssd.add_row(source, lookup is not None, v.num_emitted)
                hits.append(source == "cache")
                seq_ids.append(i)
                sources.append(source)
                emitted.append(v.num_emitted)
                lookup_keys.append(lookup)
                lookup_texts.append(self._token_text(lookup[1]) if lookup is not None else "")
                keys = tuple(item.cache_keys) if item is not None else ()
                cache_keys.append(keys)
                key_texts.append(tuple(self._token_text(y) for _, y in keys))
                if item is not None:
                    searched, depth = searched or tuple(item.cache_fanouts), max(depth, item.cache_depth)
                    kept.append(item.first_kept)
            if any(k is not None for k in lookup_keys):
                fills = [fills[0] + 1, fills[1] + sum(searched), fills[2] + cfg.ssd_cache_budget, fills[3] + depth]
            missed = reply is not None and any(s != "cache" for s in sources)
            # A draft made here is the round's serve: on the critical path, with no message around it.
            drafted_here = sum(v.draft_seconds for _, _, v, _, _, _ in verified) if reply is None else 0.0
            serve = reply.serve[1] - reply.serve[0] if reply is not None else drafted_here
            ssd.add_round(verify_seconds, time.perf_counter() - round_start, serve if missed else None)
            trace.add(RoundTiming(
                emitted=sum(emitted), verify=verify_seconds, verify_full=verify_full,
                loop=max(asked_at - round_start - wait_seconds - verify_seconds - drafted_here, 0.0), serve=serve,
                message=max(wait_seconds - serve, 0.0) if reply is not None else 0.0, fill=fill_seconds))
            yield from events
            rates = ssd.rates()
            yield SSDRoundEvent(
                round_index=round_index, sequences=tuple(seq_ids), hits=tuple(hits), sources=tuple(sources),
                lookup_keys=tuple(lookup_keys), cache_keys=tuple(cache_keys), fanouts=searched,
                num_emitted=tuple(emitted), timeline=tuple(spans), hit_rate=rates["p_hit"],
                theoretical_speedup=ssd.theoretical_speedup(rates), measured_speedup=ssd.measured_speedup(),
                rates=rates | {"acceptance": planner.acceptance, "power_r": planner.power_r(cfg.ssd_power_r),
                                     "next_fanouts": next_sent[1] if next_sent else (), "backup": backup},
                backup=backup, cache_key_texts=tuple(key_texts), lookup_texts=tuple(lookup_texts),
                budget_requested=cfg.ssd_cache_budget, budget_used=sum(searched), cache_depth=depth,
                first_kept=tuple(kept),
                next_fill=(budget_used, fill_depth, fill_cut), fill_window_seconds=window, fill_note=fill_note,
                projected_tokens_per_s=trace.tokens_per_s(True), model_tokens_per_s=trace.tokens_per_s(False),
            )
            previous, sent = cfg, next_sent
            round_index += 1

        elapsed = time.perf_counter() - start
        looked = max(fills[0], 1)
        summary = (ssd.summary() | trace.summary()
                   | {"devices": self.devices(), "batch_size": len(rows), "worker_alive": worker_ok,
                      "mean_budget_used": fills[1] / looked, "mean_budget_requested": fills[2] / looked,
                      "mean_cache_depth": fills[3] / looked})
        for i, row in enumerate(rows):
            yield FinishEvent(row.finished or "max_new_tokens", row.detok.text(), tuple(row.generated),
                              row.metrics.summary(elapsed, prefill_seconds) | summary, sequence=i)

    @staticmethod
    def _snapshot(config: SpecConfig, previous: SpecConfig | None = None) -> SpecConfig:
        cfg = config.snapshot(previous)
        if cfg.method == "ar":
            raise ValueError("SSD cannot switch to 'ar' mid-generation; pick sps, tas or cactus")
        return cfg

    def _ask(self, rows: list[_Row], config: SpecConfig, planner: FanoutPlanner, ssd: SSDMetrics,
             previous: SpecConfig | None = None
             ) -> tuple[bool, tuple[SpecConfig, tuple[int, ...], str] | None, list[WorkerEvent]]:
        """Send the next round's request (the settings are read here, once per round: `previous`
        itself while nothing changed); or, where no fill could save a draft step, send nothing and
        draft here (`LOCAL`). It runs between the verification and the worker's serve, so it
        derives nothing it does not send (the rates only for the adaptive backup)."""
        cfg = self._snapshot(config, previous)
        k = cfg.num_speculative_tokens
        if self._drafts_here(cfg):
            return True, (cfg, (), LOCAL), []
        fanouts = tuple(planner.plan(cfg.ssd_fanout_mode, cfg.ssd_cache_budget, k, cfg.ssd_power_r))
        active = [r for r in rows if r.finished is None]
        backup = resolve_backup(cfg.ssd_backup, len(active), ssd.rates() if cfg.ssd_backup == "adaptive" else {})
        after_local = any(r.drafted_here for r in active)
        items = [self._request(r, cfg) if r.finished is None else None for r in rows]
        try:
            self._send(RoundRequest(k, cfg.sampling, fanouts, float(cfg.downweight_c), backup, self.pair.vocab_size,
                                    items, time.perf_counter(), self.fill_to_verify, after_local))
        except WorkerLost as err:
            return False, None, [WorkerEvent("degraded", f"{err}; finishing with synchronous drafting in the target "
                                             "process", self.devices())]
        return True, (cfg, fanouts, backup), []

    def _full_machine_ratio(self, rows: int) -> float:
        """Target forward time on all of this process's cores / on the target's own (measured once per row count)."""
        known = [n for n in self._calibration if n <= rows]
        return self._calibration[max(known)] if known else 1.0

    def calibrate(self, max_rows: int) -> None:
        """Time the target's forward of 1..max_rows rows (and a prefill) pinned and on every core, side by side."""
        wanted = [n for n in (*range(1, max_rows + 1), PREFILL_ROWS) if n not in self._calibration]
        if not wanted:
            return
        target = self._make_targets(1)[0]
        prompt = [int(t) % self.pair.vocab_size for t in range(1, PREFILL_ROWS + 1)]
        for n in wanted:
            times = {}
            for where in ("pinned", "full"):
                with (pinned(self.target_device) if where == "pinned" else contextlib.nullcontext()):
                    runs = []
                    for _ in range(CALIBRATION_RUNS + 1):  # the first run warms the thread pool up, untimed
                        target.reset()
                        target.forward(prompt[:8])
                        started = time.perf_counter()
                        target.forward(prompt[:n])
                        runs.append(time.perf_counter() - started)
                    times[where] = statistics.median(runs[1:])
            self._calibration[n] = times["full"] / times["pinned"]
        target.reset()

    def _request(self, row: _Row, cfg: SpecConfig) -> SeqRequest:
        hidden_start, hidden = 0, None
        if row.unsent_hidden:
            hidden_start = row.unsent_hidden[0][0]
            parts = [h for _, h in row.unsent_hidden]  # usually one round's rows: no concatenation
            hidden = (parts[0] if len(parts) == 1 else torch.cat(parts)).to("cpu", torch.float32).numpy()
            row.unsent_hidden = []
        # The draft's draws come next in the sequence's stream, as in SpS: the worker takes them from
        # its copy, this process passes over them (_verify), and the rule reads the ones after.
        row.reserved = max(min(cfg.num_speculative_tokens, cfg.max_new_tokens - len(row.generated) - 1), 0)
        # After a round drafted here the worker's cache answers a speculation it did not serve: no lookup.
        row.lookup = None if row.drafted_here else row.outcome
        request = SeqRequest(row.commit, row.lookup, hidden_start, hidden, row.uniforms.position, row.reserved)
        row.commit, row.drafted_here = [], False
        return request

    def _degrade(self, rows: list[_Row]) -> None:
        """The worker is gone: every row drafts here from now on."""
        for row in rows:
            row.degraded = True
            self._local_drafter(row)

    def _local_drafter(self, row: _Row) -> Drafter:
        """The row's drafter in this process, brought up to date with every target feature seen so far.

        A worker lost before it reported in never said its draft reads target features, so none were
        kept: that can only happen before the first round, and the prompt is then prefilled again
        with its features (the same logits: the target is deterministic).
        """
        if row.local_drafter is None:
            row.local_drafter = self._make_drafters(row.index + 1)[row.index]
            row.local_drafter.start()
            if row.local_drafter.needs_target_features and not row.hidden:
                row.target.keep_hidden = True
                row.target.reset()
                row.pending_logits = row.target.forward(row.context)
                row.hidden.append((0, row.target.last_hidden))
        if row.local_drafter.needs_target_features:
            for start, hidden in row.hidden[row.local_seen:]:
                row.local_drafter.observe_target(start, hidden)
            row.local_seen = len(row.hidden)
        return row.local_drafter

    def _verify(self, row: _Row, cfg: SpecConfig, proposal: Proposal | None, wait_seconds: float, start: float,
                sequence: int, spans: list[TimelineSpan], eos: frozenset[int]) -> _Verified:
        """Verify one sequence's speculation with the target and commit the outcome (the events come later)."""
        params = cfg.sampling
        remaining = cfg.max_new_tokens - len(row.generated)
        k = min(cfg.num_speculative_tokens, remaining - 1)
        vocab = row.target.vocab_size
        draft_before = time.perf_counter()
        if proposal is None:  # drafted here (LOCAL, or the worker is gone)
            proposal = Proposal([], torch.empty(0, vocab))
            if k > 0:
                proposal = self._local_drafter(row).propose(row.context, k, params, row.uniforms.take_floats(k))
        else:
            row.uniforms.take(row.reserved)  # the worker drew its draft's uniforms from these
        proposal = proposal.prefix(max(k, 0))
        draft_seconds = wait_seconds + time.perf_counter() - draft_before

        verify_start, forward_before = time.perf_counter(), row.target.forward_seconds
        fed_from = row.target.length
        feed = ([] if row.pending_logits is not None else [row.context[-1]]) + proposal.tokens
        if row.rule_settings is not cfg:
            row.rule_settings, row.rule = cfg, round_rule(cfg, vocab)
        target_probs, proposal, result, _ = verify_round(
            row.target, feed, row.pending_logits, proposal, cfg, params,
            RandomDraws.take(row.uniforms, len(proposal.tokens)), row.rule)
        row.pending_logits = None
        num_accepted = result.accepted_count
        row.target.rollback(len(row.context) + num_accepted)
        if row.target.keep_hidden and feed:
            hidden = (fed_from, row.target.last_hidden[: row.target.length - fed_from])
            row.hidden.append(hidden)
            if not row.degraded:
                row.unsent_hidden.append(hidden)
        verify_end = time.perf_counter()
        spans.append(TimelineSpan("target", f"verify seq {sequence}", verify_start - start, verify_end - start))

        new_tokens = proposal.tokens[:num_accepted] + [result.next_token]
        for j, token in enumerate(new_tokens):
            if token in eos:
                new_tokens, row.finished = new_tokens[: j + 1], "eos"
                break
        first_index = len(row.generated)
        row.outcome = (num_accepted, new_tokens[-1])
        row.commit.extend(new_tokens)
        row.context.extend(new_tokens)
        row.generated.extend(new_tokens)
        if row.finished is None and len(row.generated) >= cfg.max_new_tokens:
            row.finished = "max_new_tokens"
        return _Verified(target_probs, proposal, result, num_accepted, new_tokens, first_index, len(feed),
                         draft_seconds, row.target.forward_seconds - forward_before, bool(feed))

    def _events(self, row: _Row, sequence: int, cfg: SpecConfig, cfg_dict: dict, changes: tuple[str, ...],
                v: _Verified, round_index: int, round_start: float, start: float) -> list[TokenEvent | RoundEvent]:
        """The round's token events and RoundEvent (the same round as engine.decoding)."""
        k, num_accepted, new_tokens = len(v.proposal.tokens), v.num_accepted, v.new_tokens
        token_events = _token_events(cfg, v.result, v.target_probs, v.proposal, new_tokens, num_accepted,
                                     v.first_index, round_index, row.detok, self.pair.tokenizer, sequence)
        rejected = v.proposal.tokens[num_accepted] if num_accepted < k else None
        counted = min(k, len(new_tokens)) if row.finished == "eos" and len(new_tokens) <= num_accepted else k
        event = RoundEvent(
            round_index=round_index, method=cfg.method, num_speculative_tokens=cfg.num_speculative_tokens,
            num_draft_tokens=counted, draft_token_ids=tuple(v.proposal.tokens[:counted]),
            num_accepted=min(num_accepted, counted), num_emitted=len(new_tokens),
            accepted_positions=tuple(v.result.passed[:counted]),
            rejected_token_id=rejected,
            constraint_kl=sum(e.constraint_kl for e in token_events), draft_seconds=v.draft_seconds,
            verify_seconds=v.verify_seconds, target_forwards=int(v.fed),
            round_seconds=time.perf_counter() - round_start, elapsed_seconds=time.perf_counter() - start,
            config=cfg_dict, config_changes=changes,
            sequence=sequence, details=token_events[0].details,
        )
        row.metrics.add_round(event)
        return token_events + [event]


@dataclass
class _Verified:
    """One sequence's verified round, kept until its events are built (after the next request is sent)."""

    target_probs: TargetRows
    proposal: Proposal
    result: VerifyResult
    num_accepted: int
    new_tokens: list[int]
    first_index: int  # index of the round's first new token in the generation
    rows: int  # tokens the target verified (its forward's row count)
    draft_seconds: float
    verify_seconds: float  # the target's forward, as engine.decoding counts it (the rule is overhead)
    fed: bool

    @property
    def num_emitted(self) -> int:
        return len(self.new_tokens)


def _point_masses(tokens: Sequence[int], vocab: int) -> torch.Tensor:
    """One-hot rows: the D' of greedy drafts and of random / prompt-lookup backups."""
    probs = torch.zeros(len(tokens), vocab)
    if tokens:
        probs[torch.arange(len(tokens)), torch.tensor(list(tokens))] = 1.0
    return probs


def _fanout_at(fanouts: Sequence[int], k: int, served: int) -> int:
    """F of the cache depth the true outcome fell on (the bonus depth uses the last entry)."""
    if not fanouts:
        return 0
    return fanouts[k] if k < served and k < len(fanouts) else fanouts[-1]


def _device(value: str | DeviceSpec | None, fallback: DeviceSpec) -> DeviceSpec:
    if isinstance(value, DeviceSpec):
        return value
    return parse_device(value) if value else fallback

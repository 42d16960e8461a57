"""The engine's own thread: every torch and kernel call of the playground runs on it.

Why one thread (measured, issue 17): libgomp gives each OS thread that opens a parallel region its
own OpenMP team. Once two teams exist (e.g. the main thread's from loading and a Gradio worker's
from a generation) libgomp manages more threads than there are CPUs and switches every team to its
"throttled" spin count (100 spins instead of 300,000), so the team's idle thread sleeps in a futex
between the decoder's many small parallel regions and each region pays a wake-up. On 2 cores that
halved the engine's speed inside Gradio. With one thread owning every call there is one team.
The native kernels have had threads of their own since session 37 (engine/models/work_pool.h, which
no preempted thread holds up), but torch's ops (loading, the transformers backend, the fallbacks)
still open OpenMP teams, so one thread still owns them all.
The SSD engine has a thread of its own (it pins it), so each loop's thread lives only while it has
work: a thread that exits takes its team with it. An idle SSD thread kept alive after one SSD run
held every later synchronous run at 0.55x its speed (AMD EPYC Zen 4, 2 cores; an idle second team
took a default-pair forward from 6.7 to 17.6 ms, and its thread's exit gave 8.1 ms back).

Runs are generators of engine events, interleaved round by round (a run gives the thread back after
each `RoundEvent`), so concurrent sessions share the thread fairly and a run can be paused, stepped
and stopped exactly at a round boundary. The engine thread only appends events to the run's list;
the UI folds them into a `RunState` on its own threads (`RunHandle.state`), at the rate it draws.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from engine.events import FinishEvent, RoundEvent
from playground.state import RunState, reduce

PARKED_POLL_SECONDS = 0.25  # how often the thread re-checks deadlines while every run is paused


@dataclass
class RunHandle:
    """One run on the engine loop: its events so far, its controls, and the UI's folded view of them."""

    make_events: Callable[[], Iterator]  # called on the engine thread: the engine generator
    run: RunState
    deadline: float  # time.monotonic() after which the loop stops the run
    time_limit_note: str = "time limit reached; stopped"
    on_finish: Callable[["RunHandle"], None] | None = None  # called on the engine thread after the last event
    stop: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    events: list = field(default_factory=list)  # appended by the engine thread only
    error: str = ""
    paused: bool = False
    steps: int = 0  # rounds still allowed while paused (Step)
    parked: bool = False  # paused and waiting at a round boundary right now
    paused_seconds: float = 0.0
    max_concurrent: int = 1  # most runs that took turns on the engine thread with this one, itself included
    rounds_done: int = 0
    _iterator: Iterator | None = None
    _parked_at: float | None = None
    _folded: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _changed: threading.Condition = field(default_factory=threading.Condition)

    @property
    def runnable(self) -> bool:
        return not self.done.is_set() and (self.stop.is_set() or not self.paused or self.steps > 0)

    def state(self) -> RunState:
        """Fold the events the engine appended since the last call into `run` (any UI thread)."""
        with self._lock:
            events = self.events[self._folded:len(self.events)]
            for event in events:
                reduce(self.run, event)
            self._folded += len(events)
            if self.done.is_set() and self._folded == len(self.events):
                if self.error and not self.run.error:
                    self.run.error = self.error
            self.run.paused = self.parked
            self.run.paused_seconds = self.paused_seconds
            self.run.max_concurrent = self.max_concurrent
            return self.run

    def wait(self, condition: Callable[["RunHandle"], bool], timeout: float) -> bool:
        """Block until `condition(self)` holds (re-checked at every round boundary) or `timeout` passes."""
        with self._changed:
            return self._changed.wait_for(lambda: condition(self), timeout)

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()


class EngineLoop:
    """The one engine thread: runs submitted calls (loading, warm-up) and interleaves runs by round.
    The thread starts with the first call or run and exits once it has neither (see the module doc)."""

    def __init__(self, name: str = "specplay-engine") -> None:
        self._calls: deque[tuple[Callable[[], Any], Future]] = deque()
        self._runs: list[RunHandle] = []
        self._wake = threading.Condition()
        self._name = name
        self._thread: threading.Thread | None = None

    def _ensure_thread(self) -> None:
        """(with self._wake held) A serving thread, started if the last one exited."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
            self._thread.start()

    @property
    def active_runs(self) -> int:
        return len(self._runs)

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run `fn(*args, **kwargs)` on the engine thread and return its result (or raise its error)."""
        if threading.current_thread() is self._thread:
            return fn(*args, **kwargs)
        future: Future = Future()
        with self._wake:
            self._calls.append((lambda: fn(*args, **kwargs), future))
            self._ensure_thread()
            self._wake.notify()
        return future.result()

    def start(self, handle: RunHandle) -> RunHandle:
        with self._wake:
            self._runs.append(handle)
            self._ensure_thread()
            self._wake.notify()
        return handle

    def pause(self, handle: RunHandle) -> None:
        """Park the run at its next round boundary (a run already paused keeps the step it was given)."""
        with self._wake:
            if not handle.paused:
                handle.paused, handle.steps = True, 0

    def step(self, handle: RunHandle) -> None:
        """Let a paused run do exactly one more round, then park again."""
        with self._wake:
            handle.steps += 1
            self._wake.notify()

    def resume(self, handle: RunHandle) -> None:
        with self._wake:
            handle.paused, handle.steps = False, 0
            self._wake.notify()

    def stop(self, handle: RunHandle) -> None:
        """Stop at the next round boundary; wakes a paused run so it can finish."""
        with self._wake:
            handle.stop.set()
            self._wake.notify()

    def _serve(self) -> None:
        turn = 0
        while True:
            with self._wake:
                while self._runs and not self._calls and not any(r.runnable for r in self._runs):
                    self._wake.wait(PARKED_POLL_SECONDS)  # every run is parked
                    self._check_deadlines()
                if not self._calls and not self._runs:
                    self._thread = None  # nothing left: exit, and free this thread's OpenMP team
                    return
                call = self._calls.popleft() if self._calls else None
                runnable = [r for r in self._runs if r.runnable]
            if call is not None:
                fn, future = call
                try:
                    future.set_result(fn())
                except BaseException as err:  # handed to the caller, who re-raises it
                    future.set_exception(err)
                continue
            if runnable:
                handle = runnable[turn % len(runnable)]
                turn += 1
                # Parked runs (a Learn-tab round, a paused run) take no turns, so they do not count.
                handle.max_concurrent = max(handle.max_concurrent, len(runnable))
                self._advance(handle)

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for handle in self._runs:
            if now > handle.deadline and not handle.stop.is_set():
                handle.error = handle.error or handle.time_limit_note
                handle.stop.set()

    def _advance(self, handle: RunHandle) -> None:
        """One round of `handle` (from the prefill on its first turn): pull events up to a RoundEvent."""
        if handle._parked_at is not None:
            handle.paused_seconds += time.monotonic() - handle._parked_at
            handle._parked_at, handle.parked = None, False
        try:
            if handle._iterator is None:
                handle._iterator = iter(handle.make_events())
            for event in handle._iterator:
                handle.events.append(event)
                if isinstance(event, RoundEvent):
                    break
            else:
                self._finish(handle)
                return
        except Exception as err:  # noqa: BLE001 - a bad setting or a lost worker ends this run, not the thread
            handle.error = str(err) or type(err).__name__
            self._finish(handle)
            return
        handle.rounds_done += 1
        self._check_deadlines()
        with self._wake:
            if handle.paused and not handle.stop.is_set():
                if handle.steps > 0:
                    handle.steps -= 1
                if handle.steps == 0:
                    handle.parked, handle._parked_at = True, time.monotonic()
        handle._notify()

    def _finish(self, handle: RunHandle) -> None:
        with self._wake:
            self._runs.remove(handle)
        handle.parked = False
        if handle.on_finish is not None:
            try:
                handle.on_finish(handle)
            except Exception as err:  # noqa: BLE001
                handle.error = handle.error or str(err)
        handle.done.set()
        handle._notify()


def finished_event(handle: RunHandle) -> FinishEvent | None:
    """The run's FinishEvent, if the engine got that far."""
    last = handle.events[-1] if handle.events else None
    return last if isinstance(last, FinishEvent) else None

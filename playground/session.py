"""Per-browser-session state, keyed by Gradio's `session_hash`.

A running generator only sees the input values it was called with, so live tuning needs a mutable
object both the generation and the slider handlers can reach: each session's `control` SpecConfig
is what the engine snapshots every round. Sessions never share objects, which is what keeps
concurrent users from seeing each other's runs.
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass, field

from engine.config import SpecConfig
from playground.engine_loop import RunHandle
from playground.limits import MAX_SSD_BUDGET
from playground.state import RunState

SESSION_TTL_SECONDS = 3600.0
LIVE_FIELDS = ("delta", "num_speculative_tokens", "temperature", "top_p", "top_k",
               "posterior_threshold", "posterior_alpha",
               "ssd_fanout_mode", "ssd_budget", "downweight_c", "ssd_backup")  # SSD reads these every round too


@dataclass
class Session:
    control: SpecConfig = field(default_factory=SpecConfig)  # read by the engine at every round
    handle: RunHandle | None = None  # the Generate tab's current run on its engine thread
    handle_ssd: bool = False  # whether `handle` runs on the SSD thread
    pause_next: bool = False  # Pause pressed with no run going: the next run parks after its first round
    ar_reference: object | None = None  # runner.ARReference from this session's own AR runs
    ar_speeds: list[float] = field(default_factory=list)  # their decode tok/s, oldest first (runner.add_ar_run)
    ar_reference_run: bool = False  # the page already ran its one AR reference run (runner.wants_ar_reference_run)
    run: RunState = field(default_factory=RunState)
    rendered_version: tuple | None = None  # (RunState.version, streaming) the browser last got charts for
    chart_turn: int = 0  # which live chart the next streaming tick redraws (one per tick)
    tutor: RunHandle | None = None  # the Learn tab's paused run on the engine thread
    tutor_state: RunState = field(default_factory=RunState)
    tutor_stage: int = 0
    tutor_round: int = -1
    tutor_lock: threading.Lock = field(default_factory=threading.Lock)
    job_stop: threading.Event = field(default_factory=threading.Event)  # Compare / Sweep Stop
    last_seen: float = field(default_factory=time.monotonic)


class SessionStore:
    """Thread-safe map session_hash → Session, pruned after an hour without activity."""

    def __init__(self, ttl_seconds: float = SESSION_TTL_SECONDS) -> None:
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self.ttl_seconds = ttl_seconds

    def get(self, session_hash: str | None) -> Session:
        key = session_hash or "anonymous"
        now = time.monotonic()
        with self._lock:
            self._prune(now)
            session = self._sessions.get(key)
            if session is None:
                session = self._sessions[key] = Session()
            session.last_seen = now
            return session

    def drop(self, session_hash: str | None) -> None:
        """On disconnect: stop whatever the session still runs, then forget it."""
        with self._lock:
            session = self._sessions.pop(session_hash or "anonymous", None)
        if session is not None:
            if session.handle is not None:
                session.handle.stop.set()  # the engine thread finishes it at its next turn
            if session.tutor is not None:
                session.tutor.stop.set()
            session.job_stop.set()

    def __len__(self) -> int:
        return len(self._sessions)

    def _prune(self, now: float) -> None:
        for key in [k for k, s in self._sessions.items() if now - s.last_seen > self.ttl_seconds and not s.run.running]:
            del self._sessions[key]


def apply_live_change(control: SpecConfig, name: str, value: float, max_k: int) -> SpecConfig:
    """Write one live-tunable field into `control`, validating a copy first.

    The engine raises at its next snapshot if the control object is invalid, so a bad value must
    never reach it: ValueError here, and `control` is left untouched.
    """
    if name not in LIVE_FIELDS:
        raise ValueError(f"{name} cannot change during a generation")
    if name in ("ssd_fanout_mode", "ssd_backup"):
        value = str(value)
    elif name in ("num_speculative_tokens", "top_k", "ssd_budget"):
        if value is None or float(value) != int(float(value)):
            raise ValueError(f"{name} must be a whole number, got {value!r}")
        value = int(float(value))
        if name == "num_speculative_tokens" and not 1 <= value <= max_k:
            raise ValueError(f"K must be between 1 and {max_k}")
        if name == "ssd_budget" and not 1 <= value <= MAX_SSD_BUDGET:
            raise ValueError(f"the SSD budget B must be between 1 and {MAX_SSD_BUDGET}")
    else:
        value = float(value)
    candidate = copy.copy(control)
    setattr(candidate, name, value)
    candidate.validate()
    setattr(control, name, value)
    return control

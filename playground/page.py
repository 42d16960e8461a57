"""What every tab's wiring shares: the context, the caller's session, validated settings."""

from __future__ import annotations

from dataclasses import dataclass

import gradio as gr

from engine.config import SpecConfig
from playground.limits import build_config, check_prompt_tokens
from playground.runner import PlaygroundContext
from playground.session import Session

ENGINE_QUEUE = "engine"  # engine jobs of every tab share one concurrency id (ECOSYSTEM.md §3-4)
HANG_GUARD_SECONDS = 120.0  # a control endpoint waiting on the engine gives up after this (never expected)


@dataclass
class Page:
    ctx: PlaygroundContext

    @property
    def limits(self):
        return self.ctx.limits

    def session(self, request: gr.Request | None) -> Session:
        return self.ctx.sessions.get(getattr(request, "session_hash", None))

    def encode(self, prompt: str) -> list[int]:
        return check_prompt_tokens(self.limits, self.ctx.pair.encode_prompt(prompt))

    def validated(self, prompt: str, **settings) -> tuple[SpecConfig, list[int]]:
        """Settings and prompt checked together; a bad value is a readable gr.Error, never a traceback."""
        try:
            return build_config(self.limits, **settings), self.encode(prompt)
        except ValueError as err:
            raise gr.Error(str(err), print_exception=False) from None

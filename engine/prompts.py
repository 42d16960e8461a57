"""The held-out prompt set (`assets/prompts.json`) shared by the benchmark and the playground."""

from __future__ import annotations

import json
from pathlib import Path

PROMPTS_FILE = Path(__file__).resolve().parent.parent / "assets" / "prompts.json"


def held_out_prompts(n: int | None = None) -> list[str]:
    prompts = [p["text"] for p in json.loads(PROMPTS_FILE.read_text())["prompts"]]
    return prompts if n is None else prompts[:n]

"""Fixtures of the plugin's tests: run in the plugin venv (integrations/vllm/install.sh).

Every vLLM engine runs in a subprocess through `specplay_vllm.runner`, one per engine, with all of
its jobs at once; an engine start costs ~30 s on 2 cores, a job a few seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

from engine.models.embedded import embedded_target_dir
from engine.peers.vllm_peer import exported_draft_dir
from specplay_vllm.export_draft import export_draft

K = 2


@lru_cache(maxsize=None)
def draft_dir(head: str) -> Path:
    return export_draft(exported_draft_dir(head), head)


def run_engine(jobs: list[dict], tmp: Path, draft: Path | None, k: int = K) -> list[dict]:
    out = tmp / "results.json"
    cmd = [sys.executable, "-m", "specplay_vllm.runner", "--target", str(embedded_target_dir()), "--k", str(k),
           "--out", str(out)] + (["--draft", str(draft)] if draft else [])
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0-1")}
    proc = subprocess.run(cmd, input=json.dumps(jobs), text=True, capture_output=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise AssertionError(f"runner failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())["results"]


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_target_dir())


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False))

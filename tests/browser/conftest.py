"""Playground servers for the live tests (API, load, browser), each started once per test session:
the tiny pair for most tests, the default pair (SmolLM2-135M) only for the `slow` tests that ask for it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "artifacts"
STARTUP_SECONDS = 180


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(pair: str, log_name: str) -> Iterator[str]:
    """Start `python app.py --pair <pair> --devices cpu` on a free port; yield its URL; kill it afterwards."""
    port = _free_port()
    ARTIFACTS.mkdir(exist_ok=True)
    log_path = ARTIFACTS / log_name
    log = open(log_path, "w")
    env = dict(os.environ, PYTHONUNBUFFERED="1", GRADIO_ANALYTICS_ENABLED="False")
    proc = subprocess.Popen([sys.executable, "app.py", "--pair", pair, "--host", "127.0.0.1", "--port", str(port),
                             "--devices", "cpu"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_SECONDS
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"playground exited with {proc.returncode}; see {log_path}")
            try:
                with urllib.request.urlopen(url + "/", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"playground did not start in time; see {log_path}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture(scope="session")
def playground_url() -> Iterator[str]:
    """The playground on the tiny pair."""
    yield from _serve("tiny", "playground-server.log")


@pytest.fixture(scope="session")
def default_playground_url() -> Iterator[str]:
    """The playground on the default pair, as deployed (only the `slow` tests that need it start it)."""
    yield from _serve("default", "playground-server-default.log")

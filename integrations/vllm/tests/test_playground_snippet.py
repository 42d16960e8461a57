"""The playground's vLLM panel shows a script; run exactly that script in the plugin venv."""

from __future__ import annotations

import os
import subprocess
import sys

from engine.config import SpecConfig
from playground.vllm_config import speculative_config_text


def test_the_panel_script_runs_cactus_with_the_exported_draft(tmp_path):
    cfg = SpecConfig(method="cactus", num_speculative_tokens=2, delta=0.5, temperature=0.6, top_p=0.95, top_k=20,
                     max_new_tokens=12)
    script = tmp_path / "panel.py"
    script.write_text(speculative_config_text(cfg, "HuggingFaceTB/SmolLM2-135M-Instruct", "feature draft", "eagle"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECPLAY_VLLM_")}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = proc.stdout + proc.stderr
    assert "specplay" in logs and "eagle" in logs.lower()  # the plugin loaded, the EAGLE draft ran
    assert proc.stdout.strip()  # the generated text

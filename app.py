"""Entry point: `python app.py [--pair tiny|default] [--host H] [--port P]` opens the playground.

`--cli` keeps the terminal preview: one generation streamed with each token coloured by status.
"""

from __future__ import annotations

import argparse
import os
import sys

from engine.cli import add_spec_arguments, spec_config_from_args
from engine.config import DECODE_METHODS
from engine.decoding import generate
from engine.events import FinishEvent, StartEvent, TokenEvent
from engine.metrics import DivergenceTally
from engine.models.fast_llama import WEIGHT_DTYPES
from engine.models.registry import DEFAULT_FAST_WEIGHTS, DRAFTER_KINDS, load_pair
from playground.limits import ALLOWED_PAIRS, Limits, check_pair

COLOURS = {"accepted": "\033[32m", "recovered": "\033[33m", "bonus": "\033[34m", "generated": ""}
RESET = "\033[0m"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default="default", choices=ALLOWED_PAIRS, help="model pair (allow-list)")
    ap.add_argument("--host", default=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"))
    ap.add_argument("--port", type=int, default=int(os.environ.get("GRADIO_SERVER_PORT", "7860")))
    ap.add_argument("--devices", default="auto", choices=("auto", "cpu"),
                    help="auto: target cuda:0 and draft cuda:1 when two GPUs are present")
    ap.add_argument("--ssd-devices", default="", help="SSD method: target=<dev>,draft=<dev> (cpu:N, cpu:N-M, cuda:N; "
                    "default: the draft gets the last core)")
    ap.add_argument("--concurrency", type=int, default=None, help="engine jobs at once (default: Limits)")
    ap.add_argument("--drafter", default="model", choices=DRAFTER_KINDS)
    ap.add_argument("--weights", default=DEFAULT_FAST_WEIGHTS, choices=WEIGHT_DTYPES,
                    help="weight format of the fast CPU backend (default q4_1_a16: the GGUF's own blocks on int16 "
                    "activations; q4_1: the same blocks, float32's logits bit for bit), see assets/FAST_BACKEND.md")
    ap.add_argument("--cli", action="store_true", help="terminal preview instead of the browser playground")
    ap.add_argument("--method", default="sps", choices=DECODE_METHODS, help="--cli only")
    ap.add_argument("--prompt", default="Write a short poem about the sea.", help="--cli only")
    add_spec_arguments(ap, temperature=0.6, top_p=0.95, top_k=20, max_new_tokens=96)  # --cli only
    return ap.parse_args(argv)


def run_cli(args: argparse.Namespace) -> int:
    cfg = spec_config_from_args(args, method=args.method)
    cfg.validate()
    pair = load_pair(args.pair)
    drafter = None if args.method == "ar" else pair.make_drafter(args.drafter, weight_dtype=args.weights)
    colour = sys.stdout.isatty()
    print("Legend: " + " ".join(f"{COLOURS[s] if colour else ''}{s}{RESET if colour else ''}"
                                for s in ("accepted", "recovered", "bonus")) + "\n")
    target = pair.make_target(weight_dtype=args.weights)
    divergence = DivergenceTally()
    for event in generate(target, drafter, pair.tokenizer, pair.encode_prompt(args.prompt), cfg,
                          eos_token_ids=pair.eos_token_ids):
        if isinstance(event, StartEvent):
            print(f"[{event.target} | draft: {event.drafter} | {event.devices} | {event.prompt_tokens} "
                  f"prompt tokens, prefill {event.prefill_seconds * 1e3:.0f} ms]\n")
        elif isinstance(event, TokenEvent):
            print(f"{COLOURS[event.status]}{event.text}{RESET}" if colour else event.text, end="", flush=True)
            divergence.add(event)
        elif isinstance(event, FinishEvent):
            m = event.metrics
            induced = divergence.summary()["mean_induced_kl"]
            print(f"\n\n[{event.reason}] {m['new_tokens']} tokens, {m['tokens_per_s']:.1f} tok/s, "
                  f"mean acceptance length {m['mean_acceptance_length'] or 1:.2f}, "
                  f"draft acceptance {m['draft_acceptance_rate'] or 0:.2f}, "
                  f"KL(induced ‖ target) {induced or 0.0:.4f} nats per tested position")
    return 0


def run_playground(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from playground.app import launch
    from playground.devices import place_pair
    from playground.engine_loop import EngineLoop
    from playground.limits import DEFAULT_PROMPT, DEFAULT_SETTINGS, build_config
    from playground.runner import PlaygroundContext, measure_ar_reference

    from engine.ssd.devices import parse_devices

    if args.ssd_devices:
        parse_devices(args.ssd_devices)  # a bad spec is a clear error now, not on the first SSD request
    # Loading runs on the engine thread too: a parallel region opened by any other thread would
    # give the process a second OpenMP team and halve the engine's speed (playground/engine_loop.py).
    engine = EngineLoop()
    pair = engine.call(load_pair, check_pair(args.pair))
    devices = engine.call(place_pair, pair, args.devices)
    limits = Limits.for_device(gpu=devices.startswith("target cuda"))
    if args.concurrency:
        limits = replace(limits, concurrency=args.concurrency)
    ctx = PlaygroundContext(pair_name=args.pair, pair=pair, limits=limits, drafter_kind=args.drafter, devices=devices,
                            ssd_devices=args.ssd_devices, weight_dtype=args.weights, engine=engine)
    print(f"specplay: pair {args.pair} on {devices}; measuring the AR reference…", flush=True)
    settings = {**DEFAULT_SETTINGS, "method": "ar", "k": 1}
    reference = measure_ar_reference(ctx, pair.encode_prompt(DEFAULT_PROMPT), build_config(limits, **settings))
    print(f"specplay: {reference.how}", flush=True)
    launch(ctx, args.host, args.port)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run_cli(args) if args.cli else run_playground(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

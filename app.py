"""Entry point: `python app.py [--pair tiny|default] [--method ...] [--prompt ...]`.

The browser playground is not built yet; until it lands, this streams one generation in the
terminal, each token coloured by its verification status, followed by the run's metrics. It uses
the same engine event stream the playground will consume.
"""

from __future__ import annotations

import argparse
import sys

from engine.config import DECODE_METHODS, SpecConfig
from engine.decoding import generate
from engine.events import FinishEvent, RoundEvent, StartEvent, TokenEvent
from engine.models.registry import DRAFTER_KINDS, PAIRS, load_pair

COLOURS = {"accepted": "\033[32m", "recovered": "\033[33m", "bonus": "\033[34m", "generated": ""}
RESET = "\033[0m"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default="default", choices=PAIRS)
    ap.add_argument("--drafter", default="model", choices=DRAFTER_KINDS)
    ap.add_argument("--method", default="sps", choices=DECODE_METHODS)
    ap.add_argument("--prompt", default="Write a short poem about the sea.")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--delta", type=float, default=1.0)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    cfg = SpecConfig(method=args.method, num_speculative_tokens=args.k, delta=args.delta,
                     temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                     max_new_tokens=args.max_new_tokens, seed=args.seed)
    try:
        cfg.validate()
        pair = load_pair(args.pair)
        prompt_ids = pair.encode_prompt(args.prompt)
        drafter = None if args.method == "ar" else pair.make_drafter(args.drafter)
        colour = sys.stdout.isatty()
        print("The browser playground is coming; this is a terminal preview of the same event stream.")
        print("Legend: " + " ".join(f"{COLOURS[s] if colour else ''}{s}{RESET if colour else ''}"
                                    for s in ("accepted", "recovered", "bonus")) + "\n")
        for event in generate(pair.make_target(), drafter, pair.tokenizer, prompt_ids, cfg,
                              eos_token_ids=pair.eos_token_ids):
            if isinstance(event, StartEvent):
                print(f"[{event.target} | draft: {event.drafter} | {event.devices} | {event.prompt_tokens} "
                      f"prompt tokens, prefill {event.prefill_seconds * 1e3:.0f} ms]\n")
            elif isinstance(event, TokenEvent):
                text = f"{COLOURS[event.status]}{event.text}{RESET}" if colour else event.text
                print(text, end="", flush=True)
            elif isinstance(event, RoundEvent):
                continue
            elif isinstance(event, FinishEvent):
                m = event.metrics
                print(f"\n\n[{event.reason}] {m['new_tokens']} tokens, {m['tokens_per_s']:.1f} tok/s, "
                      f"mean acceptance length {m['mean_acceptance_length'] or 1:.2f}, "
                      f"draft acceptance {m['draft_acceptance_rate'] or 0:.2f}, "
                      f"KL/token {m['mean_kl_per_token']:.3f} nats")
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

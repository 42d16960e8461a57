"""Command-line flags for a `SpecConfig`, shared by the benchmark and the app's terminal preview."""

from __future__ import annotations

import argparse

from engine.config import SpecConfig


def add_spec_arguments(ap: argparse.ArgumentParser, *, temperature: float = 0.6, top_p: float = 1.0,
                       top_k: int = 0, max_new_tokens: int = 64, k_sweep: bool = False) -> None:
    """`k_sweep` lets `--k` take a comma list (the benchmark runs every drafting method at each K)."""
    if k_sweep:
        ap.add_argument("--k", type=_k_list, default=None,
                        help="K: draft tokens per round; a comma list sweeps K (default: the pair's recommended K)")
    else:
        ap.add_argument("--k", type=int, default=4, help="K: draft tokens per round")
    ap.add_argument("--delta", type=float, default=1.0, help="Cactus KL budget δ (nats; 0 = SpS)")
    ap.add_argument("--posterior-threshold", type=float, default=0.09, help="TAS ε")
    ap.add_argument("--posterior-alpha", type=float, default=0.3, help="TAS α")
    ap.add_argument("--temperature", type=float, default=temperature, help=f"0 = greedy (default {temperature})")
    ap.add_argument("--top-p", type=float, default=top_p, help=f"nucleus mass, 1 = off (default {top_p})")
    ap.add_argument("--top-k", type=int, default=top_k, help=f"0 = off (default {top_k})")
    ap.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    ap.add_argument("--seed", type=int, default=0)


def _k_list(text: str) -> list[int]:
    try:
        ks = [int(k) for k in text.split(",") if k.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--k wants integers like 2 or 1,2,4; got {text!r}") from None
    if not ks:
        raise argparse.ArgumentTypeError("--k needs at least one value")
    return ks


def spec_config_from_args(args: argparse.Namespace, method: str = "sps", k: int | None = None) -> SpecConfig:
    """`k` overrides `args.k` (the benchmark passes one K of its sweep)."""
    return SpecConfig(method=method, num_speculative_tokens=args.k if k is None else k, delta=args.delta,
                      posterior_threshold=args.posterior_threshold, posterior_alpha=args.posterior_alpha,
                      temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                      max_new_tokens=args.max_new_tokens, seed=args.seed)

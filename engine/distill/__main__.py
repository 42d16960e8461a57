"""`python -m engine.distill data|train|export|curve|evaluate`: build the default draft, resumably.

    python -m engine.distill data      # the target's own answers to training prompts (shards)
    python -m engine.distill data --prompt-set unseen   # the validation prompts no training set uses
    python -m engine.distill train     # fit the feature draft, checkpointing as it goes
    python -m engine.distill export    # write the shipped safetensors into assets/
    python -m engine.distill evaluate  # score draft files on the unseen prompts
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from engine.distill.training_prompts import PROMPT_SETS, VALIDATION_SET
from engine.models.cache_dir import cache_root
from engine.sampling import REPORTED_SAMPLING


DRAFT_DESCRIPTION = "SmolLM2-135M feature draft (EAGLE-style, 1 layer, distilled)"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m engine.distill", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", type=Path, default=cache_root() / "distill",
                        help="where shards and checkpoints live (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    sub = parser.add_subparsers(dest="command", required=True)
    data = sub.add_parser("data", help="sample the target's answers and record features + top-k")
    data.add_argument("--shards", type=int, default=40)
    data.add_argument("--batch-size", type=int, default=64)
    data.add_argument("--max-new-tokens", type=int, default=192)
    data.add_argument("--temperature", type=float, default=REPORTED_SAMPLING.temperature)
    data.add_argument("--top-p", type=float, default=REPORTED_SAMPLING.top_p)
    data.add_argument("--top-k", type=int, default=REPORTED_SAMPLING.top_k)
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--prompt-set", default="templates", choices=sorted(PROMPT_SETS),
                      help="templates (shards 0-65), broad (shards 66+, with --first-shard 66), or unseen: "
                           "the validation prompts, written to WORK_DIR/validation for train's held-out curve")
    data.add_argument("--first-shard", type=int, default=0, help="the shard that takes the set's first prompts")
    tr = sub.add_parser("train", help="fit the feature draft on the shards (resumes from its checkpoint)")
    tr.add_argument("--tokens", type=int, default=600_000, help="training positions to see")
    tr.add_argument("--vocab-size", type=int, default=16384, help="|V'|, the draft head's vocabulary")
    tr.add_argument("--layers", type=int, default=1)
    tr.add_argument("--batch-sequences", type=int, default=8)
    tr.add_argument("--lr", type=float, default=6e-4)
    tr.add_argument("--eval-every", type=int, default=50)
    tr.add_argument("--accept-weight", type=float, default=0.0,
                    help="weight of 1 - expected acceptance at the reported sampling (total variation) in the loss")
    ex = sub.add_parser("export", help="write the trained draft where the default pair loads it")
    ex.add_argument("--out", type=Path, default=None, help="default: the registry's DEFAULT_DRAFT_FILE")
    ev = sub.add_parser("evaluate", help="score draft files on the unseen-prompt validation set")
    ev.add_argument("paths", type=Path, nargs="*", help="draft safetensors (default: the shipped one)")
    cu = sub.add_parser("curve", help="print a shipped draft's held-out learning curve as a Markdown table")
    cu.add_argument("path", type=Path, nargs="?", default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from engine.models.registry import DEFAULT_DRAFT_FILE, load_default_target

    if args.command == "curve":
        from engine.models.feature_draft import draft_card

        print(learning_curve_table(draft_card(args.path or DEFAULT_DRAFT_FILE)["history"]))
        return

    if args.command == "evaluate":
        from engine.distill.train import evaluate_drafts

        print(evaluate_drafts(load_default_target().target_model, args.work_dir, args.paths or [DEFAULT_DRAFT_FILE]))
        return

    if args.command == "data":
        from engine.distill.teacher_data import TeacherDataConfig, build

        validation = args.prompt_set == VALIDATION_SET
        build(load_default_target(), TeacherDataConfig(
            out_dir=args.work_dir / ("validation" if validation else "data"),
            shards=1 if validation else args.shards,
            batch_size=len(PROMPT_SETS[VALIDATION_SET]()) if validation else args.batch_size,
            max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k, seed=args.seed, prompt_set=args.prompt_set, first_shard=args.first_shard))
    elif args.command == "train":
        from engine.distill.train import TrainConfig, train

        train(load_default_target().target_model, TrainConfig(
            work_dir=args.work_dir, tokens=args.tokens, vocab_size=args.vocab_size, num_layers=args.layers,
            batch_sequences=args.batch_sequences, lr=args.lr, eval_every=args.eval_every,
            accept_weight=args.accept_weight))
    elif args.command == "export":
        from engine.distill.train import export

        out = args.out or DEFAULT_DRAFT_FILE
        card = export(load_default_target().target_model, args.work_dir, out, DRAFT_DESCRIPTION)
        print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB): {card['tokens_seen']} tokens, {card['steps']} steps")


def learning_curve_table(history: dict, rows: int = 12) -> str:
    """Held-out top-1 agreement and Σ min(p, q) (= SpS acceptance at temperature 1 on the target's
    top-20, teacher-forced) for drafted token 1 (real feature) and 2 (predicted feature), on the
    validation shard, whose prompts also appear in training shards; and, once it exists, the
    expected acceptance at the benchmark's sampling on the unseen prompts."""
    n = len(history["tokens_seen"])
    picks = sorted({round(i * (n - 1) / max(rows - 1, 1)) for i in range(rows)}) if n else []
    unseen = history.get("unseen_accept_step1", [])
    picks = sorted(set(picks) | {i for i, a in enumerate(unseen) if a is not None and i % 4 == 0})
    lines = ["| training tokens | top-1 agreement (token 1 / 2) | Σ min(p, q) (token 1 / 2) "
             "| unseen prompts: acceptance at T = 0.6 (token 1 / 2) |", "|---:|---|---|---|"]
    for i in picks:
        fresh = "–" if i >= len(unseen) or unseen[i] is None else \
            f"{unseen[i]:.3f} / {history['unseen_accept_step2'][i]:.3f}"
        lines.append(f"| {history['tokens_seen'][i]:,} | {history['agreement_step1'][i]:.3f} / "
                     f"{history['agreement_step2'][i]:.3f} | {history['overlap_step1'][i]:.3f} / "
                     f"{history['overlap_step2'][i]:.3f} | {fresh} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

"""Distil the feature draft from the teacher shards (EAGLE-style, with a two-step unroll).

Loss per position j (predicting t_{j+1}):  KL-style distillation on the target's top-k next-token
distribution, restricted to the draft's vocabulary V',  +  `feature_weight` · SmoothL1(f̂_j, f_j).
Pass 1 feeds the true previous feature f_{j-1} (the first drafted token of a round sees a real
target feature); pass 2 feeds pass 1's prediction f̂_{j-1} instead, which is what every later
drafted token sees (HASS's "training-time test"); both passes count. Training is resumable: the
checkpoint holds the weights, the optimiser, the data order and the learning curve.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.distill.teacher_data import existing_shards
from engine.models.feature_draft import FeatureDraft, draft_card, load_feature_draft
from engine.sampling import REPORTED_SAMPLING, SamplingParams, logits_to_probs


@dataclass
class TrainConfig:
    work_dir: Path
    vocab_size: int = 16384  # |V'|, the reduced draft head
    num_layers: int = 1
    tokens: int = 600_000  # training positions to see (epochs repeat the data)
    batch_sequences: int = 8
    lr: float = 6e-4
    warmup_steps: int = 40
    feature_weight: float = 0.2
    feature_noise: float = 0.05  # uniform noise on input features, in units of their RMS
    kd_fraction: float = 0.25  # positions per batch that pay for the LM head in training
    # Weight of 1 − Σ min(p, q) at the reported sampling, the acceptance SpS will see (DistillSpec's
    # total-variation objective); the KL term alone matches the untempered distributions.
    accept_weight: float = 0.0
    validation_sequences: int = 16
    eval_every: int = 50
    seed: int = 0
    validation_shards: int = 1


@dataclass
class TeacherSequence:
    tokens: torch.Tensor
    features: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor
    first_loss_position: int


@dataclass
class History:
    tokens_seen: list[int] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    agreement_step1: list[float] = field(default_factory=list)
    agreement_step2: list[float] = field(default_factory=list)
    overlap_step1: list[float] = field(default_factory=list)
    overlap_step2: list[float] = field(default_factory=list)
    # On the unseen-prompt validation set (None before it existed): top-1 agreement and the
    # expected acceptance at the benchmark's sampling, drafted tokens 1 and 2.
    unseen_agreement_step1: list[float | None] = field(default_factory=list)
    unseen_accept_step1: list[float | None] = field(default_factory=list)
    unseen_accept_step2: list[float | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("unseen_agreement_step1", "unseen_accept_step1", "unseen_accept_step2"):
            getattr(self, name).extend([None] * (len(self.tokens_seen) - len(getattr(self, name))))


def load_sequences(paths: list[Path]) -> list[TeacherSequence]:
    out = []
    for path in paths:
        shard = torch.load(path)
        for toks, feats, ids, lps, plen in zip(shard["tokens"], shard["features"], shard["top_ids"],
                                               shard["top_logprobs"], shard["prompt_lengths"]):
            if len(toks) > plen + 1:
                out.append(TeacherSequence(toks, feats, ids.long(), lps, max(1, plen - 1)))
    return out


def choose_vocabulary(sequences: list[TeacherSequence], size: int, vocab_size: int) -> torch.Tensor:
    """V': the tokens the target actually writes or ranks first, most frequent first, topped up with
    the lowest ids (BPE ids roughly follow merge frequency)."""
    counts = torch.zeros(vocab_size)
    for s in sequences:
        counts.index_add_(0, s.tokens, torch.ones(len(s.tokens)))
        counts.index_add_(0, s.top_ids[:, :3].reshape(-1), torch.ones(s.top_ids[:, :3].numel()))
    seen = counts.nonzero()[:, 0]
    chosen = seen[counts[seen].argsort(descending=True)][:size]
    if len(chosen) < size:
        rest = torch.ones(vocab_size, dtype=torch.bool)
        rest[chosen] = False
        chosen = torch.cat([chosen, rest.nonzero()[:, 0][: size - len(chosen)]])
    return chosen.sort().values


def _batch(seqs: list[TeacherSequence]) -> dict[str, torch.Tensor]:
    """Right-padded batch of (t_j, f_{j-1}) inputs and position-j targets for j = 1..L-1."""
    width = max(len(s.tokens) for s in seqs) - 1
    b, hidden, k = len(seqs), seqs[0].features.shape[1], seqs[0].top_ids.shape[1]
    tokens = torch.zeros(b, width, dtype=torch.long)
    prev = torch.zeros(b, width, hidden)
    target = torch.zeros(b, width, hidden)
    ids = torch.zeros(b, width, k, dtype=torch.long)
    lps = torch.full((b, width, k), -1e4)
    mask = torch.zeros(b, width)
    for r, s in enumerate(seqs):
        n = len(s.tokens) - 1
        tokens[r, :n] = s.tokens[1:]
        prev[r, :n] = s.features[:-1].float()
        target[r, :n] = s.features[1:].float()
        ids[r, :n] = s.top_ids[1:]
        lps[r, :n] = s.top_logprobs[1:].float()
        mask[r, s.first_loss_position - 1:n] = 1.0
    return {"tokens": tokens, "prev": prev, "target": target, "ids": ids, "lps": lps, "mask": mask}


class Objective:
    def __init__(self, draft: FeatureDraft, vocab_size: int, feature_weight: float) -> None:
        self.draft = draft
        self.feature_weight = feature_weight
        self.to_subset = torch.full((vocab_size,), -1, dtype=torch.long)
        self.to_subset[draft.vocab_ids] = torch.arange(len(draft.vocab_ids))

    def step_loss(self, pred: torch.Tensor, batch: dict, kd_fraction: float = 1.0,
                  sampling: SamplingParams | None = None,
                  accept_weight: float = 0.0) -> tuple[torch.Tensor, dict[str, float]]:
        """Feature regression at every position; distillation (the LM head, by far the costliest
        part) at a random `kd_fraction` of them, which keeps its gradient unbiased. With `sampling`,
        the metrics add "accept": Σ min(p, q) with both models under those settings, as SpS
        computes it (the draft over V', the target over its recorded top-20). `accept_weight` adds
        `acceptance_loss`, the total variation at the reported sampling."""
        mask = batch["mask"].bool()
        feat = F.smooth_l1_loss(pred[mask], batch["target"][mask], reduction="none").mean()
        chosen = mask & (torch.rand(mask.shape) < kd_fraction) if kd_fraction < 1 else mask
        logq = torch.log_softmax(self.draft.subset_logits(pred[chosen]), dim=-1)
        sub = self.to_subset[batch["ids"][chosen]]
        inside = sub >= 0
        lps = batch["lps"][chosen]
        logq_top = logq.gather(-1, sub.clamp_min(0)) * inside
        p = lps.exp() * inside
        loss = -(p * logq_top).sum(-1).mean() + self.feature_weight * feat
        if accept_weight:
            loss = loss + accept_weight * acceptance_loss(logq, sub, inside, lps)
        with torch.no_grad():
            agree = (sub[:, 0] == logq.argmax(-1)).float().mean()
            overlap = torch.minimum(p, logq_top.exp() * inside).sum(-1).mean()
            metrics = {"agree": float(agree), "overlap": float(overlap)}
            if sampling is not None:
                metrics["accept"] = float(expected_acceptance(logq, sub, inside, lps, sampling).mean())
        return loss, metrics

    def losses(self, batch: dict, noise: float = 0.0, kd_fraction: float = 1.0,
               sampling: SamplingParams | None = None,
               accept_weight: float = 0.0) -> tuple[torch.Tensor, dict[str, float]]:
        prev = batch["prev"]
        if noise:
            rms = prev.pow(2).mean(-1, keepdim=True).sqrt()
            prev = prev + (torch.rand_like(prev) * 2 - 1) * noise * rms
        pred1 = self.draft.features(batch["tokens"], prev)
        loss1, m1 = self.step_loss(pred1, batch, kd_fraction, sampling, accept_weight)
        prev2 = torch.cat([prev[:, :1], pred1[:, :-1].detach()], dim=1)
        pred2 = self.draft.features(batch["tokens"], prev2)
        loss2, m2 = self.step_loss(pred2, batch, kd_fraction, sampling, accept_weight)
        return loss1 + loss2, {f"{key}{step}": value for step, m in ((1, m1), (2, m2)) for key, value in m.items()}


def expected_acceptance(logq: torch.Tensor, sub: torch.Tensor, inside: torch.Tensor, target_logprobs: torch.Tensor,
                        sampling: SamplingParams, draft_sampling: SamplingParams | None = None) -> torch.Tensor:
    """Per-position Σ min(p, q): the target's p over its recorded top ids (`sub`: their V' indices,
    `inside`: whether in V') under `sampling`, the draft's q over V' (log-probs `logq`) under
    `draft_sampling` (default: the same)."""
    q = logits_to_probs(logq, draft_sampling or sampling).gather(-1, sub.clamp_min(0)) * inside
    return torch.minimum(logits_to_probs(target_logprobs, sampling), q).sum(-1)


def acceptance_loss(logq: torch.Tensor, sub: torch.Tensor, inside: torch.Tensor,
                    target_logprobs: torch.Tensor) -> torch.Tensor:
    """1 − Σ min(p, q) at the reported sampling, with the draft only tempered, not truncated: the
    top-k/top-p masks carry no gradient, so a target token outside the draft's kept set could never
    be pulled in. Σ min(p, q) is what SpS accepts (Leviathan et al. 2023, Thm 3.5), and this is the
    total-variation objective DistillSpec (Zhou et al. 2024) derives from that identity."""
    tempered = SamplingParams(temperature=REPORTED_SAMPLING.temperature)
    return 1.0 - expected_acceptance(logq, sub, inside, target_logprobs, REPORTED_SAMPLING, tempered).mean()


def train(target, cfg: TrainConfig, log=print) -> Path:
    """Train (or resume) and return the checkpoint path."""
    shards = existing_shards(cfg.work_dir / "data")
    if len(shards) <= cfg.validation_shards:
        raise ValueError(f"need more than {cfg.validation_shards} data shards in {cfg.work_dir / 'data'}; "
                         "run `python -m engine.distill data` first")
    valid = load_sequences(shards[: cfg.validation_shards])[: cfg.validation_sequences]
    train_set = load_sequences(shards[cfg.validation_shards:])
    vocab = target.config.vocab_size
    ckpt_path = cfg.work_dir / "train" / "checkpoint.pt"
    ckpt_path.parent.mkdir(parents=True, exist_ok=True)
    ckpt = torch.load(ckpt_path, weights_only=False) if ckpt_path.exists() else None
    vocab_ids = ckpt["vocab_ids"] if ckpt else choose_vocabulary(train_set, cfg.vocab_size, vocab)
    draft = FeatureDraft(target, vocab_ids, num_layers=cfg.num_layers)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
    history, step, seen, epoch, offset = History(), 0, 0, 0, 0
    if ckpt:
        draft.load_state_dict(ckpt["draft"], strict=False)
        opt.load_state_dict(ckpt["optimizer"])
        history, step, seen = History(**ckpt["history"]), ckpt["step"], ckpt["tokens_seen"]
        epoch, offset = ckpt["epoch"], ckpt["offset"]
        log(f"resumed at step {step} (epoch {epoch}), {seen} tokens seen")
    objective = Objective(draft, vocab, cfg.feature_weight)
    coverage = float(sum(objective.to_subset[s.top_ids[:, 0]].ge(0).float().mean() for s in valid) / len(valid))
    log(f"{len(train_set)} training / {len(valid)} validation sequences; |V'| = {len(vocab_ids)} covers "
        f"{coverage:.1%} of the target's top-1 tokens on validation")
    positions_per_sequence = sum(len(s.tokens) - s.first_loss_position for s in train_set) / len(train_set)
    total_steps = math.ceil(cfg.tokens / (positions_per_sequence * cfg.batch_sequences))
    valid_batches = _batches(valid, cfg.batch_sequences)
    unseen_batches = validation_batches(cfg.work_dir, cfg.batch_sequences)
    if not unseen_batches:
        log("no unseen-prompt validation set yet (`python -m engine.distill data --prompt-set unseen`)")
    start, running = time.perf_counter(), []
    while step < total_steps:
        if offset >= len(train_set):  # a new epoch also picks up shards written since the last one
            epoch, offset = epoch + 1, 0
            train_set = load_sequences(existing_shards(cfg.work_dir / "data")[cfg.validation_shards:])
            log(f"epoch {epoch}: {len(train_set)} training sequences")
        order = list(range(len(train_set)))
        random.Random(cfg.seed + epoch).shuffle(order)
        picked = [train_set[i] for i in order[offset:offset + cfg.batch_sequences]]
        offset += cfg.batch_sequences
        batch = _batch(picked)
        lr = cfg.lr * min(1.0, (step + 1) / cfg.warmup_steps) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / total_steps)))
        for group in opt.param_groups:
            group["lr"] = lr
        draft.train()
        loss, _ = objective.losses(batch, noise=cfg.feature_noise, kd_fraction=cfg.kd_fraction,
                                   accept_weight=cfg.accept_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        seen += int(batch["mask"].sum())
        running.append(loss.item())
        if step % cfg.eval_every == 0 or step == total_steps:
            metrics = evaluate(objective, valid_batches)
            history.tokens_seen.append(seen)
            history.train_loss.append(sum(running) / len(running))
            history.agreement_step1.append(metrics["agree1"])
            history.agreement_step2.append(metrics["agree2"])
            history.overlap_step1.append(metrics["overlap1"])
            history.overlap_step2.append(metrics["overlap2"])
            unseen = evaluate(objective, unseen_batches, REPORTED_SAMPLING) if unseen_batches else {}
            history.unseen_agreement_step1.append(unseen.get("agree1"))
            history.unseen_accept_step1.append(unseen.get("accept1"))
            history.unseen_accept_step2.append(unseen.get("accept2"))
            running = []
            log(f"step {step}/{total_steps}  tokens {seen}  loss {history.train_loss[-1]:.3f}  held-out top-1 "
                f"agreement {metrics['agree1']:.3f} (step 1) / {metrics['agree2']:.3f} (step 2)  Σmin(p,q) "
                f"{metrics['overlap1']:.3f} / {metrics['overlap2']:.3f}  "
                + (f"unseen prompts: top-1 {unseen['agree1']:.3f}, acceptance at T=0.6 {unseen['accept1']:.3f} / "
                   f"{unseen['accept2']:.3f}  " if unseen else "") + f"lr {lr:.2e}  "
                f"{time.perf_counter() - start:.0f} s")
            tmp = ckpt_path.with_suffix(".tmp")
            torch.save({"draft": draft.trainable_state(), "optimizer": opt.state_dict(), "step": step,
                        "tokens_seen": seen, "history": asdict(history), "epoch": epoch, "offset": offset, "vocab_ids": vocab_ids,
                        "config": {k: str(v) for k, v in asdict(cfg).items()}}, tmp)
            tmp.rename(ckpt_path)
    return ckpt_path


def _batches(seqs: list[TeacherSequence], size: int) -> list[dict]:
    return [_batch(seqs[i:i + size]) for i in range(0, len(seqs), size)]


def validation_batches(work_dir: Path, size: int = 8) -> list[dict]:
    """The unseen-prompt validation set (`data --prompt-set unseen`), or [] before it exists."""
    return _batches(load_sequences(existing_shards(work_dir / "validation")), size)


@torch.no_grad()
def evaluate(objective: Objective, batches: list[dict], sampling: SamplingParams | None = None) -> dict[str, float]:
    objective.draft.eval()
    totals: dict[str, float] = {}
    weight = 0.0
    for batch in batches:
        n = float(batch["mask"].sum())
        _, metrics = objective.losses(batch, sampling=sampling)
        for key, value in metrics.items():
            totals[key] = totals.get(key, 0.0) + value * n
        weight += n
    return {k: v / weight for k, v in totals.items()}


def export(target, work_dir: Path, out_path: Path, description: str) -> dict:
    """Write the checkpoint's draft as the shipped safetensors; the card (in its metadata) records
    how it was trained and its held-out learning curve."""
    ckpt = torch.load(work_dir / "train" / "checkpoint.pt", weights_only=False)
    layers = int(ckpt["config"]["num_layers"])
    draft = FeatureDraft(target, ckpt["vocab_ids"], num_layers=layers, init_from_layer=None)
    draft.load_state_dict(ckpt["draft"], strict=False)
    shards = existing_shards(work_dir / "data")
    card = {"description": description, "steps": ckpt["step"], "tokens_seen": ckpt["tokens_seen"],
            "data_shards": len(shards), "config": ckpt["config"], "history": ckpt["history"]}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    draft.save(out_path, card)
    return card


def evaluate_drafts(target, work_dir: Path, paths: list[Path]) -> str:
    """A Markdown table of each draft's teacher-forced scores on the unseen-prompt validation set."""
    batches = validation_batches(work_dir)
    if not batches:
        raise ValueError(f"no validation set in {work_dir / 'validation'}: run "
                         "`python -m engine.distill data --prompt-set unseen` first")
    lines = ["| draft | training tokens | top-1 agreement (token 1 / 2) | acceptance at T = 0.6 (token 1 / 2) |",
             "|---|---:|---|---|"]
    for path in paths:
        draft = load_feature_draft(path, target)
        m = evaluate(Objective(draft, target.config.vocab_size, 0.0), batches, REPORTED_SAMPLING)
        lines.append(f"| {path} | {draft_card(path).get('tokens_seen', 0):,} | {m['agree1']:.3f} / {m['agree2']:.3f} "
                     f"| {m['accept1']:.3f} / {m['accept2']:.3f} |")
    return "\n".join(lines)

"""Teacher data for distillation: the target's own sampled answers to training prompts.

The best-matched data for a draft is what the target itself writes (ALGORITHMS.md: acceptance is
1 − TV between the two next-token distributions *on the target's own text*). Each shard holds a
batch of sequences (prompt + sampled answer) with, at every position, the target's final hidden
state (the feature a feature-level draft reads, fp16) and its top-k next-token log-probabilities
(the distillation target). Shards are written atomically and named by index, so a run stopped at
any point resumes where it left off.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import DynamicCache

from engine.distill.training_prompts import PROMPT_SETS
from engine.models.registry import ModelPair
from engine.sampling import REPORTED_SAMPLING, SamplingParams, logits_to_probs, sample_from

TOP_K = 20


@dataclass(frozen=True)
class TeacherDataConfig:
    out_dir: Path
    shards: int = 40
    batch_size: int = 64
    max_new_tokens: int = 192
    # The benchmark's sampling (temperature 0.6, top-p 0.95, top-k 20): the draft learns the text
    # it will be asked to draft. top-k ≤ TOP_K, so a token is drawn from the recorded top-k alone,
    # which also spares a sort over the full vocabulary at every step.
    temperature: float = REPORTED_SAMPLING.temperature
    top_p: float = REPORTED_SAMPLING.top_p
    top_k: int = REPORTED_SAMPLING.top_k
    seed: int = 0
    prompt_set: str = "templates"  # a key of training_prompts.PROMPT_SETS
    first_shard: int = 0  # shard `first_shard` takes the set's first batch of prompts

    def __post_init__(self) -> None:
        if self.prompt_set not in PROMPT_SETS:
            raise ValueError(f"unknown prompt set {self.prompt_set!r}; choose from {sorted(PROMPT_SETS)}")
        if not 0 < self.top_k <= TOP_K:
            raise ValueError(f"top_k must be in 1..{TOP_K} (the recorded top-k), got {self.top_k}")

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)


def shard_path(out_dir: Path, index: int) -> Path:
    return out_dir / f"shard_{index:05d}.pt"


def existing_shards(out_dir: Path) -> list[Path]:
    return sorted(out_dir.glob("shard_*.pt"))


@torch.inference_mode()
def generate_shard(pair: ModelPair, prompts: list[str], cfg: TeacherDataConfig, index: int) -> dict:
    """Sample answers for one batch (left-padded) and record features and top-k log-probs."""
    model = pair.target_model
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + index)
    encoded = [pair.encode_prompt(p) for p in prompts]
    width = max(map(len, encoded))
    batch = len(encoded)
    pad = pair.tokenizer.pad_token_id if pair.tokenizer.pad_token_id is not None else 0
    ids = torch.full((batch, width), pad, dtype=torch.long)
    mask = torch.zeros((batch, width), dtype=torch.long)
    for row, seq in enumerate(encoded):
        ids[row, width - len(seq):] = torch.tensor(seq)
        mask[row, width - len(seq):] = 1
    eos = torch.tensor(sorted(pair.eos_token_ids))
    cache = DynamicCache(config=model.config)
    tokens, feats, top_lp, top_ix = [ids], [], [], []
    done = torch.zeros(batch, dtype=torch.bool)
    step_ids = ids
    for _ in range(cfg.max_new_tokens):
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1]:]
        hidden = model.model(input_ids=step_ids, attention_mask=mask, position_ids=positions,
                             cache=cache, use_cache=True).last_hidden_state
        logprobs = torch.log_softmax(model.lm_head(hidden).float()[..., :pair.vocab_size], dim=-1)
        lp, ix = logprobs.topk(TOP_K, dim=-1)
        feats.append(hidden.half())
        top_lp.append(lp.half())
        top_ix.append(ix.int())
        was_done = done.clone()
        nxt = torch.where(was_done, pad, _sample_from_top(lp[:, -1].float(), ix[:, -1], cfg.sampling, gen))
        done |= torch.isin(nxt, eos)
        step_ids = nxt[:, None]
        mask = torch.cat([mask, (~was_done).long()[:, None]], -1)
        tokens.append(step_ids)
        if done.all():
            break
    feats, top_lp, top_ix = torch.cat(feats, 1), torch.cat(top_lp, 1), torch.cat(top_ix, 1)
    width = feats.shape[1]  # the last sampled token was never fed: align everything to the fed ones
    keep = mask[:, :width].bool()
    all_tokens = torch.cat(tokens, 1)[:, :width]
    return {
        "tokens": [all_tokens[r][keep[r]] for r in range(batch)],
        "prompt_lengths": [len(seq) for seq in encoded],
        "features": [feats[r][keep[r]] for r in range(batch)],
        "top_logprobs": [top_lp[r][keep[r]] for r in range(batch)],
        "top_ids": [top_ix[r][keep[r]] for r in range(batch)],
    }


def _sample_from_top(top_logprobs: torch.Tensor, top_ids: torch.Tensor, params: SamplingParams,
                     gen: torch.Generator) -> torch.Tensor:
    """Sample with the engine's own temperature → top-k → top-p pipeline, on the top-k only."""
    probs = logits_to_probs(top_logprobs[:, : params.top_k], params)
    choice = sample_from(probs, torch.rand(len(probs), generator=gen))
    return top_ids[:, : params.top_k].gather(-1, choice[:, None])[:, 0]


def build(pair: ModelPair, cfg: TeacherDataConfig) -> None:
    """Write shards cfg.first_shard..cfg.shards-1, skipping those already on disk; print progress."""
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    prompts = PROMPT_SETS[cfg.prompt_set](cfg.seed)
    seen = sum(sum(len(t) for t in torch.load(p)["tokens"]) for p in existing_shards(cfg.out_dir))
    start = time.perf_counter()
    for index in range(cfg.first_shard, cfg.shards):
        path = shard_path(cfg.out_dir, index)
        if path.exists():
            continue
        lo = (index - cfg.first_shard) * cfg.batch_size
        batch = [prompts[(lo + i) % len(prompts)] for i in range(cfg.batch_size)]
        shard = generate_shard(pair, batch, cfg, index)
        tmp = path.with_suffix(".tmp")
        torch.save(shard, tmp)
        tmp.rename(path)
        seen += sum(len(t) for t in shard["tokens"])
        elapsed = time.perf_counter() - start
        print(f"shard {index + 1}/{cfg.shards}: {seen} tokens on disk ({elapsed:.0f} s this run)", flush=True)

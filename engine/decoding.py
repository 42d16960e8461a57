"""The decoding loop: autoregressive and synchronous speculative decoding as one event generator.

One round = draft K tokens, verify K+1 positions in a single target forward, apply the acceptance
rule, roll both KV caches back to the accepted length. Autoregressive decoding is the same round
with K = 0 (the single target position yields the token), so AR and SpS share every line that is
not drafting. The target cache always holds every token except the last emitted one, which is fed
as the first of the K+1 verified positions (after the prefill, whose last row already is T_1, it
holds them all): no prefix is ever recomputed.

The config object is snapshotted at the start of every round, so K, δ, the method and the
sampling settings can change while a generation runs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence

import torch
from transformers import PreTrainedTokenizerBase

from engine.acceptance import RandomDraws, VerifyResult, cactus_h, verify_on_support
from engine.config import SpecConfig
from engine.detokenize import IncrementalDetokenizer
from engine.drafters import Drafter, Proposal
from engine.events import Candidate, FinishEvent, RoundEvent, StartEvent, TokenEvent
from engine.metrics import SpecMetrics
from engine.models.causal_lm import CausalLM
from engine.sampling import dense_probs, sparse_probs

Event = StartEvent | TokenEvent | RoundEvent | FinishEvent


def describe_device(lm: CausalLM) -> str:
    device = getattr(lm, "device", torch.device("cpu"))
    return f"{device} ({torch.get_num_threads()} threads)" if device.type == "cpu" else str(device)


def generate(
    target: CausalLM,
    drafter: Drafter | None,
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: Sequence[int],
    config: SpecConfig,
    *,
    eos_token_ids: frozenset[int] = frozenset(),
    stop: threading.Event | None = None,
) -> Iterator[Event]:
    """Yield StartEvent, then per round its TokenEvents and a RoundEvent, then a FinishEvent."""
    cfg = config.snapshot()
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token")
    if cfg.method != "ar" and drafter is None:
        raise ValueError(f"method {cfg.method!r} needs a drafter")
    vocab = target.vocab_size
    if any(not 0 <= t < vocab for t in prompt_ids):
        raise ValueError(f"prompt token ids must be in [0, {vocab})")
    generator = torch.Generator().manual_seed(int(cfg.seed))
    target.reset()
    observes = drafter is not None and drafter.needs_target_features
    target.keep_hidden = observes
    if drafter is not None:
        drafter.start()
    detok = IncrementalDetokenizer(tokenizer)
    context = list(prompt_ids)
    generated: list[int] = []

    start = time.perf_counter()
    # The prefill's last row already is T_1 of the first round: keep it instead of re-feeding the
    # last prompt token (one target forward saved per generation, as HF generate() does).
    pending_logits: torch.Tensor | None = target.forward(context)
    if observes:
        drafter.observe_target(0, target.last_hidden)
    prefill_seconds = time.perf_counter() - start
    yield StartEvent(len(context), prefill_seconds, target.name, drafter.name if drafter else "none",
                     target.backend_label, describe_device(target))

    metrics = SpecMetrics()
    previous = cfg
    reason = "max_new_tokens"
    round_index = 0
    while len(generated) < cfg.max_new_tokens:
        if stop is not None and stop.is_set():
            reason = "stopped"
            break
        round_start = time.perf_counter()
        cfg = config.snapshot()
        remaining = cfg.max_new_tokens - len(generated)
        if remaining <= 0:
            break
        params = cfg.sampling
        k = 0 if cfg.method == "ar" else min(cfg.num_speculative_tokens, remaining - 1)

        draft_before = drafter.forward_seconds if drafter else 0.0
        proposal = Proposal([], torch.empty(0, vocab))
        if k > 0:
            proposal = drafter.propose(context, k, params, torch.rand(k, generator=generator))
        k = len(proposal.tokens)
        draft_seconds = (drafter.forward_seconds if drafter else 0.0) - draft_before

        verify_before = target.forward_seconds
        fed_from = target.length
        feed = ([] if pending_logits is not None else [context[-1]]) + proposal.tokens
        logits = target.forward(feed, last_n=len(feed)) if feed else pending_logits[:0]
        if pending_logits is not None:
            logits = torch.cat([pending_logits, logits])
        pending_logits = None
        verify_seconds = target.forward_seconds - verify_before

        target_probs, proposal, result = apply_rule(logits, proposal, cfg, generator)
        num_accepted = int(result.num_accepted[0])
        target.rollback(len(context) + num_accepted)
        if observes and feed:
            drafter.observe_target(fed_from, target.last_hidden[: target.length - fed_from])

        new_tokens = proposal.tokens[:num_accepted] + [int(result.next_tokens[0])]
        finished = False
        for j, token in enumerate(new_tokens):
            if token in eos_token_ids:
                new_tokens, finished = new_tokens[: j + 1], True
                break
        token_events = _token_events(
            cfg, result, target_probs, proposal, new_tokens, num_accepted, len(generated), round_index, detok,
            tokenizer,
        )
        context.extend(new_tokens)
        generated.extend(new_tokens)
        rejected = proposal.tokens[num_accepted] if num_accepted < k else None
        # An EOS among the accepted drafts ends the generation there: drafts after it were never
        # needed, so they count neither as drafted nor as accepted.
        counted = min(k, len(new_tokens)) if finished and len(new_tokens) <= num_accepted else k
        round_event = RoundEvent(
            round_index=round_index,
            method=cfg.method,
            num_speculative_tokens=0 if cfg.method == "ar" else cfg.num_speculative_tokens,
            num_draft_tokens=counted,
            draft_token_ids=tuple(proposal.tokens[:counted]),
            num_accepted=min(num_accepted, counted),
            num_emitted=len(new_tokens),
            accepted_positions=tuple(bool(a) for a in result.accepted[0, :counted].tolist()),
            rejected_token_id=rejected,
            rejected_text=None if rejected is None else tokenizer.decode([rejected]),
            kl=sum(e.kl for e in token_events),
            draft_seconds=draft_seconds,
            verify_seconds=verify_seconds,
            target_forwards=int(bool(feed)),
            round_seconds=time.perf_counter() - round_start,
            elapsed_seconds=time.perf_counter() - start,
            config=cfg.as_dict(),
            config_changes=cfg.changed_fields(previous) if round_index else (),
        )
        metrics.add_round(round_event)
        yield from token_events
        yield round_event
        previous = cfg
        round_index += 1
        if finished:
            reason = "eos"
            break

    elapsed = time.perf_counter() - start
    yield FinishEvent(reason, detok.text(), tuple(generated), metrics.summary(elapsed, prefill_seconds))


def apply_rule(logits: torch.Tensor, proposal: Proposal, cfg: SpecConfig,
               generator: torch.Generator) -> tuple[torch.Tensor, Proposal, VerifyResult]:
    """One round's verdict from the target's logits [K+1, V] at the verified positions: the target's
    probabilities under the round's sampling, the proposal moved to their device (the draft may
    live elsewhere) and the acceptance rule's result. AR is SpS with K = 0."""
    support, kept = sparse_probs(logits, cfg.sampling)
    target_probs = dense_probs(support, kept, logits.shape[-1])
    proposal = Proposal(proposal.tokens, proposal.probs.to(target_probs.device))
    draft_tokens = torch.tensor([proposal.tokens], dtype=torch.long, device=target_probs.device)
    result = verify_on_support(
        "sps" if cfg.method == "ar" else cfg.method,
        target_probs.unsqueeze(0), proposal.probs.unsqueeze(0), draft_tokens, support,
        delta=cfg.delta, posterior_threshold=cfg.posterior_threshold, posterior_alpha=cfg.posterior_alpha,
        draws=RandomDraws.draw(1, len(proposal.tokens), generator),
    )
    return target_probs, proposal, result


def _token_events(cfg: SpecConfig, result: VerifyResult, target_probs: torch.Tensor, proposal: Proposal, new_tokens: list[int],
                  num_accepted: int, first_index: int, round_index: int, detok: IncrementalDetokenizer,
                  tokenizer: PreTrainedTokenizerBase) -> list[TokenEvent]:
    """Per-token events; statistics are read once per round as Python lists (no per-token tensors)."""
    k = len(proposal.tokens)
    stats = {name: getattr(result, name)[0].tolist() for name in
             ("target_token_probs", "draft_token_probs", "acceptance_probs", "gamma", "kl")}
    entropy = result.target_entropy[0].tolist()
    events = []
    for pos, token in enumerate(new_tokens):
        tested = pos < k
        if pos < num_accepted:
            status = "accepted"
        elif tested:
            status = "recovered"
        else:
            status = "generated" if cfg.method == "ar" else "bonus"
        events.append(TokenEvent(
            index=first_index + pos,
            token_id=token,
            text=detok.push(token),
            status=status,
            round_index=round_index,
            draft_position=pos + 1,
            target_prob=float(target_probs[pos, token]),
            draft_prob=float(proposal.probs[pos, token]) if tested else None,
            acceptance_prob=stats["acceptance_probs"][pos] if tested else None,
            gamma=stats["gamma"][pos] if tested and cfg.method == "cactus" else None,
            kl=stats["kl"][pos] if tested else 0.0,
            target_entropy=entropy[pos],
            candidates=_candidates(cfg, result, target_probs, proposal, pos, tokenizer) if cfg.inspect_top_n else (),
        ))
    return events


def _candidates(cfg: SpecConfig, result: VerifyResult, target_probs: torch.Tensor, proposal: Proposal, pos: int,
                tokenizer: PreTrainedTokenizerBase) -> tuple[Candidate, ...]:
    """Top candidates at one position with target, draft, h and residual probabilities."""
    t = target_probs[pos]
    tested = pos < len(proposal.tokens)
    d = proposal.probs[pos] if tested else torch.zeros_like(t)
    h = t
    if tested and cfg.method == "cactus":
        h = cactus_h(t, torch.tensor(proposal.tokens[pos], device=t.device), result.gamma[0, pos])
    residual = (h - d).clamp_min(0.0)
    residual = residual / residual.sum().clamp_min(1e-30)
    top = torch.topk(t + d, min(cfg.inspect_top_n, t.numel())).indices.tolist()
    return tuple(
        Candidate(i, tokenizer.decode([i]), float(t[i]), float(d[i]), float(h[i]), float(residual[i])) for i in top
    )

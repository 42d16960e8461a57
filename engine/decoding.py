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

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from engine.acceptance import NativeRule, RandomDraws, RoundVerdict, TargetRows, verify_logits
from engine.config import SpecConfig
from engine.detokenize import IncrementalDetokenizer
from engine.drafters import Drafter, Proposal
from engine.divergence import (PositionDivergence, RuleSettings, position_divergence, sparse_position_divergences,
                               tas_threshold)
from engine.events import Candidate, FinishEvent, PositionTest, RoundEvent, StartEvent, TokenDetails, TokenEvent
from engine.metrics import PhaseClock, SpecMetrics
from engine.models.causal_lm import CausalLM
from engine.sampling import SamplingParams
from engine.uniform_stream import UniformStream

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
    stream = UniformStream(cfg.seed)
    target.reset()
    target.reserve(len(prompt_ids) + cfg.max_new_tokens)  # a round verifies at most up to the last new token
    observes = drafter is not None and drafter.needs_target_features
    target.keep_hidden = observes
    if drafter is not None:
        drafter.start()
    if observes:  # a verify then writes its hidden states into the draft's rows, where the backend can
        target.feature_rows = drafter.target_feature_rows()
    detok = IncrementalDetokenizer(tokenizer)
    context = list(prompt_ids)
    generated: list[int] = []

    start = time.perf_counter()
    metrics = SpecMetrics()
    no_draft = Proposal([], torch.empty(0, vocab))
    previous = cfg
    params, cfg_dict, rule = _round_settings(cfg, vocab)  # rebuilt only in a round whose snapshot is new
    # The prefill's last row already is T_1 of the first round: keep it instead of re-feeding the
    # last prompt token (one target forward saved per generation, as HF generate() does).
    pending_logits: torch.Tensor | None = target.forward(context)
    if observes:
        drafter.observe_target(0, target.last_hidden)
    prefill_seconds = time.perf_counter() - start
    yield StartEvent(len(context), prefill_seconds, target.name, drafter.name if drafter else "none",
                     target.backend_label, describe_device(target))
    resumed = time.perf_counter()  # the loop has control again: the round's clock runs from here
    reason = "max_new_tokens"
    round_index, handoff = 0, 0.0
    while len(generated) < cfg.max_new_tokens:
        if stop is not None and stop.is_set():
            reason = "stopped"
            break
        clock = PhaseClock(resumed, handoff)
        cfg = config.snapshot(previous)
        if cfg is not previous:
            params, cfg_dict, rule = _round_settings(cfg, vocab)
        remaining = cfg.max_new_tokens - len(generated)
        if remaining <= 0:
            break
        k = 0 if cfg.method == "ar" else min(cfg.num_speculative_tokens, remaining - 1)
        clock.lap("bookkeeping")

        draft_before = drafter.forward_seconds if drafter else 0.0
        proposal = no_draft
        if k > 0:
            proposal = drafter.propose(context, k, params, stream.take_floats(k))
        k = len(proposal.tokens)
        draft_seconds = (drafter.forward_seconds if drafter else 0.0) - draft_before
        clock.split("draft_other", "draft_forward", draft_seconds)

        verify_before = target.forward_seconds
        fed_from = target.length
        feed = ([] if pending_logits is not None else [context[-1]]) + proposal.tokens
        support, proposal, result, rule_seconds = verify_round(
            target, feed, pending_logits, proposal, cfg, params, RandomDraws.take(stream, len(proposal.tokens)), rule)
        pending_logits = None
        verify_seconds = target.forward_seconds - verify_before
        clock.split("verify_other", "verify_forward", verify_seconds)
        clock.move("verify_other", "sampling_rule", rule_seconds)
        num_accepted = result.accepted_count
        target.rollback(len(context) + num_accepted)
        if observes and feed:
            if target.last_hidden is None:  # written into target_feature_rows by the forward itself
                drafter.observe_target_rows(fed_from, target.length - fed_from)
            else:
                drafter.observe_target(fed_from, target.last_hidden[: target.length - fed_from])
        clock.lap("rollback")

        new_tokens = proposal.tokens[:num_accepted] + [result.next_token]
        finished = False
        for j, token in enumerate(new_tokens):
            if token in eos_token_ids:
                new_tokens, finished = new_tokens[: j + 1], True
                break
        context.extend(new_tokens)
        generated.extend(new_tokens)
        clock.lap("bookkeeping")
        token_events = _token_events(
            cfg, result, support, proposal, new_tokens, num_accepted, len(generated) - len(new_tokens), round_index,
            detok, tokenizer,
        )
        rejected = proposal.tokens[num_accepted] if num_accepted < k else None
        # An EOS among the accepted drafts ends the generation there: drafts after it were never
        # needed, so they count neither as drafted nor as accepted.
        counted = min(k, len(new_tokens)) if finished and len(new_tokens) <= num_accepted else k
        drafted, passed = tuple(proposal.tokens[:counted]), tuple(result.passed[:counted])
        constraint_kl = sum(result.kl_values[: min(k, len(new_tokens))], 0.0)  # Σ over the round's token events
        changes = cfg.changed_fields(previous) if round_index and cfg is not previous else ()
        clock.lap("events")
        round_event = RoundEvent(
            round_index=round_index,
            method=cfg.method,
            num_speculative_tokens=0 if cfg.method == "ar" else cfg.num_speculative_tokens,
            num_draft_tokens=counted,
            draft_token_ids=drafted,
            num_accepted=min(num_accepted, counted),
            num_emitted=len(new_tokens),
            accepted_positions=passed,
            rejected_token_id=rejected,
            constraint_kl=constraint_kl,
            draft_seconds=draft_seconds,
            verify_seconds=verify_seconds,
            target_forwards=int(bool(feed)),
            round_seconds=clock.total,
            elapsed_seconds=clock.last_lap - start,
            config=cfg_dict,
            config_changes=changes,
            phase_seconds=clock.seconds,
            details=token_events[0].details,
        )
        metrics.add_round(round_event)
        handoff = time.perf_counter() - clock.last_lap  # closing this round: charged to the next one
        yield from token_events
        yield round_event
        resumed = time.perf_counter()
        previous = cfg
        round_index += 1
        if finished:
            reason = "eos"
            break

    text = detok.text()
    elapsed = time.perf_counter() - start
    yield FinishEvent(reason, text, tuple(generated), metrics.summary(elapsed, prefill_seconds))


def _round_settings(cfg: SpecConfig, vocab: int) -> tuple[SamplingParams, dict, NativeRule | None]:
    """What a config snapshot fixes for its rounds: the sampling params, the config as a dict for the
    events, and the native rule (`round_rule`)."""
    return cfg.sampling, cfg.as_dict(), round_rule(cfg, vocab)


def round_rule(cfg: SpecConfig, vocab: int) -> NativeRule | None:
    """The native rule for a config snapshot's rounds over `vocab` target columns, where it applies
    (`NativeRule.for_settings`): one per generation (or SSD row) and snapshot."""
    return NativeRule.for_settings(_rule_method(cfg), cfg.sampling, vocab, cfg.delta, cfg.posterior_threshold,
                                   cfg.posterior_alpha)


def _rule_method(cfg: SpecConfig) -> str:
    return "sps" if cfg.method == "ar" else cfg.method  # AR is SpS with K = 0


def verify_round(target: CausalLM, feed: list[int], pending_logits: torch.Tensor | None, proposal: Proposal,
                 cfg: SpecConfig, params: SamplingParams, draws: RandomDraws, rule: NativeRule | None
                 ) -> tuple[TargetRows, Proposal, RoundVerdict, float]:
    """A round's verification: the target forward over `feed` (after `pending_logits`, the prefill's
    last row, when it is the round's first row) and the rule on the K+1 verified rows. Returns
    (support, proposal, verdict) as `apply_rule` does, and the seconds the rule took (Python and
    native: the caller books them apart from the forward).

    With a native `rule` and a backend whose forward can run it (`CausalLM.forward_with_rule`), both
    are one native call: no Python step runs between the forward and the rule, and the rule's own
    time is not booked as the forward's."""
    on_cpu = not proposal.tokens or proposal.device.type == "cpu"  # no torch attribute read for AR
    if rule is not None and pending_logits is None and feed and on_cpu:
        start = time.perf_counter()
        rule.prepare(proposal, draws)
        prepared = time.perf_counter()
        if target.forward_with_rule(feed, rule) is not None:
            done = time.perf_counter()
            support, result = rule.verdict()
            return support, proposal, result, prepared - start + rule.seconds + time.perf_counter() - done
    if pending_logits is None:
        logits = target.forward(feed, last_n=len(feed))
    else:
        logits = target.forward_after(pending_logits, feed) if feed else pending_logits
    start = time.perf_counter()
    support, proposal, result = apply_rule(logits, proposal, cfg, params, draws, rule)
    return support, proposal, result, time.perf_counter() - start


def apply_rule(logits: torch.Tensor, proposal: Proposal, cfg: SpecConfig, params: SamplingParams,
               draws: RandomDraws, rule: NativeRule | None = None
               ) -> tuple[TargetRows, Proposal, RoundVerdict]:
    """One round's verdict from the target's logits [K+1, V] at the verified positions: the target's
    rows under the round's sampling `params` (= cfg.sampling, built once per round by the caller) as
    `sparse_probs` gives them (`TargetRows`), the proposal moved to their device (the draft may live
    elsewhere) and the acceptance rule's result on the round's `draws`, through the config's
    prebuilt native `rule` where there is one. AR is SpS with K = 0."""
    if proposal.tokens and proposal.device != logits.device:
        proposal = Proposal(proposal.tokens, proposal.probs.to(logits.device))
    if rule is not None and logits.is_cpu:
        rule.prepare(proposal, draws)
        rule.run(logits)
        support, result = rule.verdict()
        return support, proposal, result
    support, result = verify_logits(
        _rule_method(cfg), logits, params, proposal, draws,
        delta=cfg.delta, posterior_threshold=cfg.posterior_threshold, posterior_alpha=cfg.posterior_alpha,
    )
    return support, proposal, result


def _token_events(cfg: SpecConfig, result: RoundVerdict, support: TargetRows,
                  proposal: Proposal, new_tokens: list[int], num_accepted: int, first_index: int, round_index: int,
                  detok: IncrementalDetokenizer, tokenizer: PreTrainedTokenizerBase,
                  sequence: int = 0) -> list[TokenEvent]:
    """The round's token events: ids, status and the rule's per-token numbers now (read once per
    round as Python lists); text and inspector candidates when a consumer reads them."""
    k = len(proposal.tokens)
    detok.extend(new_tokens)
    details = _RoundDetails(detok, cfg, result, support, proposal, tokenizer)
    cactus = cfg.method == "cactus"
    events = []
    for pos, token in enumerate(new_tokens):
        tested = pos < k
        accepted = pos < num_accepted
        if accepted:
            status = "accepted"
        elif tested:
            status = "recovered"
        else:
            status = "generated" if cfg.method == "ar" else "bonus"
        events.append(TokenEvent(
            index=first_index + pos,
            token_id=token,
            status=status,
            round_index=round_index,
            draft_position=pos + 1,
            target_prob=result.target_token_probs[pos] if accepted else result.next_target_prob,
            draft_prob=(result.draft_token_probs[pos] if accepted else result.next_draft_prob) if tested else None,
            acceptance_prob=result.acceptance_probs_values[pos] if tested else None,
            gamma=result.gamma_values[pos] if tested and cactus else None,
            constraint_kl=result.kl_values[pos] if tested else 0.0,
            target_entropy=result.entropy_values[pos],
            details=details,
            sequence=sequence,
        ))
    return events


class _RoundDetails(TokenDetails):
    """One round's text pieces, inspector candidates, divergences and tests, computed on first read.

    The round's rows (target T_i under the sampling settings, draft D_i) stay referenced until a
    reader asks for any of the derived values; then the divergences and tests are computed in
    numpy (under a lock: the UI reads from its own threads, where torch would open a second OpenMP
    team). The inspector's candidates scan the whole vocabulary per position (1.4 ms a round on the
    default pair, AMD EPYC Zen 4: most of what folding a round cost the UI thread, on the same cores
    as the engine), so where the rows are sparse they are kept and the candidates wait for a reader
    who asks for them (a click on a token); dense rows (no top-k) are too large to keep, and get
    their candidates with the rest.
    """

    def __init__(self, detok: IncrementalDetokenizer, cfg: SpecConfig, result: RoundVerdict,
                 support: TargetRows, proposal: Proposal,
                 tokenizer: PreTrainedTokenizerBase) -> None:
        self._detok = detok
        self._rows: tuple | None = (cfg, result, support, proposal, tokenizer)
        self._pending_candidates: tuple | None = None  # what `_candidates` needs, until first asked
        self._candidates: list[tuple[Candidate, ...]] = []
        self._divergences: list[PositionDivergence] = []
        self._pending_tests: tuple | None = None  # what `_position_tests` needs, until first asked
        self._tests: tuple[PositionTest, ...] = ()
        self._lock = threading.Lock()

    def text(self, index: int) -> str:
        return self._detok.piece(index)

    def token_text(self, token_id: int) -> str:
        return self._detok.tokenizer.decode([token_id])

    def candidates(self, position: int) -> tuple[Candidate, ...]:
        self._derive()
        with self._lock:
            if self._pending_candidates is not None:
                self._candidates = _all_candidates(*self._pending_candidates)
                self._pending_candidates = None
        return self._candidates[position] if position < len(self._candidates) else ()

    def divergence(self, position: int) -> PositionDivergence | None:
        self._derive()
        return self._divergences[position] if position < len(self._divergences) else None

    def tests(self) -> tuple[PositionTest, ...]:
        """Decoded on first ask: the live chart reads every round's divergences, the tests a click on a token."""
        self._derive()
        with self._lock:
            if self._pending_tests is not None:
                self._tests = _position_tests(*self._pending_tests)
                self._pending_tests = None
        return self._tests

    def _derive(self) -> None:
        with self._lock:
            if self._rows is None:
                return
            cfg, result, support, proposal, tokenizer = self._rows
            self._rows = None
            rows = RoundRows.of(*support.tensors(), proposal)
            rule = RuleSettings.from_config(cfg.as_dict())
            self._divergences = rows.divergences(rule, min(result.accepted_count + 1, len(proposal.tokens)))
            self._pending_tests = (rule, result, rows, proposal.tokens, tokenizer)
            if cfg.inspect_top_n:
                pending = (cfg, result, rows, proposal.tokens, tokenizer)
                if rows.sparse:
                    self._pending_candidates = pending
                else:
                    self._candidates = _all_candidates(*pending)


class RoundRows:
    """A round's target rows T_1..T_{K+1} and draft rows D_1..D_K as numpy (dense or sparse per side)."""

    def __init__(self, target: tuple[np.ndarray | None, np.ndarray], draft: tuple[np.ndarray | None, np.ndarray],
                 vocab_size: int) -> None:
        self.target, self.draft, self.vocab_size = target, draft, vocab_size
        self.positions = target[1].shape[0]

    @property
    def sparse(self) -> bool:
        """Both sides as (ids, probs) rows: a few hundred bytes a position, cheap to keep."""
        return self.target[0] is not None and (self.draft[0] is not None or self.draft[1].shape[0] == 0)

    @staticmethod
    def of(ids: torch.Tensor | None, probs: torch.Tensor, proposal: Proposal) -> "RoundRows":
        def numpy(t: torch.Tensor | None) -> np.ndarray | None:
            return None if t is None else t.detach().cpu().numpy()

        draft = proposal.support if proposal.support is not None else (None, proposal.probs)
        return RoundRows((numpy(ids), numpy(probs).astype(np.float64)),
                         (numpy(draft[0]), numpy(draft[1]).astype(np.float64)), proposal.vocab_size)

    def divergences(self, rule: RuleSettings, n: int) -> list[PositionDivergence]:
        """`position_divergence` at the first n positions (the tested ones); in one native call where both
        sides are sparse (`sparse_position_divergences`)."""
        (t_ids, t_probs), (d_ids, d_probs) = self.target, self.draft
        if n and t_ids is not None and d_ids is not None:
            native = sparse_position_divergences(rule, (t_ids[:n], t_probs[:n]), (d_ids[:n], d_probs[:n]))
            if native is not None:
                return native
        return [position_divergence(rule, *self.on_union(pos)) for pos in range(n)]

    def on_union(self, pos: int) -> tuple[np.ndarray, np.ndarray]:
        """T_pos and D_pos on the union of their supports (the whole vocabulary if either is dense)."""
        (t_ids, t_probs), (d_ids, d_probs) = self.target, self.draft
        if t_ids is None or d_ids is None:
            return self.dense_target(pos), self.dense_draft(pos)
        support = np.union1d(t_ids[pos], d_ids[pos])
        return (_scatter(support, t_ids[pos], t_probs[pos]), _scatter(support, d_ids[pos], d_probs[pos]))

    def dense_target(self, pos: int) -> np.ndarray:
        return self._dense(*self.target, pos)

    def dense_draft(self, pos: int) -> np.ndarray:
        if pos >= self.draft[1].shape[0]:
            return np.zeros(self.vocab_size)
        return self._dense(*self.draft, pos)

    def _dense(self, ids: np.ndarray | None, probs: np.ndarray, pos: int) -> np.ndarray:
        if ids is None:
            return probs[pos]
        return _scatter(np.arange(self.vocab_size), ids[pos], probs[pos])


def _scatter(support: np.ndarray, ids: np.ndarray, probs: np.ndarray) -> np.ndarray:
    out = np.zeros(support.shape[0])
    np.add.at(out, np.searchsorted(support, ids), probs)
    return out


def _position_tests(rule: RuleSettings, result: RoundVerdict, rows: RoundRows, tokens: list[int],
                    tokenizer: PreTrainedTokenizerBase) -> tuple[PositionTest, ...]:
    tas = rule.method == "tas"
    u_accept = result.draws.u_accept.reshape(-1).tolist()
    tests = []
    for pos, token in enumerate(tokens):
        threshold = tas_threshold(rule, rows.target[1][pos]) if tas else None
        tests.append(PositionTest(
            position=pos + 1, token_id=token, text=tokenizer.decode([token]),
            target_prob=result.target_token_probs[pos], draft_prob=result.draft_token_probs[pos],
            gamma=None if tas else result.gamma_values[pos], acceptance_prob=result.acceptance_probs_values[pos],
            u=None if tas else u_accept[pos], threshold=threshold, passed=result.passed[pos]))
    return tuple(tests)


def _all_candidates(cfg: SpecConfig, result: RoundVerdict, rows: RoundRows, tokens: list[int],
                    tokenizer: PreTrainedTokenizerBase) -> list[tuple[Candidate, ...]]:
    return [_candidates(cfg, result, rows, tokens, pos, tokenizer) for pos in range(rows.positions)]


def _candidates(cfg: SpecConfig, result: RoundVerdict, rows: RoundRows, tokens: list[int], pos: int,
                tokenizer: PreTrainedTokenizerBase) -> tuple[Candidate, ...]:
    """Top candidates at one position with target, draft, h and residual probabilities."""
    t = rows.dense_target(pos)
    tested = pos < len(tokens)
    d = rows.dense_draft(pos)
    h = t
    if tested and cfg.method == "cactus":
        x, gamma = tokens[pos], result.gamma_values[pos]
        h = t * (1.0 - gamma) / (1.0 - t[x]) if t[x] < 1.0 else t.copy()
        h[x] = gamma
    residual = np.maximum(h - d, 0.0)
    residual = residual / max(float(residual.sum()), 1e-30)
    n = min(cfg.inspect_top_n, t.shape[0])
    score = t + d
    top = np.argpartition(-score, n - 1)[:n]
    top = top[np.argsort(-score[top], kind="stable")].tolist()
    return tuple(
        Candidate(i, tokenizer.decode([i]), float(t[i]), float(d[i]), float(h[i]), float(residual[i])) for i in top
    )

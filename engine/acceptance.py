"""Acceptance rules: SpS, TAS and Cactus as pure, batched tensor functions (ALGORITHMS.md §1–3).

Shapes: `target_probs` [B, K+1, V] (T_1..T_{K+1} from one target forward), `draft_probs` [B, K, V]
(the distributions D_i the drafted tokens were sampled from, after the same sampling transforms),
`draft_tokens` [B, K]. Nothing here calls a model.

Randomness: every call consumes exactly the same draws whatever the method — `u_accept` [B, K]
for the ratio tests and `u_sample` [B] for the recovered/bonus token (inverse-CDF sampling) — so
two methods given the same draws differ only by their rule. Cactus with δ = 0 therefore equals SpS
bit for bit.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import TYPE_CHECKING

import torch

from engine.sampling import SamplingParams, entropy, native_draw_settings, sample_from, sparse_probs
from engine.support_rows import SupportBlocks, SupportRows
from engine.uniform_stream import UniformStream

if TYPE_CHECKING:  # annotations only
    from engine.drafters import Proposal

METHODS = ("sps", "tas", "cactus")

TAS_LOG_EPS = 1e-5  # Medusa / vLLM entropy guard inside the TAS threshold


class RandomDraws:
    """The uniforms one verification round consumes: u_accept [B, K] for the ratio tests, then
    u_sample [B] for the recovered or bonus token.

    Taken from a `UniformStream`, they stay a span of its block until someone reads them as
    tensors; the native rule reads them by address (`addresses`), so a decode round builds none.
    """

    __slots__ = ("_u_accept", "_u_sample", "_span")

    def __init__(self, u_accept: torch.Tensor | None, u_sample: torch.Tensor | None) -> None:
        """Both tensors, or (from `take` only) neither: then they are read from the stream's span."""
        self._u_accept, self._u_sample = u_accept, u_sample
        self._span: tuple[torch.Tensor, int, int, int] | None = None  # (block, offset, k, address)

    @staticmethod
    def draw(batch: int, k: int, generator: torch.Generator | None = None) -> "RandomDraws":
        """u_accept then u_sample from the stream, drawn in one call (the same numbers as two calls:
        torch's CPU generator fills a tensor element by element)."""
        u = torch.rand(batch * (k + 1), generator=generator)
        return RandomDraws(u_accept=u[: batch * k].view(batch, k), u_sample=u[batch * k:])

    @staticmethod
    def take(stream: UniformStream, k: int) -> "RandomDraws":
        """One sequence's draws, the next k + 1 numbers of its stream: the same u_accept [1, k] and
        u_sample [1] as `draw(1, k, generator)` on that stream's generator."""
        draws = RandomDraws(None, None)
        block, at, address = stream.take_span(k + 1)
        draws._span = (block, at, k, address)
        return draws

    @property
    def u_accept(self) -> torch.Tensor:
        if self._u_accept is None:
            block, at, k, _ = self._span
            self._u_accept = block[at: at + k].view(1, k)
        return self._u_accept

    @property
    def u_sample(self) -> torch.Tensor:
        if self._u_sample is None:
            block, at, k, _ = self._span
            self._u_sample = block[at + k: at + k + 1]
        return self._u_sample

    def addresses(self) -> tuple[int, int]:
        """Where u_accept and u_sample start in memory, as float32 arrays (row-major, contiguous)."""
        if self._span is not None:
            _, _, k, start = self._span
            return start, start + 4 * k  # float32
        self._u_accept, self._u_sample = self.u_accept.contiguous(), self.u_sample.contiguous()  # kept alive
        return self._u_accept.data_ptr(), self._u_sample.data_ptr()


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of one round per row, plus per-position statistics for the UI.

    Per-position tensors are [B, K] and describe the test at each drafted position; positions after
    the first rejection were never reached and should be ignored (use `num_accepted`).
    """

    num_accepted: torch.Tensor  # [B] long: k
    next_tokens: torch.Tensor  # [B] long: recovered token (k < K) or bonus token (k = K)
    accepted: torch.Tensor  # [B, K] bool: the per-position test (before the first-rejection cut)
    target_token_probs: torch.Tensor  # [B, K]: T_i(x_i)
    draft_token_probs: torch.Tensor  # [B, K]: D_i(x_i)
    gamma: torch.Tensor  # [B, K]: h_i(x_i), the raised target prob (= T_i(x_i) for SpS)
    acceptance_probs: torch.Tensor  # [B, K]: P(accept x_i | x_i)
    kl: torch.Tensor  # [B, K]: Cactus's constraint KL(h_i || T_i) at position i, nats (0 for SpS and TAS)
    target_entropy: torch.Tensor  # [B, K+1]: H(T_i), nats
    draws: RandomDraws
    next_target_probs: torch.Tensor  # [B]: T of next_tokens at their position (T_{k+1})
    next_draft_probs: torch.Tensor  # [B]: D of next_tokens there (0 for a bonus token)


class RoundVerdict:
    """One sequence's round as Python values, what the decoding loop and its events read: the
    native rule hands them over in one conversion, and the batched `VerifyResult` tensors are built
    only if someone asks (`result`, and VerifyResult's own names for callers that index them)."""

    PER_POSITION = ("target_token_probs", "draft_token_probs", "gamma", "acceptance_probs", "kl", "target_entropy")

    def __init__(self, accepted_count: int, next_token: int, passed: list[bool], per_position: list[list[float]],
                 next_target_prob: float, next_draft_prob: float, draws: RandomDraws) -> None:
        self.accepted_count = accepted_count  # k
        self.next_token = next_token
        self.passed = passed  # the test at every drafted position, before the first-rejection cut
        # T_i(x_i), D_i(x_i), gamma, P(accept), KL (K entries each), H(T_i) (K+1 entries)
        (self.target_token_probs, self.draft_token_probs, self.gamma_values, self.acceptance_probs_values,
         self.kl_values, self.entropy_values) = per_position
        self.next_target_prob = next_target_prob
        self.next_draft_prob = next_draft_prob
        self.draws = draws
        self._result: VerifyResult | None = None

    @staticmethod
    def from_result(result: VerifyResult) -> "RoundVerdict":
        """Row 0 of a batched result."""
        verdict = RoundVerdict(int(result.num_accepted[0]), int(result.next_tokens[0]), result.accepted[0].tolist(),
                               [getattr(result, name)[0].tolist() for name in RoundVerdict.PER_POSITION],
                               float(result.next_target_probs[0]), float(result.next_draft_probs[0]), result.draws)
        verdict._result = result
        return verdict

    @property
    def result(self) -> VerifyResult:
        """The same outcome as [1, ...] tensors."""
        if self._result is None:
            rows = [self.target_token_probs, self.draft_token_probs, self.gamma_values, self.acceptance_probs_values,
                    self.kl_values]
            self._result = VerifyResult(
                num_accepted=torch.tensor([self.accepted_count]), next_tokens=torch.tensor([self.next_token]),
                accepted=torch.tensor([self.passed], dtype=torch.bool),
                **{name: torch.tensor([row]) for name, row in zip(self.PER_POSITION, rows)},
                target_entropy=torch.tensor([self.entropy_values]), draws=self.draws,
                next_target_probs=torch.tensor([self.next_target_prob]),
                next_draft_probs=torch.tensor([self.next_draft_prob]))
        return self._result

    num_accepted = property(lambda self: self.result.num_accepted)
    next_tokens = property(lambda self: self.result.next_tokens)
    accepted = property(lambda self: self.result.accepted)
    gamma = property(lambda self: self.result.gamma)


def cactus_gamma(target_token_probs: torch.Tensor, delta: float) -> torch.Tensor:
    """Closed-form γ* = min(q + sqrt(2 δ q (1 − q)), 1) (Cactus Cor. 5; q = target prob of x_i)."""
    q = target_token_probs
    return (q + torch.sqrt(2.0 * delta * q * (1.0 - q))).clamp(0.0, 1.0)


def binary_kl(gamma: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """KL(h || T) for h = Cactus's raised distribution: γ log(γ/q) + (1−γ) log((1−γ)/(1−q))."""

    def term(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.where(a > 0, a * (torch.log(a.clamp_min(1e-30)) - torch.log(b.clamp_min(1e-30))), 0.0)

    return term(gamma, q) + term(1.0 - gamma, 1.0 - q)


def cactus_h(target_probs: torch.Tensor, token: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """h (Cactus Thm 2): h(x) = γ for the drafted x, every other token rescaled by (1−γ)/(1−T(x)).

    When T(x) = 1 the scale is 0/0; the authors' code maps that NaN to 1, i.e. h = T.
    """
    q = target_probs.gather(-1, token.unsqueeze(-1))
    scale = torch.nan_to_num((1.0 - gamma.unsqueeze(-1)) / (1.0 - q), nan=1.0, posinf=1.0)
    return (target_probs * scale).scatter(-1, token.unsqueeze(-1), gamma.unsqueeze(-1))


def tas_threshold(target_probs: torch.Tensor, posterior_threshold: float, posterior_alpha: float) -> torch.Tensor:
    """min(ε, α · exp(−H(T))) with Medusa's entropy H = −Σ T log(T + 1e-5)."""
    h = -(target_probs * torch.log(target_probs + TAS_LOG_EPS)).sum(dim=-1)
    return torch.minimum(torch.full_like(h, posterior_threshold), posterior_alpha * torch.exp(-h))


def _check(method: str, target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor,
           delta: float, posterior_threshold: float, posterior_alpha: float) -> None:
    _check_rule(method, delta, posterior_threshold, posterior_alpha)
    if target_probs.dim() != 3 or draft_probs.dim() != 3 or draft_tokens.dim() != 2:
        raise ValueError("expected target_probs [B,K+1,V], draft_probs [B,K,V], draft_tokens [B,K]")
    b, k1, v = target_probs.shape
    if draft_probs.shape != (b, k1 - 1, v) or draft_tokens.shape != (b, k1 - 1):
        raise ValueError(
            f"shape mismatch: target_probs {tuple(target_probs.shape)}, draft_probs "
            f"{tuple(draft_probs.shape)}, draft_tokens {tuple(draft_tokens.shape)} "
            "(the vocabularies must match and target_probs needs K+1 positions)"
        )


def _check_rule(method: str, delta: float, posterior_threshold: float, posterior_alpha: float) -> None:
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {', '.join(METHODS)}")
    if not (delta >= 0.0 and math.isfinite(delta)):
        raise ValueError(f"delta (the Cactus KL budget) must be a finite number >= 0, got {delta}")
    if not (0.0 < posterior_threshold <= 1.0) or not (0.0 < posterior_alpha <= 1.0):
        raise ValueError("posterior_threshold and posterior_alpha must be in (0, 1]")


def verify(
    method: str,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    *,
    generator: torch.Generator | None = None,
    delta: float = 1.0,
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
    draws: RandomDraws | None = None,
) -> VerifyResult:
    """Decide how many drafted tokens each row keeps and the one extra token it emits.

    - `sps`: accept x_i iff u_i < min(1, T_i(x_i)/D_i(x_i)); recover from norm(max(T − D, 0)).
    - `cactus`: the same with T replaced by h (γ from the budget δ) at every tested position; the
      recovery uses norm(max(h − D, 0)); the bonus comes from the unmodified T_{K+1}.
    - `tas`: accept iff T_i(x_i) > min(ε, α e^{−H(T_i)}); recovery is argmax T (vLLM), the bonus is
      sampled from T_{K+1}. Deterministic apart from the bonus.
    """
    _check(method, target_probs, draft_probs, draft_tokens, delta, posterior_threshold, posterior_alpha)
    b, k = draft_tokens.shape
    target_probs = target_probs.float()
    draft_probs = draft_probs.float()
    if draws is None:
        draws = RandomDraws.draw(b, k, generator)
    u_accept = draws.u_accept.to(target_probs.device)
    u_sample = draws.u_sample.to(target_probs.device)

    tested_target = target_probs[:, :k]
    t_x = tested_target.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    d_x = draft_probs.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)

    if method == "tas":
        threshold = tas_threshold(tested_target, posterior_threshold, posterior_alpha)
        accepted = t_x > threshold
        gamma = accepted.float()
        acceptance_probs = accepted.float()
        kl = torch.zeros_like(t_x)  # TAS enforces no divergence constraint
    else:
        gamma = cactus_gamma(t_x, delta) if method == "cactus" else t_x
        # A drafted token always has D_i(x_i) > 0; the clamp only guards hand-made inputs.
        acceptance_probs = torch.clamp(gamma / d_x.clamp_min(1e-30), max=1.0)
        accepted = u_accept < acceptance_probs
        kl = binary_kl(gamma, t_x) if method == "cactus" else torch.zeros_like(t_x)

    num_accepted = torch.cumprod(accepted.long(), dim=-1).sum(dim=-1)
    next_tokens = _next_tokens(method, target_probs, draft_probs, draft_tokens, num_accepted, gamma, u_sample)
    rows = torch.arange(b, device=target_probs.device)
    drafted = num_accepted < k
    next_draft = draft_probs[rows, num_accepted.clamp(max=k - 1), next_tokens] if k else u_sample * 0
    return VerifyResult(
        num_accepted=num_accepted,
        next_tokens=next_tokens,
        accepted=accepted,
        target_token_probs=t_x,
        draft_token_probs=d_x,
        gamma=gamma,
        acceptance_probs=acceptance_probs,
        kl=kl,
        target_entropy=entropy(target_probs),
        draws=draws,
        next_target_probs=target_probs[rows, num_accepted, next_tokens],
        next_draft_probs=torch.where(drafted, next_draft, 0.0),
    )


def verify_on_support(method: str, target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor,
                      target_support: torch.Tensor | None, **kwargs) -> VerifyResult:
    """`verify` restricted to the columns of supp(T) ∪ {drafted tokens}: the same result at the
    cost of a few dozen columns instead of the 49k-token vocabulary (a K = 1 call on the default
    pair's vocabulary took 0.9 ms, on its 42 support columns 0.4 ms).

    Exact: every rule reads D only at the drafted tokens, and T, h, the residual max(h − D, 0) and
    the bonus are zero outside those columns. The columns stay in vocabulary order, so each
    inverse-CDF draw picks the same token as the full-vocabulary call. `target_support` holds token
    ids covering T's nonzero entries (any shape; repeats are fine), or None: the whole vocabulary.
    """
    if target_support is None:
        return verify(method, target_probs, draft_probs, draft_tokens, **kwargs)
    columns = torch.unique(torch.cat([target_support.flatten(), draft_tokens.flatten()]))  # sorted
    local_tokens = torch.searchsorted(columns, draft_tokens)
    result = verify(method, target_probs[..., columns], draft_probs[..., columns], local_tokens, **kwargs)
    return replace(result, next_tokens=columns[result.next_tokens])


def verify_logits(method: str, logits: torch.Tensor, params: SamplingParams, draft: Proposal, draws: RandomDraws, *,
                  delta: float = 1.0, posterior_threshold: float = 0.09,
                  posterior_alpha: float = 0.3) -> tuple[TargetRows, RoundVerdict]:
    """One sequence's round from the target's logits [K+1, V]: the sampling transform
    (`sampling.sparse_probs`'s rows T_1..T_{K+1}) and the rule on the kept support
    (`verify_on_support`), for the drafted tokens and their D_i in `draft` (dense or sparse rows).

    Where `sampling.native_support` applies and the kernels built, both are one native call
    (cpu_kernels.c `verify_logits`: the steps of `sparse_probs` and `verify` on the same columns in
    the same float32 / float64 precision, so the same draws give the same tokens up to float32
    rounding), handing back Python values in one conversion; otherwise the torch references run.
    Returns (T_1..T_{K+1} as (ids, probs) or (None, dense probs), the round's verdict).
    """
    k = len(draft.tokens)
    if logits.shape[0] != k + 1:
        raise ValueError(f"expected K+1 = {k + 1} rows of logits, got {logits.shape[0]}")
    plan = _native_plan(method, params, logits.shape[-1], delta, posterior_threshold, posterior_alpha) \
        if logits.is_cpu else None
    if plan is None:
        ids, probs = sparse_probs(logits, params)
        dense = probs if ids is None else torch.zeros(k + 1, draft.vocab_size, device=probs.device).scatter_(-1, ids, probs)
        tokens = torch.tensor([draft.tokens], dtype=torch.long, device=dense.device)
        return TargetRows(ids, probs), RoundVerdict.from_result(verify_on_support(
            method, dense.unsqueeze(0), draft.probs.to(dense.device).unsqueeze(0), tokens, ids, delta=delta,
            posterior_threshold=posterior_threshold, posterior_alpha=posterior_alpha, draws=draws))
    rule = NativeRule(plan, delta, posterior_threshold, posterior_alpha)
    rule.prepare(draft, draws)
    rule.run(logits)
    return rule.verdict()


class TargetRows:
    """A round's verified rows T_1..T_{K+1} under its sampling settings, as (ids [K+1, w], probs [K+1, w])
    or (None, dense probs [K+1, V]); given as tensors, or as `SupportRows` of a block that holds other
    rounds' rows too. `NativeRule` writes every round of a generation into one block, so a round nobody
    inspects (the benchmark, a page not asking) builds no tensor for them."""

    __slots__ = ("_ids", "_probs", "_rows")

    def __init__(self, ids: torch.Tensor | None, probs: torch.Tensor | None, rows: SupportRows | None = None) -> None:
        self._ids, self._probs, self._rows = ids, probs, rows

    @classmethod
    def of(cls, rows: SupportRows) -> TargetRows:
        return cls(None, None, rows)

    def tensors(self) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(ids or None, probs) of the round's rows only."""
        return self._rows.tensors() if self._rows is not None else (self._ids, self._probs)


class NativeRule:
    """`verify_logits`'s native path for one round's settings, built once per config snapshot: the
    sampling transform and the rule on the kept support as one native call (cpu_kernels.c
    `verify_logits`), on logits of its own (`run`) or inside the target's forward call, where the
    backend has one (`CausalLM.forward_with_rule`): there no Python step runs between the forward and
    the rule. A round is `prepare`, then the forward with the rule (or `run`), then `verdict`.

    One per generation: it holds the round's inputs and outputs between those calls."""

    def __init__(self, plan: tuple[int, float, float, int], delta: float, posterior_threshold: float,
                 posterior_alpha: float) -> None:
        """`plan` as `_native_plan` gives it (build with `for_settings`)."""
        from engine.models.cpu_kernels import RoundRuleArgs  # late, as `_kernels`

        width, temperature, top_p, code = plan
        self.width = width
        self.args = RoundRuleArgs(w=width, temperature=temperature, top_p=top_p, method=code, delta=delta,
                                  posterior_threshold=posterior_threshold, posterior_alpha=posterior_alpha)
        self._seconds = ctypes.c_double()
        self.pointers = (ctypes.pointer(self.args), ctypes.pointer(self._seconds))
        self._capacity = -1
        self._blocks = SupportBlocks()  # the output rows T_1..T_{K+1} of every round
        self._round: tuple = ()

    @staticmethod
    def for_settings(method: str, params: SamplingParams, vocab: int, delta: float = 1.0,
                     posterior_threshold: float = 0.09, posterior_alpha: float = 0.3) -> "NativeRule | None":
        """The native rule for these round settings over `vocab` target columns, or None where it does
        not apply (no or a large top-k, no kernels built): then `verify_logits`'s torch path runs."""
        plan = _native_plan(method, params, vocab, delta, posterior_threshold, posterior_alpha)
        return None if plan is None else NativeRule(plan, delta, posterior_threshold, posterior_alpha)

    @property
    def seconds(self) -> float:
        """The native rule's own time in the last forward that ran it (`forward_with_rule`)."""
        return self._seconds.value

    def prepare(self, draft: Proposal, draws: RandomDraws) -> None:
        """Point the call at this round's drafted tokens, their D_i (dense or sparse rows; by address
        where the drafter wrote them into `SupportRows`) and draws, and at the next unused rows of the
        output block (the round's events keep them)."""
        k = len(draft.tokens)
        out = self._blocks.take(k + 1, self.width)
        if k > self._capacity:  # the drafted tokens and the result block, grown to the largest K seen
            self._capacity = k
            self._tokens = (ctypes.c_int64 * max(k, 1))()
            self._stats = (ctypes.c_double * (8 * (k + 2)))()
            self.args.result = ctypes.addressof(self._stats)
        args = self.args
        kept = draft.rows  # the inputs kept alive until the call
        if kept is not None:
            args.d_ids, args.d_probs, args.d_w = kept.ids_address, kept.probs_address, kept.width
        elif draft.support is not None:
            kept = tuple(t.contiguous() for t in draft.support)
            args.d_ids, args.d_probs, args.d_w = kept[0].data_ptr(), kept[1].data_ptr(), kept[1].shape[-1]
        elif k:
            kept = draft.probs.float().contiguous()
            args.d_ids, args.d_probs, args.d_w = None, kept.data_ptr(), kept.shape[-1]
        else:
            args.d_ids, args.d_probs, args.d_w = None, None, draft.vocab_size
        if k:
            self._tokens[:k] = draft.tokens
        args.k = k
        args.tokens = ctypes.addressof(self._tokens) if k else None
        args.u_accept, args.u_sample = draws.addresses()
        args.t_ids, args.t_probs = out.ids_address, out.probs_address
        self._round = (k, out, draws, kept)

    def run(self, logits: torch.Tensor) -> None:
        """The prepared round on logits [K+1, V] (their own call, for logits the forward did not rule on)."""
        if logits.dtype != torch.float32 or not logits.is_contiguous():  # each no-op cast costs ~10 us cold
            logits = logits.detach().float().contiguous()
        _kernels().verify_logits(logits.data_ptr(), logits.shape[1], self.pointers[0])

    def verdict(self) -> tuple[TargetRows, RoundVerdict]:
        """The prepared round's (T_1..T_{K+1} on their support, verdict) once the call ran."""
        k, out, draws, _ = self._round
        self._round = ()
        r = k + 2
        # Rows of r values (cpu_kernels.c verify_logits): five per-position rows (K each), H(T_i) (K+1),
        # the next token's T and D, then k, y and the K tests. Slices spelled out, not comprehensions:
        # their frames cost ~5 us with the caches cold after the forward.
        values = self._stats[: 8 * r]
        per_position = [values[:k], values[r: r + k], values[2 * r: 2 * r + k], values[3 * r: 3 * r + k],
                        values[4 * r: 4 * r + k], values[5 * r: 5 * r + k + 1]]
        passed = list(map(bool, values[7 * r + 2: 7 * r + 2 + k]))
        return TargetRows.of(out), RoundVerdict(
            int(values[7 * r]), int(values[7 * r + 1]), passed, per_position, values[6 * r], values[6 * r + 1], draws)


@lru_cache(maxsize=64)
def _native_plan(method: str, params: SamplingParams, vocab: int, delta: float, posterior_threshold: float,
                 posterior_alpha: float) -> tuple[int, float, float, int] | None:
    """(support width, temperature, top-p, rule code) of the native call for these round settings, or
    None where it does not apply: worked out and checked once per settings, not every round (the
    checks cost ~25 us with the caches cold after a forward, a tenth of AR's time outside its forward)."""
    draw = native_draw_settings(params, vocab)
    if draw is None:
        return None
    _check_rule(method, delta, posterior_threshold, posterior_alpha)
    return *draw, RULE_CODES[method]


RULE_CODES = {"sps": 0, "tas": 1, "cactus": 2}  # the native kernels' rule codes (cpu_kernels.c)


def _kernels():
    """The sampling kernels (see engine.sampling._kernels for why they are looked up late)."""
    from engine.sampling import _kernels as kernels

    return kernels()


def _next_tokens(method: str, target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor,
                 num_accepted: torch.Tensor, gamma: torch.Tensor, u_sample: torch.Tensor) -> torch.Tensor:
    """Recovered token at the first rejected position, or the bonus token from T_{K+1}.

    Only one [B, V] row per sequence is touched. Bonus rows use a zero draft row, so the same
    residual formula yields T_{K+1} unchanged.
    """
    b, k = draft_tokens.shape
    rows = torch.arange(b, device=target_probs.device)
    stop = num_accepted  # index of the first rejected position, or K for the bonus
    target_row = target_probs[rows, stop]
    is_bonus = stop == k
    if k == 0:
        return sample_from(target_row, u_sample)
    safe = stop.clamp(max=k - 1)
    draft_row = torch.where(is_bonus.unsqueeze(-1), 0.0, draft_probs[rows, safe])
    if method == "tas":
        greedy = target_row.argmax(dim=-1)
        return torch.where(is_bonus, sample_from(target_row, u_sample), greedy)
    if method == "cactus":
        h = cactus_h(target_row, draft_tokens[rows, safe], gamma[rows, safe])
        target_row = torch.where(is_bonus.unsqueeze(-1), target_row, h)
    residual = (target_row - draft_row).clamp_min(0.0)
    # A rejection with zero residual mass can only come from rounding (h == D); fall back to h.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, target_row, residual)
    return sample_from(residual, u_sample)


def induced_distribution(
    method: str,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    *,
    delta: float = 1.0,
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
    chunk: int = 256,
) -> torch.Tensor:
    """Exact distribution [V] of the first token a round emits, marginalised over the drafted token.

    P(v) = D(v)·a(v) + Σ_n D(n)·(1 − a(n))·g_n(v), with a(n) the acceptance probability of drafted
    n and g_n the normalised recovery distribution after rejecting n, written out literally: the
    reference the tests hold the sampler and `engine.divergence` (the O(V log V) form the
    playground and the benchmark use) to. SpS gives T exactly; TAS is O(V). Cactus's h depends on n,
    so the sum runs over the draft's support in chunks (O(|supp D| · V)).
    """
    _check(method, target_probs.view(1, 1, -1).expand(1, 2, -1), draft_probs.view(1, 1, -1),
           torch.zeros(1, 1, dtype=torch.long), delta, posterior_threshold, posterior_alpha)
    t = target_probs.double()
    d = draft_probs.double()
    if method == "tas":
        accept = t > tas_threshold(t, posterior_threshold, posterior_alpha)
        out = torch.where(accept, d, 0.0)
        out[t.argmax()] += (d * (~accept).double()).sum()
        return out
    if method == "sps":
        # P(reject) = Σ max(T − D, 0) is the residual's own normaliser, so the sum is T exactly.
        return torch.minimum(t, d) + (t - d).clamp_min(0.0)
    support = torch.nonzero(d > 0).squeeze(-1)
    gamma_all = cactus_gamma(t, delta)
    accept_all = torch.where(d > 0, torch.clamp(gamma_all / d.clamp_min(1e-300), max=1.0), 0.0)
    out = d * accept_all
    for start in range(0, support.numel(), chunk):
        n = support[start:start + chunk]
        h = cactus_h(t.expand(n.numel(), -1), n, gamma_all[n])
        residual = (h - d).clamp_min(0.0)
        z = residual.sum(dim=-1, keepdim=True)
        g = torch.where(z > 0, residual / z.clamp_min(1e-300), h)
        out += ((d[n] * (1.0 - accept_all[n])).unsqueeze(-1) * g).sum(dim=0)
    return out


def kl_divergence(p: torch.Tensor, q: torch.Tensor) -> float:
    """KL(p || q) in nats over the last dimension, for reporting induced-vs-target divergence."""
    p = p.double()
    q = q.double()
    mask = p > 0
    return float((p[mask] * (torch.log(p[mask]) - torch.log(q[mask].clamp_min(1e-300)))).sum())

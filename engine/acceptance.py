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

import math
import warnings
from dataclasses import dataclass, replace

import torch

from engine.sampling import entropy, sample_from

METHODS = ("sps", "tas", "cactus")

_TAS_LOG_EPS = 1e-5  # Medusa / vLLM entropy guard inside the TAS threshold


@dataclass(frozen=True)
class RandomDraws:
    """The uniforms one verification round consumes."""

    u_accept: torch.Tensor  # [B, K]
    u_sample: torch.Tensor  # [B]

    @staticmethod
    def draw(batch: int, k: int, generator: torch.Generator | None = None) -> "RandomDraws":
        return RandomDraws(
            u_accept=torch.rand(batch, k, generator=generator),
            u_sample=torch.rand(batch, generator=generator),
        )


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
    kl: torch.Tensor  # [B, K]: KL(h_i || T_i) spent at position i, nats
    target_entropy: torch.Tensor  # [B, K+1]: H(T_i), nats
    draws: RandomDraws


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
    h = -(target_probs * torch.log(target_probs + _TAS_LOG_EPS)).sum(dim=-1)
    return torch.minimum(torch.full_like(h, posterior_threshold), posterior_alpha * torch.exp(-h))


def _check(method: str, target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor,
           delta: float, posterior_threshold: float, posterior_alpha: float) -> None:
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {', '.join(METHODS)}")
    if target_probs.dim() != 3 or draft_probs.dim() != 3 or draft_tokens.dim() != 2:
        raise ValueError("expected target_probs [B,K+1,V], draft_probs [B,K,V], draft_tokens [B,K]")
    b, k1, v = target_probs.shape
    if draft_probs.shape != (b, k1 - 1, v) or draft_tokens.shape != (b, k1 - 1):
        raise ValueError(
            f"shape mismatch: target_probs {tuple(target_probs.shape)}, draft_probs "
            f"{tuple(draft_probs.shape)}, draft_tokens {tuple(draft_tokens.shape)} "
            "(the vocabularies must match and target_probs needs K+1 positions)"
        )
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
        # h is a point mass: on x_i if accepted, on argmax T_i if rejected (Cactus Prop. 4 reading).
        t_max = tested_target.max(dim=-1).values
        kl = -torch.log(torch.where(accepted, t_x, t_max).clamp_min(1e-30))
    else:
        gamma = cactus_gamma(t_x, delta) if method == "cactus" else t_x
        # A drafted token always has D_i(x_i) > 0; the clamp only guards hand-made inputs.
        acceptance_probs = torch.clamp(gamma / d_x.clamp_min(1e-30), max=1.0)
        accepted = u_accept < acceptance_probs
        kl = binary_kl(gamma, t_x) if method == "cactus" else torch.zeros_like(t_x)

    num_accepted = torch.cumprod(accepted.long(), dim=-1).sum(dim=-1)
    next_tokens = _next_tokens(method, target_probs, draft_probs, draft_tokens, num_accepted, gamma, u_sample)
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
    max_support: int | None = None,
    chunk: int = 256,
) -> torch.Tensor:
    """Exact distribution [V] of the first token a round emits, marginalised over the drafted token.

    P(v) = D(v)·a(v) + Σ_n D(n)·(1 − a(n))·g_n(v), with a(n) the acceptance probability of drafted
    n and g_n the normalised recovery distribution after rejecting n. SpS gives T exactly; TAS is
    O(V). Cactus's h depends on n, so the sum runs over the draft's support in chunks
    (O(|supp D| · V)). `max_support` bounds that work: the rejection terms of drafted tokens beyond
    the `max_support` most likely ones are then approximated by the SpS residual, and a warning
    says how much probability mass that approximation covers.
    """
    _check(method, target_probs.view(1, 1, -1).expand(1, 2, -1), draft_probs.view(1, 1, -1),
           torch.zeros(1, 1, dtype=torch.long), delta, posterior_threshold, posterior_alpha)
    t = target_probs.double()
    d = draft_probs.double()
    if method == "tas":
        accept = t > tas_threshold(t, posterior_threshold, posterior_alpha)
        out = torch.where(accept, d, 0.0)
        out[t.argmax()] += (d * (~accept).double()).sum()
        return out.float()
    if method == "sps":
        # P(reject) = Σ max(T − D, 0) is the residual's own normaliser, so the sum is T exactly.
        return (torch.minimum(t, d) + (t - d).clamp_min(0.0)).float()
    support = torch.nonzero(d > 0).squeeze(-1)
    support = support[torch.argsort(d[support], descending=True)]
    gamma_all = cactus_gamma(t, delta)
    accept_all = torch.where(d > 0, torch.clamp(gamma_all / d.clamp_min(1e-300), max=1.0), 0.0)
    out = d * accept_all
    exact, tail = (support, support[:0]) if max_support is None else (support[:max_support], support[max_support:])
    for start in range(0, exact.numel(), chunk):
        n = exact[start:start + chunk]
        h = cactus_h(t.expand(n.numel(), -1), n, gamma_all[n])
        residual = (h - d).clamp_min(0.0)
        z = residual.sum(dim=-1, keepdim=True)
        g = torch.where(z > 0, residual / z.clamp_min(1e-300), h)
        out += ((d[n] * (1.0 - accept_all[n])).unsqueeze(-1) * g).sum(dim=0)
    if tail.numel():
        tail_mass = (d[tail] * (1.0 - accept_all[tail])).sum()
        warnings.warn(
            f"induced_distribution truncated to the {max_support} most likely draft tokens; "
            f"{float(tail_mass):.3g} of probability mass uses the SpS residual as an approximation",
            stacklevel=2,
        )
        residual = (t - d).clamp_min(0.0)
        out += tail_mass * residual / residual.sum().clamp_min(1e-300)
    return out.float()


def kl_divergence(p: torch.Tensor, q: torch.Tensor) -> float:
    """KL(p || q) in nats over the last dimension, for reporting induced-vs-target divergence."""
    p = p.double()
    q = q.double()
    mask = p > 0
    return float((p[mask] * (torch.log(p[mask]) - torch.log(q[mask].clamp_min(1e-300)))).sum())

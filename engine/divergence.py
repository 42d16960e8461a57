"""The exact divergence of what a round emits, at one tested position, in O(V log V).

The one divergence the playground reports is KL(P ‖ T), where P is the distribution of the token a
rule emits at a tested position (drafted token kept, or the recovery after its rejection) and T is
the target's distribution there, both under the round's sampling settings. It is computed on the
full support of T and D (the whole vocabulary when nothing truncates them), with numpy, so it is
cheap enough for every tested position and runs on any thread without opening a torch/OpenMP team
(see `playground.engine_loop` for why that matters on 2 cores).

`engine.acceptance.induced_distribution` is the literal formula, P(v) = D(v)·a(v) + Σ_n D(n)(1 − a(n))·g_n(v),
which costs O(|supp D|·V) for Cactus; the tests hold this module to it. The fast form rests on one
observation about Cactus (Thm 2): after rejecting drafted n, h_n = s_n·T off n with
s_n = (1 − γ_n)/(1 − T(n)), and the rejection (D(n) > γ_n) leaves no residual at n, so
max(h_n − D, 0) = T·max(s_n − D/T, 0) depends on n only through the scalar s_n. Sorting tokens by
D/T and rejected drafts by s_n turns the sum over n into prefix and suffix sums.

Where both rows are sparse (top-k: a few dozen ids), a round's positions go to one native call
instead (`sparse_position_divergences`): the literal formula on the union of the two supports, run
without the GIL that the engine's thread needs between its forwards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from engine.acceptance import RULE_CODES, TAS_LOG_EPS


@dataclass(frozen=True)
class PositionDivergence:
    """Divergences from the target at one tested position, nats."""

    induced_kl: float  # KL(P ‖ T): the distribution the rule emits here (0 for SpS)
    draft_kl: float  # KL(D ‖ T): sampling the draft alone; Cactus Thm 3 bounds induced_kl by it (inf: D leaves T's support)


@dataclass(frozen=True)
class RuleSettings:
    method: str  # sps | tas | cactus (ar and ssd verify losslessly: sps)
    delta: float = 1.0
    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3

    @staticmethod
    def from_config(config: dict) -> "RuleSettings":
        method = config.get("method", "sps")
        return RuleSettings("sps" if method in ("ar", "ssd") else method, float(config.get("delta", 1.0)),
                            float(config.get("posterior_threshold", 0.09)), float(config.get("posterior_alpha", 0.3)))


def sparse_position_divergences(rule: RuleSettings, target: tuple[np.ndarray, np.ndarray],
                                draft: tuple[np.ndarray, np.ndarray]) -> list[PositionDivergence] | None:
    """`position_divergence` at every position of sparse rows, target (ids, probs) [P, w_t] and draft
    (ids, probs) [P, w_d], in one native call (cpu_kernels.c `position_divergences`, the same formulas
    on the union of each position's supports); None without the kernels. Why native: in numpy a Cactus
    round's divergences took 0.1-0.3 ms of Python holding the GIL on the page's thread, and the engine's
    thread waits for the GIL after every forward (a side thread folding every 0.2 s cost the engine 5 %,
    AMD EPYC Zen 4); the ctypes call runs without it."""
    from engine.sampling import _kernels as kernels  # lazily: engine.models imports the drafters

    lib = kernels()
    if lib is None:
        return None
    t_ids, d_ids = (np.ascontiguousarray(ids, dtype=np.int64) for ids in (target[0], draft[0]))
    t_probs, d_probs = (np.ascontiguousarray(probs, dtype=np.float64) for probs in (target[1], draft[1]))
    out = np.empty((t_ids.shape[0], 2))
    lib.position_divergences(t_ids.shape[0], t_ids.ctypes.data, t_probs.ctypes.data, t_ids.shape[1],
                             d_ids.ctypes.data, d_probs.ctypes.data, d_ids.shape[1], RULE_CODES[rule.method],
                             rule.delta, rule.posterior_threshold, rule.posterior_alpha, out.ctypes.data)
    return [PositionDivergence(induced, draft_alone) for induced, draft_alone in out.tolist()]


def induced_distribution(rule: RuleSettings, target: np.ndarray, draft: np.ndarray) -> np.ndarray:
    """Exact P over the given support (float64), for target and draft rows that hold all their mass there."""
    t = np.asarray(target, dtype=np.float64)
    d = np.asarray(draft, dtype=np.float64)
    if rule.method == "sps":
        return t.copy()  # min(T, D) + max(T − D, 0) = T
    if rule.method == "tas":
        accept = t > tas_threshold(rule, t)
        out = np.where(accept, d, 0.0)
        out[int(np.argmax(t))] += float(d[~accept].sum())
        return out
    if rule.method != "cactus":
        raise ValueError(f"no induced distribution for method {rule.method!r}")
    return _cactus_induced(t, d, rule.delta)


def tas_threshold(rule: RuleSettings, target: np.ndarray) -> float:
    """TAS's min(ε, α·e^(−H(T))) with Medusa's H = −Σ T log(T + 1e-5) (as `engine.acceptance.tas_threshold`)."""
    entropy = -float(np.sum(target * np.log(target + TAS_LOG_EPS)))
    return min(rule.posterior_threshold, rule.posterior_alpha * math.exp(-entropy))


def _cactus_induced(t: np.ndarray, d: np.ndarray, delta: float) -> np.ndarray:
    gamma = np.clip(t + np.sqrt(2.0 * delta * t * (1.0 - t)), 0.0, 1.0)  # Cor. 5
    with np.errstate(divide="ignore", invalid="ignore"):
        accept = np.where(d > 0, np.minimum(gamma / d, 1.0), 0.0)
    out = d * accept
    rejected = np.nonzero(d * (1.0 - accept) > 0)[0]
    if rejected.size == 0:
        return out
    weight = d[rejected] * (1.0 - accept[rejected])  # P(draft n, reject n)
    scale = (1.0 - gamma[rejected]) / (1.0 - t[rejected])  # s_n; T(n) = 1 implies γ = 1 ≥ D, never rejected
    # Tokens by ρ = D/T: the residual after rejecting n is positive exactly on {ρ < s_n}, a prefix.
    with np.errstate(divide="ignore", invalid="ignore"):
        rho = np.where(t > 0, d / t, np.inf)
    order = np.argsort(rho, kind="stable")
    rho_sorted = rho[order]
    cum_t = np.concatenate(([0.0], np.cumsum(t[order])))
    cum_d = np.concatenate(([0.0], np.cumsum(d[order])))
    prefix = np.searchsorted(rho_sorted, scale, side="left")
    z = scale * cum_t[prefix] - cum_d[prefix]  # Σ_v max(s_n T(v) − D(v), 0)
    spread = z > 0
    # Residual recoveries: out(v) += Σ_{n: s_n > ρ(v)} w_n/Z_n · (s_n T(v) − D(v)), by suffix sums over s_n.
    s_n, a_n, b_n = scale[spread], weight[spread] * scale[spread] / z[spread], weight[spread] / z[spread]
    by_scale = np.argsort(s_n, kind="stable")
    s_sorted = s_n[by_scale]
    suffix_a = np.concatenate((np.cumsum(a_n[by_scale][::-1])[::-1], [0.0]))
    suffix_b = np.concatenate((np.cumsum(b_n[by_scale][::-1])[::-1], [0.0]))
    first = np.searchsorted(s_sorted, rho, side="right")
    out += np.where(np.isfinite(rho), t * suffix_a[first] - d * suffix_b[first], 0.0)
    # A rejection with no residual mass recovers from h_n itself (as the sampler does).
    for n, w, s in zip(rejected[~spread], weight[~spread], scale[~spread]):
        out += w * s * t
        out[n] += w * (gamma[n] - s * t[n])
    return out


def kl(p: np.ndarray, q: np.ndarray) -> float:
    """KL(p ‖ q) in nats; inf where p has mass that q does not."""
    p = np.asarray(p, dtype=np.float64)
    q = np.asarray(q, dtype=np.float64)
    mass = p > 0
    if np.any(q[mass] <= 0):
        return math.inf
    return max(float(np.sum(p[mass] * (np.log(p[mass]) - np.log(q[mass])))), 0.0)


def position_divergence(rule: RuleSettings, target: np.ndarray, draft: np.ndarray) -> PositionDivergence:
    """The induced divergence and the draft-alone divergence at one tested position.

    Both rows are renormalised in float64 first: float32 probabilities sum to 1 only within ~1e-7,
    and KL of rows with unequal mass has a first-order term of that size (SpS would read 3e-8).
    """
    target = np.asarray(target, dtype=np.float64)
    draft = np.asarray(draft, dtype=np.float64)
    target, draft = target / target.sum(), draft / draft.sum()
    return PositionDivergence(kl(induced_distribution(rule, target, draft), target), kl(draft, target))

"""The Learn tab's presets: each one setting of the knobs and the one claim it teaches.

Every claim is checked against the exact divergence (`engine.divergence`) on the default pair by
tests/test_presets.py, so a lesson the page teaches is one the numbers show.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    name: str
    prompt: str
    method: str
    k: int
    delta: float
    temperature: float
    top_p: float
    top_k: int
    posterior_threshold: float
    posterior_alpha: float
    look_for: str


PRESETS = {
    p.name: p for p in (
        Preset("High-entropy prompt: TAS drifts, Cactus holds",
               "Write a list of twenty random, unrelated words.", "tas", 4, 0.5, 1.0, 1.0, 0, 0.09, 0.3,
               "A flat target makes TAS's threshold min(ε, α·e^{−H}) tiny, so it keeps drafts the target finds "
               "unlikely and recovers with argmax T: watch its KL per token. Switch the method to Cactus: "
               "each position may only spend δ nats."),
        Preset("Greedy: every rule is the same",
               "Explain why the sky is blue in simple terms.", "sps", 4, 1.0, 0.0, 1.0, 0, 0.09, 0.3,
               "At temperature 0 both distributions are one-hot, so SpS, TAS and Cactus all reduce to "
               "'keep the draft iff it equals the target's argmax'. KL stays 0."),
        Preset("δ = 0: Cactus is SpS",
               "Tell me a bedtime story about a small dragon.", "cactus", 4, 0.0, 0.8, 0.95, 40, 0.09, 0.3,
               "γ = T(x) when δ = 0, so Cactus accepts with min(1, T/D) exactly like SpS and spends no KL."),
        Preset("Long drafts: later positions collapse",
               "Write a Python function that checks whether a string is a palindrome.", "sps", 8, 1.0, 0.7, 0.95,
               40, 0.09, 0.3,
               "With K = 8 a round stops at the first rejection, so position 8 is reached only if 1–7 all "
               "passed: the acceptance-per-position chart falls off."),
    )
}

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
    claim: str  # the one thing the preset shows, true on the default pair (tests/test_presets.py)
    look_for: str  # where on the page to see it


STORY = "Tell me a bedtime story about a small dragon."

PRESETS = {
    p.name: p for p in (
        Preset("Paper sampling: more drafts kept, less divergence than TAS",
               STORY, "cactus", 4, 1.0, 0.6, 0.95, 20, 0.09, 0.3,
               "At the Cactus paper's sampling (T 0.6, top-p 0.95, top-k 20), Cactus with δ = 1 keeps more drafts "
               "than TAS (ε 0.09, α 0.3) while what it emits is closer to the target: on the default pair, over four "
               "seeds, draft acceptance 0.31 against 0.27 and KL(induced ‖ T) 0.19 against 0.25 nats per tested "
               "position (Intel Xeon; another CPU's rounding takes slightly different trajectories).",
               "Run it with Cactus, then switch the method to TAS and run again: compare the status line's "
               "KL(induced ‖ T) and draft acceptance. A single seed can go either way; the claim is over several."),
        Preset("No truncation at T = 1: Cactus lifts the tail",
               STORY, "cactus", 4, 1.0, 1.0, 1.0, 0, 0.09, 0.3,
               "Without top-k or top-p the target's tail is long, and γ = T + √(2δ·T(1−T)) lifts every tail token "
               "the draft proposes far above its T (T = 0.001 becomes γ ≈ 0.046 at δ = 1). Cactus then keeps 0.86 of "
               "its drafts against 0.30 for TAS, but what it emits diverges more (KL(induced ‖ T) 1.07 against 0.57 "
               "nats, two seeds) and the text drifts. It still never exceeds Theorem 3's ceiling KL(D ‖ T) at any "
               "position: δ bounds each step's KL(h ‖ T), not the output.",
               "At the accept stage a tail draft has a tiny T(x) but a γ many times larger; on the Generate tab the "
               "divergence chart's diamonds (induced) sit above the δ line and below the crosses (draft alone)."),
        Preset("Greedy: every rule is the same",
               "Explain why the sky is blue in simple terms.", "sps", 4, 1.0, 0.0, 1.0, 0, 0.09, 0.3,
               "At temperature 0 both distributions are one-hot, so SpS, TAS and Cactus all reduce to 'keep the "
               "draft iff it is the target's argmax': the three emit the same tokens and KL(induced ‖ T) is 0.",
               "Every P(accept) is 0 or 1, every recovery is the target's argmax; switch methods: nothing changes."),
        Preset("δ = 0: Cactus is SpS",
               STORY, "cactus", 4, 0.0, 0.8, 0.95, 40, 0.09, 0.3,
               "γ = T(x) when δ = 0, so Cactus accepts with min(1, T/D) exactly as SpS does: with the same seed it "
               "emits the same tokens, and both have KL(induced ‖ T) = 0.",
               "γ equals T(x) at every position and the residual is SpS's norm(max(T − D, 0))."),
        Preset("Long drafts: later positions collapse",
               "Write a Python function that checks whether a string is a palindrome.", "sps", 8, 1.0, 0.7, 0.95,
               40, 0.09, 0.3,
               "A round stops at its first rejection, so position i is reached only if positions 1 … i−1 all "
               "passed: the share of rounds that keep position i falls with i, and position 8 is kept in less than "
               "a tenth as many rounds as position 1.",
               "The accept stage marks everything after the first rejection as not reached; on the Generate tab the "
               "acceptance-per-position chart falls off."),
    )
}

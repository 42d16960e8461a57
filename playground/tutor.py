"""Learn tab: one round at a time, in the stages a workshop explains, next to the live numbers.

`explain_stage` is a pure function of a finished round (its RoundEvent and TokenEvents); the app
pulls one round from a paused engine generator per "next round" and walks its stages.
"""

from __future__ import annotations

from dataclasses import dataclass

import plotly.graph_objects as go

from engine.events import RoundEvent, TokenEvent
from playground.charts import figure
from playground.state import STATUS_COLOURS, RunState

STAGES = ("draft", "verify", "accept / reject", "recover / bonus", "cache lookup (SSD)")


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


def _t(text: str | None) -> str:
    return "∅" if text is None else (repr(text)[1:-1] or "·")


def explain_stage(rnd: RoundEvent, tokens: list[TokenEvent], stage: int) -> str:
    """Markdown for one stage of one round, with that round's numbers."""
    method, k, m = rnd.method, rnd.num_draft_tokens, rnd.num_accepted
    accepted = [t for t in tokens if t.status == "accepted"]
    last = tokens[-1] if tokens else None
    head = f"### Round {rnd.round_index} · stage {stage + 1}/{len(STAGES)}: {STAGES[stage]}\n"
    if method == "ar":
        return head + ("AR has no draft: the target runs once and samples one token "
                       f"(`{_t(last.text if last else None)}`, T = {last.target_prob:.3f}) in "
                       f"{rnd.verify_seconds * 1e3:.1f} ms." if last else "")
    if stage == 0:
        drafted = [f"`{_t(t.text)}` (D = {t.draft_prob:.3f})" for t in accepted]
        if rnd.rejected_text is not None:
            drafted.append(f"`{_t(rnd.rejected_text)}`")
        hidden = k - len(drafted)
        return head + (
            f"The draft model proposed **K = {k}** tokens one after another, each sampled from its own "
            f"distribution D ({rnd.draft_seconds * 1e3:.1f} ms): " + ", ".join(drafted)
            + (f", and {hidden} more after the first rejection (never needed)." if hidden > 0 else ".")
        )
    if stage == 1:
        return head + (
            f"The target scored all **K + 1 = {k + 1}** positions in **one** forward pass "
            f"({rnd.verify_seconds * 1e3:.1f} ms), giving T at each drafted position and one more for a bonus. "
            "One target pass instead of K+1 is where the speed comes from."
        )
    if stage == 2:
        rule = {
            "sps": "SpS keeps draft x with probability **min(1, T(x)/D(x))**: lossless.",
            "cactus": f"Cactus first raises T(x) to **γ = T + √(2δ·T(1−T))** (δ = {rnd.config.get('delta')}), "
                      "then keeps x with probability min(1, γ/D(x)); the KL(h‖T) this costs is at most δ.",
            "tas": f"TAS keeps x iff **T(x) > min(ε, α·e^(−H(T)))** (ε = {rnd.config.get('posterior_threshold')}, "
                   f"α = {rnd.config.get('posterior_alpha')}): no randomness, no budget.",
        }[method]
        lines = []
        for t in tokens:
            if t.acceptance_prob is None:
                continue
            verdict = "kept" if t.status == "accepted" else f"rejected `{_t(rnd.rejected_text)}`"
            gamma = f", γ = {t.gamma:.3f}" if t.gamma is not None else ""
            lines.append(f"- position {t.draft_position}: P(accept) = {t.acceptance_prob:.3f}{gamma} → {verdict}")
        return head + rule + "\n\n" + "\n".join(lines) + (
            f"\n\nThe round keeps the first **{m}** of {k}: everything after the first rejection is discarded."
        )
    if stage == 3:
        if last is None:
            return head
        if last.status == "recovered":
            source = "argmax T (vLLM's TAS recovery)" if method == "tas" else "the residual norm(max(h − D, 0))"
            return head + (f"Position {last.draft_position} was rejected, so a **recovered** token "
                           f"`{_t(last.text)}` was drawn from {source}. This is what keeps SpS exact. "
                           f"The round emitted {rnd.num_emitted} token(s), KL spent {rnd.kl:.4f} nats.")
        return head + (f"All {k} drafts were kept, so the target's extra position gives a free **bonus** token "
                       f"`{_t(last.text)}` (T = {last.target_prob:.3f}). The round emitted {rnd.num_emitted} tokens.")
    return head + ("With SSD (the SSD method on the Generate tab), the draft worker would already have pre-computed "
                   "the next round for the likely outcomes (number accepted, next token) while the target verified "
                   "this one; a cache hit skips drafting, a miss runs the backup speculator.")


def round_figure(rnd: RoundEvent, tokens: list[TokenEvent]) -> go.Figure:
    """Bars of P(accept) per tested position, coloured by what happened."""
    tested = [t for t in tokens if t.acceptance_prob is not None]
    trace = {"type": "bar", "y": [t.acceptance_prob for t in tested],
             "x": [f"{t.draft_position}: {_t(t.text) if t.status == 'accepted' else _t(rnd.rejected_text)}"
                   for t in tested],
             "marker": {"color": [STATUS_COLOURS["accepted"] if t.status == "accepted" else "#d62728" for t in tested]}}
    return figure([trace], f"Round {rnd.round_index}: P(accept) per drafted position (green kept, red rejected)",
                  "position: drafted token", "P(accept)", height=260, yaxis={"range": [0, 1.05]})


def round_tokens(state: RunState, round_index: int) -> list[TokenEvent]:
    return [t for t in state.tokens if t.round_index == round_index]

"""Learn tab: one round at a time, in the stages a workshop explains, next to the live numbers.

Every function here is pure: it reads a finished round (its RoundEvent and TokenEvents, whose
`round_tests` hold each drafted position's test) and returns what one stage shows. A stage shows
only what the algorithm has computed by then, so the draft stage cannot give away which drafts
the target keeps, and the accept stage lists every number needed to redo each decision by hand.
"""

from __future__ import annotations

import plotly.graph_objects as go

from engine.events import Candidate, PositionTest, RoundEvent, TokenEvent
from playground.charts import figure
from playground.state import STATUS_COLOURS, RunState, reduce, summary

STAGES = ("draft", "verify", "accept / reject", "recover / bonus")  # a speculative round
AR_STAGES = ("the target samples one token",)  # AR, and a round with no room left to draft
ACCEPT_STAGE = STAGES.index("accept / reject")
REJECTED_COLOUR = "#d62728"
NEUTRAL_COLOUR = "#7f7f7f"
NOT_REACHED = "not reached (after the first rejection)"
TOP_ENTRIES = 5


def _sampled_only(rnd: RoundEvent) -> bool:
    """AR, or a round with no room left to draft: one target sample, nothing to test."""
    return rnd.method == "ar" or rnd.num_draft_tokens == 0


def stages(rnd: RoundEvent) -> tuple[str, ...]:
    """The stages this round really has."""
    return AR_STAGES if _sampled_only(rnd) else STAGES


def round_tokens(state: RunState, round_index: int) -> list[TokenEvent]:
    return [t for t in state.tokens if t.round_index == round_index]


def shown_tokens(state: RunState, round_index: int, stage: int) -> list[TokenEvent]:
    """The text so far: earlier rounds, plus this round's tokens once its last stage is reached."""
    rnd = state.round_of(round_index)
    last = rnd is not None and stage >= len(stages(rnd)) - 1
    return [t for t in state.tokens if t.round_index < round_index or (t.round_index == round_index and last)]


def _t(text: str | None) -> str:
    return "∅" if text is None else (repr(text)[1:-1] or "·")


def _code(text: str | None) -> str:
    """A token as inline code that survives a Markdown table cell (pipes, backticks)."""
    s = _t(text).replace("|", "\\|")
    return f"`` {s} ``" if "`" in s else f"`{s}`"


def _p(x: float | None) -> str:
    return "–" if x is None else f"{x:.4g}"


def _token_text(token: TokenEvent) -> str:
    """The token on its own (its text piece may carry bytes of an earlier, incomplete character)."""
    return next((c.text for c in token.candidates if c.token_id == token.token_id), token.text)


def _top(candidates: tuple[Candidate, ...], prob: str) -> list[Candidate]:
    """The top entries by one of a candidate's probabilities (`target_prob`, `residual_prob`)."""
    return sorted(candidates, key=lambda c: -getattr(c, prob))[:TOP_ENTRIES]


def _entries(candidates: tuple[Candidate, ...], prob: str) -> str:
    return ", ".join(f"{_code(c.text)} {_p(getattr(c, prob))}" for c in _top(candidates, prob))


def _tests(tokens: list[TokenEvent]) -> tuple[PositionTest, ...]:
    return tokens[0].round_tests if tokens else ()


def _reached(tests: tuple[PositionTest, ...]) -> int:
    """How many positions the rule actually decided: up to and including the first failed test."""
    return next((i + 1 for i, test in enumerate(tests) if not test.passed), len(tests))


def _head(rnd: RoundEvent, stage: int) -> str:
    names = stages(rnd)
    return f"### Round {rnd.round_index} · stage {stage + 1}/{len(names)}: {names[stage]}\n"


def _target_sample(rnd: RoundEvent, token: TokenEvent) -> str:
    if rnd.target_forwards == 0:
        timing = ("It comes from the **prefill**: the forward pass that read the prompt already gave T at this "
                  "position, so this round ran no target forward of its own.")
    else:
        timing = f"One target forward ({rnd.verify_seconds * 1e3:.1f} ms) gave T at this position."
    lead = ("AR has no draft: the target samples one token" if rnd.method == "ar" else
            "No room is left for a draft (the token limit is reached), so the target samples one token")
    return f"{lead} from its distribution T: {_code(_token_text(token))} (T = {_p(token.target_prob)}). {timing}"


def _rule(rnd: RoundEvent) -> str:
    cfg = rnd.config
    return {
        "sps": "SpS keeps draft x iff **u < P(accept) = min(1, T(x)/D(x))**, u uniform on [0, 1).",
        "cactus": f"Cactus raises T(x) to **γ = T + √(2δ·T(1−T))** (δ = {cfg.get('delta')}) and keeps x iff "
                  "**u < P(accept) = min(1, γ/D(x))**, u uniform on [0, 1).",
        "tas": f"TAS keeps x iff **T(x) > min(ε, α·e^(−H(T)))** (ε = {cfg.get('posterior_threshold')}, "
               f"α = {cfg.get('posterior_alpha')}, H the target's entropy): no random draw, so P(accept) is 0 or 1.",
    }[rnd.method]


def _accept_table(rnd: RoundEvent, tests: tuple[PositionTest, ...]) -> str:
    tas = rnd.method == "tas"
    if tas:
        header = "| pos | token | T(x) | D(x) | threshold min(ε, α·e^(−H)) | P(accept) | verdict |"
    else:
        ratio = "T/D" if rnd.method == "sps" else "γ/D"
        gamma = " γ |" if rnd.method == "cactus" else ""
        header = f"| pos | token | T(x) | D(x) |{gamma} {ratio} | P(accept) | u | verdict |"
    columns = header.count("|") - 1
    rows = [header, "|" + "---|" * columns]
    reached = _reached(tests)
    for i, test in enumerate(tests):
        cells = [str(test.position), _code(test.text), _p(test.target_prob), _p(test.draft_prob)]
        if i >= reached:  # no decision here: its test numbers would only invite a wrong reading
            cells += ["–"] * (columns - 5) + [NOT_REACHED]
        elif tas:
            cells += [_p(test.threshold), _p(test.acceptance_prob), "**kept**" if test.passed else "**rejected**"]
        else:
            granted = test.gamma if test.gamma is not None else test.target_prob
            cells += ([_p(test.gamma)] if rnd.method == "cactus" else []) + [
                _p(granted / test.draft_prob), _p(test.acceptance_prob), _p(test.u),
                "**kept**" if test.passed else "**rejected**"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _recovery(rnd: RoundEvent, token: TokenEvent) -> str:
    """Where the recovered token comes from, per rule, and its top entries."""
    if rnd.method == "tas":
        source = ("TAS recovers with **argmax T**: deterministic, the target's most likely token (vLLM's TAS "
                  "recovery). Its top entries of T:")
        entries = _entries(token.candidates, "target_prob")
    else:
        source = ("SpS samples it from the residual **norm(max(T − D, 0))**: kept draft or residual sample, the "
                  "emitted token is distributed exactly as T. This is what keeps SpS **exact**." if rnd.method == "sps"
                  else "Cactus samples it from **norm(max(h − D, 0))**, h the raised distribution (h(x) = γ at the "
                       "rejected draft, the rest of T scaled down to match); its KL(h‖T) is what δ bounds.")
        source += " The residual's top entries (token, residual prob):"
        entries = _entries(token.candidates, "residual_prob")
    return f"{source} {entries}."


def explain_stage(rnd: RoundEvent, tokens: list[TokenEvent], stage: int) -> str:
    """Markdown for one stage of one round: what that stage computed, and nothing later."""
    head = _head(rnd, stage)
    if not tokens:
        return head
    last = tokens[-1]
    if _sampled_only(rnd):
        return head + _target_sample(rnd, last)
    tests = _tests(tokens)
    k = rnd.num_draft_tokens
    if stage == 0:
        drafted = ", ".join(f"{test.position}: {_code(test.text)} (D = {_p(test.draft_prob)})" for test in tests)
        return head + (f"The draft model proposed **K = {k}** tokens one after another, each sampled from its own "
                       f"distribution D ({rnd.draft_seconds * 1e3:.1f} ms): {drafted}. Nothing is decided yet: "
                       "the target has not seen them.")
    if stage == 1:
        scored = "; ".join(f"{test.position}: {_code(test.text)} T = {_p(test.target_prob)}, D = {_p(test.draft_prob)}"
                           for test in tests)
        return head + (f"The target scored all **K + 1 = {k + 1}** positions in **one** forward pass "
                       f"({rnd.verify_seconds * 1e3:.1f} ms): T(x) at each drafted position ({scored}), and a whole "
                       "distribution T at position K + 1 for a possible bonus. One target pass instead of K + 1 is "
                       "where the speed comes from.")
    if stage == ACCEPT_STAGE:
        m = rnd.num_accepted
        cut = (f"The first rejection is at position {m + 1}: the round keeps the first **{m}** of {k}, and positions "
               "after it are not reached." if m < k else f"All **{k}** drafts passed.")
        return head + _rule(rnd) + "\n\n" + _accept_table(rnd, tests) + "\n\n" + cut
    if last.status == "recovered":
        return head + (f"Position {last.draft_position} was rejected, so the round ends with a **recovered** token "
                       f"{_code(_token_text(last))}. " + _recovery(rnd, last)
                       + f" The round emitted {rnd.num_emitted} token(s).")
    if last.status == "bonus":
        return head + (f"All {k} drafts were kept, so the target's extra position gives a free **bonus** token "
                       f"{_code(_token_text(last))} drawn from T_{{K+1}} (T = {_p(last.target_prob)}; top entries: "
                       f"{_entries(last.candidates, 'target_prob')}). "
                       f"The round emitted {rnd.num_emitted} tokens.")
    return head + (f"All {k} drafts were kept and the token limit is reached, so there is no bonus token. "
                   f"The round emitted {rnd.num_emitted} tokens.")


def lesson_summary(state: RunState, rounds: int) -> dict:
    """`summary` of the lesson's first `rounds` rounds, folded afresh so a later round cannot leak in."""
    so_far = RunState(method=state.method, config=state.config)
    for rnd in state.rounds[:rounds]:
        for token in round_tokens(state, rnd.round_index):
            reduce(so_far, token)
        reduce(so_far, rnd)
    return summary(so_far)


def divergence_line(state: RunState, round_index: int, stage: int) -> str:
    """The lesson's running divergence; this round counts from its accept stage (when its tests are known)."""
    rnd = state.round_of(round_index)
    counted = round_index + (rnd is not None and (_sampled_only(rnd) or stage >= ACCEPT_STAGE))
    m = lesson_summary(state, counted)
    n = m["tested_positions"]
    if not n:
        line = "**Induced divergence so far**: no tested position yet (a token sampled from T itself adds none)."
    else:
        where = f"{n} tested position" + ("s" if n != 1 else "")
        line = (f"**Induced divergence so far** (exact KL(induced ‖ target) over {where}): "
                f"total {m['induced_kl_total']:.4f} nats, mean {m['mean_induced_kl']:.4f} nats per tested position.")
    if state.method == "cactus":
        line += (f" **Cactus's per-step constraint** Σ KL(h‖T) = {m['constraint_kl_total']:.4f} nats "
                 f"(each step's KL(h‖T) ≤ δ = {state.config.get('delta')}; not the induced divergence).")
    return line


def _bars(x: list[str], y: list[float], colours: list[str] | str, name: str) -> dict:
    return {"type": "bar", "x": x, "y": y, "name": name, "marker": {"color": colours}}


def _top_bars(candidates: list[Candidate], values: list[float], chosen: int, colour: str, name: str) -> dict:
    labels = [f"{_t(c.text)} ({c.token_id})" for c in candidates]
    return _bars(labels, values, [colour if c.token_id == chosen else NEUTRAL_COLOUR for c in candidates], name)


def round_figure(rnd: RoundEvent, tokens: list[TokenEvent], stage: int) -> go.Figure:
    """The chart of one stage: D, then D and T, then the test per position, then the last token's source."""
    title = f"Round {rnd.round_index}, {stages(rnd)[stage]}"
    if not tokens:
        return figure([], title, height=260)
    last = tokens[-1]
    if _sampled_only(rnd):
        top = _top(last.candidates, "target_prob")
        return figure([_top_bars(top, [c.target_prob for c in top], last.token_id, STATUS_COLOURS[last.status], "T")],
                      f"{title}: T's top entries (sampled token coloured)", "token", "T", height=260)
    tests = _tests(tokens)
    x = [f"{test.position}: {_t(test.text)}" for test in tests]
    if stage == 0:
        return figure([_bars(x, [test.draft_prob for test in tests], NEUTRAL_COLOUR, "D(x)")],
                      f"{title}: D(x) of each drafted token", "position: drafted token", "D(x)", height=260)
    if stage == 1:
        return figure([_bars(x, [test.draft_prob for test in tests], NEUTRAL_COLOUR, "D(x)"),
                       _bars(x, [test.target_prob for test in tests], "#9467bd", "T(x)")],
                      f"{title}: T(x) next to D(x)", "position: drafted token", "probability", height=260,
                      barmode="group")
    if stage == ACCEPT_STAGE:
        decided = tests[:_reached(tests)]
        x = x[:len(decided)]
        colours = [STATUS_COLOURS["accepted"] if test.passed else REJECTED_COLOUR for test in decided]
        if rnd.method == "tas":
            traces = [_bars(x, [test.target_prob for test in decided], colours, "T(x)"),
                      {"type": "scatter", "mode": "markers", "x": x, "y": [test.threshold for test in decided],
                       "name": "threshold", "marker": {"symbol": "line-ew-open", "size": 30, "color": "black"}}]
            return figure(traces, f"{title}: T(x) against the threshold (kept iff T(x) > threshold)",
                          "position: drafted token", "T(x)", height=260)
        traces = [_bars(x, [test.acceptance_prob for test in decided], colours, "P(accept)"),
                  {"type": "scatter", "mode": "markers", "x": x, "y": [test.u for test in decided], "name": "u",
                   "marker": {"symbol": "diamond", "size": 11, "color": "black"}}]
        return figure(traces, f"{title}: P(accept) and u (kept iff u < P(accept))", "position: drafted token",
                      "probability", height=260, yaxis={"range": [0, 1.05]})
    if last.status == "recovered" and rnd.method != "tas":
        top = _top(last.candidates, "residual_prob")
        trace = _top_bars(top, [c.residual_prob for c in top], last.token_id, STATUS_COLOURS["recovered"], "residual")
        return figure([trace], f"{title}: the residual's top entries (sampled token coloured)", "token",
                      "residual prob", height=260)
    if last.status == "accepted":
        return figure([], f"{title}: no bonus (the token limit is reached)", height=260)
    top = _top(last.candidates, "target_prob")
    what = "argmax T is the recovery" if last.status == "recovered" else "T_{K+1}, the bonus token coloured"
    trace = _top_bars(top, [c.target_prob for c in top], last.token_id, STATUS_COLOURS[last.status], "T")
    return figure([trace], f"{title}: T's top entries ({what})", "token", "T", height=260)

"""The Learn tab's stages on real rounds of the tiny pair: no spoilers, numbers that redo each decision."""

from __future__ import annotations

import re

import pytest

from engine.config import SpecConfig
from engine.decoding import generate
from playground.limits import inspector_width
from playground.state import STATUS_COLOURS, RunState, reduce, summary
from playground.tutor import (
    ACCEPT_STAGE, NEUTRAL_COLOUR, NOT_REACHED, REJECTED_COLOUR, divergence_line, explain_stage, lesson_summary,
    round_figure, round_tokens, shown_tokens, stages,
)

SPEC = ("sps", "tas", "cactus")
VERDICTS = re.compile(r"kept|rejected|recovered|not reached|first rejection")


def _run(pair, method: str, drafter: str = "model") -> RunState:
    # No truncation and a generous δ: the tiny pair's random draft then gets some drafts kept and some rejected.
    cfg = SpecConfig(method=method, temperature=1.0, top_k=0, delta=2.0, max_new_tokens=40, seed=3,
                     inspect_top_n=inspector_width(pair.vocab_size, 0))
    state = RunState(method=method, config=cfg.as_dict())
    for event in generate(pair.make_target(), None if method == "ar" else pair.make_drafter(drafter),
                          pair.tokenizer, pair.encode_prompt("hi"), cfg, eos_token_ids=frozenset()):
        reduce(state, event)
    return state


@pytest.fixture(scope="module")
def runs(tiny_pair) -> dict[str, RunState]:
    return {method: _run(tiny_pair, method) for method in (*SPEC, "ar")}


def _drafted(run: RunState):
    for rnd in run.rounds:
        if rnd.num_draft_tokens:
            yield rnd, round_tokens(run, rnd.round_index)


def test_runs_have_kept_and_rejected_drafts(runs):
    """The fixture exercises both verdicts for every rule (else the tests below would prove little)."""
    for method in SPEC:
        rounds = [rnd for rnd, _ in _drafted(runs[method])]
        assert any(r.num_accepted for r in rounds) and any(r.num_accepted < r.num_draft_tokens for r in rounds), method


def test_stage_counts_match_what_is_shown(runs):
    for method, run in runs.items():
        for rnd in run.rounds:
            names = stages(rnd)
            assert len(names) == (1 if method == "ar" or rnd.num_draft_tokens == 0 else 4)
            tokens = round_tokens(run, rnd.round_index)
            for stage in range(len(names)):
                text = explain_stage(rnd, tokens, stage)
                assert f"stage {stage + 1}/{len(names)}: {names[stage]}" in text
                assert "SSD" not in text and "cache" not in text


def test_draft_and_verify_stages_give_nothing_away(runs):
    for method in SPEC:
        for rnd, tokens in _drafted(runs[method]):
            k = rnd.num_draft_tokens
            for stage in (0, 1):
                text = explain_stage(rnd, tokens, stage)
                assert not VERDICTS.search(text), text
                assert text.count("D = ") == k  # every drafted token, not only those the round keeps
                fig = round_figure(rnd, tokens, stage)
                for trace in fig.data:
                    assert len(trace.x) == k and trace.marker.color not in (STATUS_COLOURS["accepted"], REJECTED_COLOUR)
                assert fig.data[0].marker.color == NEUTRAL_COLOUR
            assert explain_stage(rnd, tokens, 1).count("T = ") == k
            # The running divergence counts this round only from its accept stage.
            before = divergence_line(runs[method], rnd.round_index - 1, ACCEPT_STAGE) if rnd.round_index else None
            assert divergence_line(runs[method], rnd.round_index, 1) == (
                before or divergence_line(runs[method], rnd.round_index, 0))


def _table(text: str) -> list[dict[str, str]]:
    lines = [line for line in text.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(header, (c.strip() for c in re.split(r"(?<!\\)\|", line.strip("|"))))) for line in lines[2:]]


def test_accept_stage_numbers_redo_the_decision(runs):
    for method in SPEC:
        for rnd, tokens in _drafted(runs[method]):
            rows = _table(explain_stage(rnd, tokens, ACCEPT_STAGE))
            assert len(rows) == rnd.num_draft_tokens
            verdicts = [row["verdict"] for row in rows]
            m = rnd.num_accepted
            assert verdicts[:m] == ["**kept**"] * m
            if m < len(rows):
                assert verdicts[m] == "**rejected**" and verdicts[m + 1:] == [NOT_REACHED] * (len(rows) - m - 1)
            for row in rows[:m + 1]:
                t, d, p = float(row["T(x)"]), float(row["D(x)"]), float(row["P(accept)"])
                kept = row["verdict"] == "**kept**"
                if method == "tas":
                    assert (t > float(row["threshold min(ε, α·e^(−H))"])) == kept
                    assert p == (1.0 if kept else 0.0)
                    continue
                granted = float(row["γ"]) if method == "cactus" else t
                ratio = float(row["γ/D" if method == "cactus" else "T/D"])
                assert ratio == pytest.approx(granted / d, rel=2e-3)
                assert p == pytest.approx(min(1.0, ratio), rel=2e-3)
                assert (float(row["u"]) < p) == kept
            fig = round_figure(rnd, tokens, ACCEPT_STAGE)
            bars, marks = fig.data
            assert len(bars.x) == min(m + 1, rnd.num_draft_tokens)
            kept = [STATUS_COLOURS["accepted"]] * m
            assert list(bars.marker.color) == kept + [REJECTED_COLOUR] * (len(bars.x) - m)
            tests = tokens[0].round_tests[:len(bars.x)]
            if method == "tas":  # T(x) against the threshold: a rejected bar is T(x), not a height-0 P(accept)
                assert list(bars.y) == [t.target_prob for t in tests] and marks.name == "threshold"
            else:
                assert list(bars.y) == [t.acceptance_prob for t in tests] and list(marks.y) == [t.u for t in tests]


def test_recover_and_bonus_stage_text_per_method(runs, tiny_pair):
    for method in SPEC:
        seen = False
        for rnd, tokens in _drafted(runs[method]):
            last = tokens[-1]
            if last.status != "recovered":
                continue
            seen = True
            text = explain_stage(rnd, tokens, 3)
            assert ("exact" in text) == (method == "sps")
            assert {"sps": "norm(max(T − D, 0))", "cactus": "norm(max(h − D, 0))", "tas": "argmax T"}[method] in text
            if method == "tas":
                assert last.token_id == max(last.candidates, key=lambda c: c.target_prob).token_id
            else:
                assert "residual's top entries" in text
                assert len(round_figure(rnd, tokens, 3).data[0].x) == 5
        assert seen, method
    bonus_run = _run(tiny_pair, "sps", drafter="self")
    bonus = [(rnd, tokens) for rnd, tokens in _drafted(bonus_run) if tokens[-1].status == "bonus"]
    assert bonus
    rnd, tokens = bonus[0]
    assert "bonus" in explain_stage(rnd, tokens, 3) and "T_{K+1}" in explain_stage(rnd, tokens, 3)


def test_ar_says_where_its_first_token_comes_from(runs):
    run = runs["ar"]
    first, second = run.rounds[0], run.rounds[1]
    assert first.target_forwards == 0
    text = explain_stage(first, round_tokens(run, 0), 0)
    assert "prefill" in text and "ms" not in text
    assert "ms" in explain_stage(second, round_tokens(run, 1), 0)
    assert "no tested position" in divergence_line(run, 0, 0)


def test_text_so_far_shows_a_round_at_its_last_stage(runs):
    run = runs["cactus"]
    rnd = run.rounds[1]
    before = [t for t in run.tokens if t.round_index == 0]
    assert shown_tokens(run, 1, ACCEPT_STAGE) == before
    assert shown_tokens(run, 1, 3) == before + round_tokens(run, 1)
    assert shown_tokens(runs["ar"], 1, 0) == round_tokens(runs["ar"], 0) + round_tokens(runs["ar"], 1)
    assert len(stages(rnd)) == 4


def test_running_divergence_is_the_run_summary(runs):
    for method in SPEC:
        run = runs[method]
        whole, so_far = summary(run), lesson_summary(run, len(run.rounds))
        for key in ("induced_kl_total", "mean_induced_kl", "tested_positions", "constraint_kl_total"):
            assert so_far[key] == pytest.approx(whole[key]), key
        line = divergence_line(run, len(run.rounds), 0)
        assert f"{whole['mean_induced_kl']:.4f}" in line and "exact KL(induced ‖ target)" in line
        assert ("per-step constraint" in line) == (method == "cactus")
        if method == "cactus":
            assert f"{whole['constraint_kl_total']:.4f}" in line

"""Playground logic without a browser: reducer, charts, inspector, limits, live tuning, stop."""

from __future__ import annotations

import json
import statistics
import threading
import time

import pytest

from engine.config import SpecConfig
from engine.decoding import generate
from engine.peers.vllm_peer import plugin_env
from playground import charts
from playground.inspector import inspect_figure, inspect_markdown
from playground.limits import METHOD_LABELS, Limits, build_config, inspector_width
from playground.runner import (
    AR_REFERENCE_RUNS, AR_REFERENCE_TOKENS, COMPARE_COLUMNS, SWEEP_COLUMNS, ARReference, PlaygroundContext, add_ar_run,
    ar_reference_config, compare_table, run_compare, run_sweep, start_run, start_session_run, stream_run, sweep_points,
    sweep_table, tokens_csv, wants_ar_reference_run,
)
from playground.session import Session, apply_live_change
from playground.state import RunState, highlighted_tokens, reduce, summary
from playground.tutor import STAGES, explain_stage, round_tokens
from playground.views import progress_line
from playground.vllm_config import speculative_config


def _run(pair, method="cactus", **kw) -> RunState:
    cfg = SpecConfig(method=method, temperature=0.8, top_k=20, max_new_tokens=24, seed=3,
                     inspect_top_n=inspector_width(pair.vocab_size, 20), **kw)
    state = RunState(method=method, config=cfg.as_dict())
    drafter = None if method == "ar" else pair.make_drafter()
    for event in generate(pair.make_target(), drafter, pair.tokenizer, pair.encode_prompt("hi"), cfg,
                          eos_token_ids=frozenset()):
        reduce(state, event)
    return state


def assert_titles_fit(figures) -> None:
    """Every chart titled, its title short enough for a half-width chart (Plotly cuts a long title at
    the chart's edge instead of wrapping it), the rest in at most two caption lines."""
    for fig in figures:
        title, *caption = fig.layout.title.text.split("<br>")
        assert title and len(title) <= 56, title
        assert len(caption) <= 2 and all(len(line.removeprefix("<sub>").removesuffix("</sub>"))
                                         <= charts.CAPTION_WIDTH for line in caption), caption


def test_reducer_charts_and_inspector(tiny_pair):
    state = _run(tiny_pair)
    assert len(highlighted_tokens(state)) == len(state.tokens) == 24
    m = summary(state)
    assert m["tested_positions"] == len(state.divergence) > 0 and m["mean_induced_kl"] >= 0
    assert_titles_fit(charts.live_figures(state, ar_baseline_tps=10.0))
    assert len(charts.divergence_budget(state).data) >= 3
    tested = next(t.index for t in state.tokens if t.draft_prob is not None)
    assert {tr.name for tr in inspect_figure(state, tested).data} >= {"draft D", "target T", "Cactus h"}
    assert "acceptance probability" in inspect_markdown(state, tested)
    rnd = state.rounds[0]
    assert all(explain_stage(rnd, round_tokens(state, 0), s) for s in range(len(STAGES)))


def test_sps_induced_divergence_is_zero(tiny_pair):
    assert summary(_run(tiny_pair, "sps"))["mean_induced_kl"] < 1e-6


def test_live_change_validates_a_copy_first():
    control = SpecConfig(method="cactus")
    apply_live_change(control, "delta", 0.25, max_k=16)
    assert control.delta == 0.25
    with pytest.raises(ValueError):
        apply_live_change(control, "top_p", 0.0, max_k=16)
    with pytest.raises(ValueError):
        apply_live_change(control, "num_speculative_tokens", 40, max_k=16)
    assert control.top_p == 1.0 and control.num_speculative_tokens == 4


def test_limits_reject_bad_input_with_a_sentence():
    limits = Limits()
    base = dict(method="sps", k=4, delta=1, posterior_threshold=0.09, posterior_alpha=0.3, temperature=0.5,
                top_p=1, top_k=0, max_new_tokens=16, seed=0)
    assert build_config(limits, **base).num_speculative_tokens == 4
    for bad, msg in ((dict(k=99), "K must be"), (dict(method="ssd", downweight_c=0), "down-weight"),
                     (dict(method="ssd", budget=500), "budget"), (dict(method="ssd", ssd_rule="ar"), "SSD verifies"),
                     (dict(max_new_tokens=10**6), "max new"), (dict(k=2.5), "whole number"),
                     (dict(temperature=-1), "temperature")):
        with pytest.raises(ValueError, match=msg):
            build_config(limits, **{**base, **bad})


def test_pause_step_and_stop_at_round_boundaries(tiny_pair):
    """The engine loop parks a paused run after exactly the rounds it was given, and Stop wakes it."""
    ctx = PlaygroundContext("tiny", tiny_pair)
    control = SpecConfig(method="sps", max_new_tokens=200, temperature=0.8)
    handle = start_run(ctx, control, tiny_pair.encode_prompt("hi"), RunState(method="sps"), time.monotonic() + 600,
                       paused=True, steps=1)
    assert handle.wait(lambda h: h.parked, 120) and handle.rounds_done == 1
    ctx.engine.step(handle)
    assert handle.wait(lambda h: h.parked and h.rounds_done == 2, 120)
    ctx.engine.stop(handle)
    assert handle.done.wait(120)
    run = handle.state()
    assert run.finish.reason == "stopped" and len(run.rounds) == 2 and ctx.active_runs == 0
    assert run.paused_seconds > 0 and not run.paused


def test_a_run_that_took_turns_with_another_says_so_and_parked_runs_do_not_count(tiny_pair):
    """Runs interleave round by round on the engine thread, so a run's rate is its share of it: the
    status line says so, and such an AR run is no reference. A parked run (a Learn-tab round, a
    paused run) takes no turns and counts for nothing."""
    from playground.runner import timed_ar_speed
    from playground.views import status_line

    ctx = PlaygroundContext("tiny", tiny_pair)
    prompt = tiny_pair.encode_prompt("hi")

    def run(paused: bool):
        return start_run(ctx, SpecConfig(method="ar", max_new_tokens=200, temperature=0.8), prompt,
                         RunState(method="ar"), time.monotonic() + 600, paused=paused, steps=0)

    parked = run(True)  # parked before its prefill for the whole test
    alone = run(False)
    assert alone.done.wait(120)
    assert alone.state().max_concurrent == 1 and "shared the engine" not in status_line(alone.state(), None)
    assert timed_ar_speed(alone, False) is not None
    first, second = run(True), run(True)
    with ctx.engine._wake:  # both resumed before the loop's next turn: they take turns from the first round
        ctx.engine.resume(first)
        ctx.engine.resume(second)
    assert first.done.wait(120) and second.done.wait(120)
    for handle in (first, second):
        assert handle.state().max_concurrent == 2
        assert "shared the engine with 1 other run at times" in status_line(handle.state(), None)
        assert timed_ar_speed(handle, False) is None
    ctx.engine.stop(parked)
    assert parked.done.wait(120)


def test_time_parked_by_pause_is_left_out_of_the_rates_the_page_shows(tiny_pair):
    """A run paused for half its decode time shows the rate it ran at, not half of it (× AR reads it)."""
    state = _run(tiny_pair, method="sps")
    before = summary(state)
    decode = before["elapsed_seconds"] - before["prefill_seconds"]
    state.paused_seconds = decode / 2
    after = summary(state)
    assert after["decode_tokens_per_s"] == pytest.approx(2 * before["decode_tokens_per_s"])
    assert after["tokens_per_s"] == pytest.approx(before["new_tokens"] / (before["elapsed_seconds"] - decode / 2))
    state.finish = None  # while it runs: the last round's clock, less the time parked before it
    live = summary(state)
    running = state.rounds[-1].elapsed_seconds - decode / 2
    assert live["tokens_per_s"] == pytest.approx(len(state.tokens) / running)


def test_the_live_line_shows_the_decode_rate_that_x_ar_divides(tiny_pair):
    """While a run streams, its tok/s (and so its × AR) is the final line's quantity so far: tokens
    over the decode, not over a clock that started before the prefill. AR's round 0 runs no forward,
    so no rate is shown until a round has verified."""
    done = _run(tiny_pair, method="ar")
    prefill = done.start.prefill_seconds
    state = RunState(method="ar", config=done.config)
    reduce(state, done.start)
    for event in [*done.tokens[:1], done.rounds[0]]:
        reduce(state, event)
    assert done.rounds[0].verify_seconds == 0 and "decode_tokens_per_s" not in summary(state)
    assert "– tok/s" in progress_line(state, None)  # the slot, not a rate
    for event in [*done.tokens[1:], *done.rounds[1:]]:
        reduce(state, event)
    live = summary(state)["decode_tokens_per_s"]
    assert live == pytest.approx(len(state.tokens) / (state.rounds[-1].elapsed_seconds - prefill))
    assert live > len(state.tokens) / state.rounds[-1].elapsed_seconds  # the prefill is out of it
    assert f"{live:.1f} tok/s" in progress_line(state, None)


def test_engine_calls_run_on_the_engine_thread(tiny_pair):
    ctx = PlaygroundContext("tiny", tiny_pair)
    assert ctx.engine.call(threading.current_thread).name == "specplay-engine"
    with pytest.raises(ZeroDivisionError):
        ctx.engine.call(lambda: 1 / 0)


def _session_run(ctx, session, method: str, tokens: int) -> RunState:
    cfg = SpecConfig(method=method, max_new_tokens=tokens, temperature=0.8)
    for run in start_session_run(ctx, session, cfg, ctx.pair.encode_prompt("hi")):
        pass
    return run


def test_each_session_keeps_its_own_ar_reference(tiny_pair):
    """"x AR" divides by the session's own AR run (long enough, alone, unpaused), else the start-up
    one: another visitor's AR run never changes it."""
    ctx = PlaygroundContext("tiny", tiny_pair, startup_reference=ARReference(1.0, "start-up"))
    a, b = ctx.sessions.get("a"), ctx.sessions.get("b")
    _session_run(ctx, a, "ar", 8)  # too short to time
    _session_run(ctx, a, "sps", 40)  # not AR
    assert ctx.reference_for(a).how == "start-up"
    ar = _session_run(ctx, a, "ar", 40)
    assert ctx.reference_for(a).tokens_per_s == ar.finish.metrics["decode_tokens_per_s"] != 1.0
    assert "your AR run" in ctx.reference_for(a).how
    assert ctx.reference_for(b).how == "start-up"
    # Later AR runs: the median of the session's last AR_REFERENCE_RUNS, not the latest alone.
    speeds = [ar.finish.metrics["decode_tokens_per_s"]]
    for _ in range(AR_REFERENCE_RUNS):
        speeds.append(_session_run(ctx, a, "ar", 40).finish.metrics["decode_tokens_per_s"])
    assert ctx.reference_for(a).tokens_per_s == statistics.median(speeds[-AR_REFERENCE_RUNS:])
    assert f"median of your last {AR_REFERENCE_RUNS} AR runs" in ctx.reference_for(a).how
    assert ctx.reference_for(b).how == "start-up"


def test_a_session_reference_is_the_median_of_its_last_ar_runs():
    session = Session()
    assert add_ar_run(session, 100.0, 40).tokens_per_s == 100.0
    assert add_ar_run(session, 200.0, 40).tokens_per_s == 150.0
    assert add_ar_run(session, 50.0, 40).tokens_per_s == 100.0  # one slow run moves it little
    for _ in range(AR_REFERENCE_RUNS):
        reference = add_ar_run(session, 300.0, 40)
    assert reference.tokens_per_s == 300.0 and len(session.ar_speeds) == AR_REFERENCE_RUNS  # the old ones left


def test_app_weights_flag_reaches_every_model_the_playground_makes(tiny_pair):
    import app

    args = app.parse_args(["--weights", "float32"])
    ctx = PlaygroundContext("tiny", tiny_pair, weight_dtype=args.weights)
    target, drafter = ctx.make_models("sps")
    assert target.backend_label == "fast/float32" and drafter.lm.backend_label == "fast/float32"
    with pytest.raises(SystemExit):
        app.parse_args(["--weights", "int3"])


def test_status_line_says_which_backend_and_weights_ran(tiny_pair):
    from playground.views import status_line

    run = RunState(method="ar")
    ctx = PlaygroundContext("tiny", tiny_pair, weight_dtype="float32")
    for event in generate(*ctx.make_models("ar"), tiny_pair.tokenizer, tiny_pair.encode_prompt("hi"),
                          SpecConfig(method="ar", max_new_tokens=3)):
        reduce(run, event)
    assert "fast/float32 on cpu" in status_line(run, None)


def test_compare_shares_draws_cactus_delta0_equals_sps(tiny_pair):
    ctx = PlaygroundContext("tiny", tiny_pair)
    cfg = SpecConfig(temperature=0.8, delta=0.0, max_new_tokens=16, seed=1)
    runs = list(run_compare(ctx, ["sps", "cactus"], cfg, tiny_pair.encode_prompt("hi"), threading.Event()))[-1][2]
    assert runs["sps"].token_ids == runs["cactus"].token_ids
    table = compare_table(runs)
    assert table["first_difference"].isna().all()
    assert tokens_csv(runs).count("\n") == 1 + 32


def test_sessions_are_separate_and_dropping_one_stops_its_run(tiny_pair):
    ctx = PlaygroundContext("tiny", tiny_pair)
    store = ctx.sessions
    a, b = store.get("a"), store.get("b")
    assert a is not b and a.control is not b.control and store.get("a") is a
    a.handle = start_run(ctx, SpecConfig(max_new_tokens=50), tiny_pair.encode_prompt("hi"), RunState(),
                         time.monotonic() + 600, paused=True, steps=1)
    store.drop("a")
    assert a.handle.done.wait(120) and a.handle.state().finish.reason == "stopped"
    assert store.get("a") is not a


def test_vllm_config_names():
    assert speculative_config(SpecConfig(method="ar"), "d") is None
    sps = speculative_config(SpecConfig(method="sps", temperature=0.7), "d")
    assert sps["num_speculative_tokens"] == 4 and sps["draft_sample_method"] == "probabilistic"
    # vLLM V1 has no TAS / Cactus fields: the specplay plugin (integrations/vllm) takes the rule from the environment.
    assert "cactus_delta" not in speculative_config(SpecConfig(method="cactus", delta=0.5), "d")
    assert plugin_env(SpecConfig(method="cactus", delta=0.5))["SPECPLAY_VLLM_DELTA"] == "0.5"
    assert plugin_env(SpecConfig(method="tas"))["SPECPLAY_VLLM_RULE"] == "tas"
    assert speculative_config(SpecConfig(method="sps"), "d", "eagle")["method"] == "eagle"


def test_pareto_front():
    pts = [{"divergence": 0, "mean_acceptance_length": 1.2}, {"divergence": 0.5, "mean_acceptance_length": 1.1},
           {"divergence": 1, "mean_acceptance_length": 2}]
    assert [p["divergence"] for p in charts.pareto_front(pts)] == [0, 1]


def test_ssd_runs_through_the_playground_and_fills_its_charts(tiny_pair):
    """The SSD method end to end in the UI layer: real worker, events reduced, charts with data."""
    import os

    from playground.charts import live_figures

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("SSD needs two cores")
    limits = Limits()
    cfg = build_config(limits, method="ssd", k=3, delta=1, posterior_threshold=0.09, posterior_alpha=0.3,
                       temperature=0.0, top_p=1, top_k=0, max_new_tokens=20, seed=0, fanout_mode="geometric",
                       budget=12, downweight_c=0.5, backup="fast")
    assert (cfg.method, cfg.ssd_budget, cfg.ssd_fanout_mode, cfg.ssd_backup) == ("sps", 12, "geometric", "fast")
    ctx = PlaygroundContext("tiny", tiny_pair, ssd_devices="target=cpu:0,draft=cpu:1")
    try:
        run = RunState(method="ssd")
        for _ in stream_run(ctx, cfg, tiny_pair.encode_prompt("hi"), run, time.monotonic() + 120, ssd=True):
            pass
        assert run.finish is not None and not run.error and len(run.tokens) == 20
        assert len(run.ssd_rounds) == len(run.rounds) and run.worker_events[0].kind == "started"
        assert summary(run)["cache_hit_rate"] is not None
        figures = live_figures(run, None)
        timeline, cache = figures[4], figures[5]
        assert {t.name for t in timeline.data} == {"draft", "target", "wait"}
        assert "hit rate" in cache.layout.title.text and len(cache.data[0].x) == len(run.ssd_rounds)
    finally:
        ctx.ssd_engine().close()


def test_ssd_fanout_and_c_change_while_paused_apply_next_round_and_are_marked(tiny_pair):
    """SSD's own knobs are live: changed while the run is parked, they apply within the next two rounds
    (SSD requests a round's speculation one round ahead) and the throughput chart marks them."""
    import os

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("SSD needs two cores")
    limits = Limits()
    cfg = build_config(limits, method="ssd", k=3, delta=1, posterior_threshold=0.09, posterior_alpha=0.3,
                       temperature=0.0, top_p=1, top_k=0, max_new_tokens=40, seed=0, fanout_mode="uniform",
                       budget=12, downweight_c=1.0, backup="neural")
    ctx = PlaygroundContext("tiny", tiny_pair, ssd_devices="target=cpu:0,draft=cpu:1")
    try:
        handle = start_run(ctx, cfg, tiny_pair.encode_prompt("hi"), RunState(method="ssd", config=cfg.as_dict()),
                           time.monotonic() + 300, ssd=True, paused=True, steps=1)
        assert handle.wait(lambda h: h.parked or h.done.is_set(), 120) and handle.parked
        apply_live_change(cfg, "ssd_fanout_mode", "geometric", limits.max_k)
        apply_live_change(cfg, "downweight_c", 0.5, limits.max_k)
        for rounds in (2, 3):  # SSD asks the worker for round n+1 before it yields round n: allow one more
            ctx.ssd_loop.step(handle)
            assert handle.wait(lambda h: h.done.is_set() or (h.parked and h.rounds_done == rounds), 120)
        ctx.ssd_loop.stop(handle)
        assert handle.done.wait(120)
        run = handle.state()
        assert not run.error, run.error
        change = next(c for c in run.changes if "ssd_fanout_mode" in c.changes)
        assert change.round_index in (1, 2) and change.changes["downweight_c"] == (1.0, 0.5)
        assert run.rounds[-1].config["ssd_fanout_mode"] == "geometric"
        notes = [a.text for a in charts.throughput(run, None).layout.annotations]
        assert any("fan-out uniform→geometric" in n and "C 1.0→0.5" in n for n in notes), notes
        assert_titles_fit(charts.live_figures(run, 10.0))
    finally:
        ctx.ssd_engine().close()


def test_compare_reports_x_ar_against_its_own_ar_row(tiny_pair):
    ctx = PlaygroundContext("tiny", tiny_pair)
    cfg = SpecConfig(temperature=0.8, max_new_tokens=16, seed=1)
    runs = list(run_compare(ctx, ["ar", "sps"], cfg, tiny_pair.encode_prompt("hi"), threading.Event()))[-1][2]
    table = compare_table(runs).set_index("method")
    assert table.loc["ar", "x_ar"] == 1.0
    assert table.loc["sps", "x_ar"] == pytest.approx(table.loc["sps", "tokens_per_s"] / table.loc["ar", "tokens_per_s"],
                                                     rel=1e-3)


def test_sweep_streams_points_and_stop_keeps_the_finished_ones(tiny_pair):
    """Stop is pressed as the second point is announced: the first point stays, no other is plotted."""
    ctx = PlaygroundContext("tiny", tiny_pair)
    cfg = SpecConfig(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=12, seed=0)
    stop = threading.Event()
    seen = []
    for results, note in run_sweep(ctx, cfg, tiny_pair.encode_prompt("hi"), sweep_points([0.5, 1.0], [0.09]), stop):
        seen.append((len(results), note))
        if len(results) == 1:
            stop.set()
    assert seen[0] == (0, "running SpS (1/4)") and seen[1] == (1, "running δ=0.5 (2/4)")
    assert seen[-1] == (1, "done: 1 of 4 points (stopped)")
    assert results[0]["label"] == "SpS" and results[0]["divergence"] == 0.0 and results[0]["tested_positions"] > 0
    figure = charts.pareto_figure(results, note)
    assert [trace.name for trace in figure.data] == ["sps", "Pareto frontier"]


def test_sweep_labels_of_neighbouring_points_sit_on_opposite_sides():
    points = [{"method": "tas", "label": "ε=0.3", "divergence": 0.20, "mean_acceptance_length": 1.50},
              {"method": "tas", "label": "ε=0.09", "divergence": 0.21, "mean_acceptance_length": 1.51},
              {"method": "cactus", "label": "δ=1", "divergence": 0.10, "mean_acceptance_length": 1.6}]
    sides = {label: side for trace in charts.pareto_figure(points).data if trace.text
             for label, side in zip(trace.text, trace.textposition)}
    assert sides["ε=0.3"] != sides["ε=0.09"]



def test_ssd_status_says_a_hit_redrafts_its_first_token_and_how_often_the_cached_one_survives():
    from engine.events import SSDRoundEvent, StartEvent
    from playground.views import status_line

    run = RunState(method="sps")
    reduce(run, StartEvent(4, 0.01, "target", "draft", "fast/q4_1", "target=cpu:0, draft=cpu:1"))
    for i, kept in enumerate([True, False, None, True]):  # None: a miss, served by the backup (no redraft)
        reduce(run, SSDRoundEvent(i, (0,), (kept is not None,), ("cache" if kept is not None else "neural",),
                                  (0, 1), ((),), (), (1,), (), None, None, None, first_kept=(kept,)))
    m = summary(run)
    assert m["first_tokens_redrafted"] == 3 and m["first_token_kept_rate"] == pytest.approx(2 / 3)
    assert "first token redrafted from the target's real features" in status_line(run, None)
    assert "kept in 67% of 3" in status_line(run, None)



def test_the_ssd_cache_chart_says_why_the_worker_made_no_fill():
    from engine.events import SSDRoundEvent
    from playground.charts import ssd_cache_hits

    run = RunState(method="sps")
    note = "no fill at K = 1: a feature draft's hit redraws its first token from the real features, so a cache saves no draft step"
    for i in range(3):
        reduce(run, SSDRoundEvent(i, (0,), (False,), ("neural",), ((0, 1),), ((),), (), (1,), (), 0.0, None, None,
                                  fill_note=note if i else ""))
    shown = [a["text"] for a in ssd_cache_hits(run).to_plotly_json()["layout"].get("annotations", [])]
    assert note in [text.replace("<br>", " ") for text in shown]  # whole, wrapped to the plot's width
    assert all(len(line) <= charts.NOTE_WIDTH for text in shown for line in text.split("<br>"))


def test_the_ssd_cache_hover_shows_token_text_and_rounds_drafted_by_the_target():
    from engine.events import SSDRoundEvent
    from playground.charts import ssd_cache_hits

    run = RunState(method="sps")
    reduce(run, SSDRoundEvent(0, (0,), (False,), ("local",), (None,), ((),), (), (2,), (), None, None, None))
    reduce(run, SSDRoundEvent(1, (0,), (True,), ("cache",), ((1, 41234),), (((1, 41234), (0, 7)),), (2, 2), (2,), (),
                              1.0, None, None, cache_key_texts=((" river", "<b>"),), lookup_texts=(" river",)))
    for i, kept in ((2, True), (3, False)):  # a feature draft's hits: the first token redrawn
        reduce(run, SSDRoundEvent(i, (0,), (True,), ("cache",), ((0, 7),), (((0, 7),),), (2, 2), (2,), (),
                                  1.0, None, None, cache_depth=2, first_kept=(kept,)))
    hover = ssd_cache_hits(run).to_plotly_json()["data"][0]["text"]
    assert hover[0] == "drafted in the target process (no cache lookup)"
    assert "lookup k=1 &#x27; river&#x27; in 2 keys" in hover[1] and "k=0 &#x27;&lt;b&gt;&#x27;" in hover[1]
    assert "41234" not in hover[1] and "first token" not in hover[1]
    assert hover[2].endswith("first token: the cached one, kept by the redraw (branch depth 2)")
    assert hover[3].endswith("first token redrawn from the real features: the round serves that one token")

def test_the_live_feed_carries_every_token_once_in_order_and_ends_with_the_run(tiny_pair):
    """What the page's live view is sent: the run's cells exactly (no gap, no repeat), a live line,
    done last; the feed's messages fold the run like Gradio frames did."""
    import asyncio

    from playground.live_feed import LiveFeeds, messages

    ctx = PlaygroundContext("tiny", tiny_pair)
    control = SpecConfig(method="cactus", max_new_tokens=40, temperature=0.8, top_k=20, seed=2,
                         inspect_top_n=inspector_width(tiny_pair.vocab_size, 20))
    handle = start_run(ctx, control, tiny_pair.encode_prompt("hi"), RunState(method="cactus"), time.monotonic() + 600)
    feed = LiveFeeds().open(handle, lambda r: progress_line(r, None), lambda: ctx.engine.stop(handle))

    async def collect() -> list[dict]:
        return [m async for m in messages(feed, frame_seconds=0.01)]

    sent = asyncio.run(collect())
    assert feed.opened.is_set() and sent[-1].get("done") and all(not m.get("done") for m in sent[:-1])
    cells = [cell for m in sent for cell in m["cells"]]
    assert cells == [list(c) for c in highlighted_tokens(handle.state())] and len(cells) > 0
    assert "finished" in sent[-1]["status"] and "<b>" in sent[-1]["status"]  # Markdown bold as HTML


def test_a_page_names_its_feed_and_a_run_after_the_ar_reference_run_follows_on_from_it(tiny_pair):
    """The page picks its feed's id at the click (the server has not seen the request yet): a run
    registers under it, a second run cannot take it, and an id a page could not have made is
    refused (that run streams through Gradio). The AR reference run's last message names the feed
    of the run it was for, where it completed; a stopped one names none."""
    import asyncio
    from dataclasses import replace

    from engine.events import FinishEvent
    from playground.engine_loop import RunHandle
    from playground.live_feed import LiveFeeds, feed_url, messages

    cfg = SpecConfig(method="ar", temperature=0.8, top_k=20, max_new_tokens=6, seed=1)
    events = list(generate(tiny_pair.make_target(), None, tiny_pair.tokenizer, tiny_pair.encode_prompt("hi"), cfg,
                           eos_token_ids=frozenset()))
    feeds = LiveFeeds()

    def finished_run(last_events: list) -> RunHandle:
        handle = RunHandle(lambda: iter(()), RunState(method="ar"), time.monotonic() + 600)
        handle.events[:] = last_events
        handle.done.set()
        return handle

    page_id = "0123456789abcdef0123456789abcdef"
    feed = feeds.open(finished_run(events), lambda r: "", lambda: None, feed_id=page_id, next_id=page_id + "-run")
    assert feed is not None and feeds.get(page_id) is feed
    assert feeds.open(finished_run(events), lambda r: "", lambda: None, feed_id=page_id) is None
    assert feeds.open(finished_run(events), lambda r: "", lambda: None, feed_id="../x") is None

    async def last(f) -> dict:
        return [m async for m in messages(f, frame_seconds=0)][-1]

    assert asyncio.run(last(feed))["next"] == feed_url(page_id + "-run") == f"specplay/live/{page_id}-run"
    stopped = [e for e in events if not isinstance(e, FinishEvent)] + [replace(events[-1], reason="stopped")]
    other = feeds.open(finished_run(stopped), lambda r: "", lambda: None, feed_id="f" * 32, next_id="g" * 32)
    assert "next" not in asyncio.run(last(other))


def test_a_feed_opened_before_its_run_is_woken_by_the_registration_and_otherwise_gives_up(monkeypatch):
    """The page opens its feed at the click; the route waits until a run registers the id (the
    request may still be queued). The registration itself wakes it, from a handler's thread, with
    no polling in between; a feed whose run never comes sends keep-alives and then gives up."""
    import asyncio
    from types import SimpleNamespace

    from playground import live_feed
    from playground.engine_loop import RunHandle

    feeds = live_feed.LiveFeeds()
    handle = RunHandle(lambda: iter(()), RunState(method="ar"), time.monotonic() + 600)

    async def woken() -> list:
        got = []

        async def collect() -> None:
            got.extend([f async for f in feeds.wait_for("a" * 32, 1e6)])

        task = asyncio.create_task(collect())
        while not feeds._waiting:  # the waiter is in place
            await asyncio.sleep(0)
        registering = threading.Thread(target=feeds.open, args=(handle, lambda r: "", lambda: None),
                                       kwargs={"feed_id": "a" * 32})
        registering.start()
        await task
        registering.join()
        return got

    got = asyncio.run(woken())
    assert got == [feeds.get("a" * 32)] and got[0] is not None and not feeds._waiting
    # A run that never comes: each wait runs out at once on a clock of its own (no real time), so the
    # feed waits 15 + 15 + 10 s of a 40 s timeout, a keep-alive after each, then gives up.
    clock = [0.0]

    async def runs_out(awaitable, timeout: float):
        awaitable.close()
        clock[0] += timeout
        raise TimeoutError

    monkeypatch.setattr(live_feed, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(live_feed.asyncio, "wait_for", runs_out)

    async def never() -> list:
        return [f async for f in feeds.wait_for("b" * 32, 40.0)]

    assert asyncio.run(never()) == [None, None, None] and clock[0] == 40.0 and not feeds._waiting


def test_the_live_feed_looks_often_until_the_first_token_then_at_its_cadence(tiny_pair, monkeypatch):
    """Time to first token: until the run has a token to send, the feed looks every
    FIRST_FEED_SECONDS; after the first message, every frame (each message costs the browser a
    frame). The feed's waits are recorded, not timed (a 10 s frame: no look takes that long)."""
    import asyncio

    from playground import live_feed
    from playground.engine_loop import RunHandle

    cfg = SpecConfig(method="sps", temperature=0.8, top_k=20, max_new_tokens=12, seed=1)
    events = list(generate(tiny_pair.make_target(), tiny_pair.make_drafter(), tiny_pair.tokenizer,
                           tiny_pair.encode_prompt("hi"), cfg, eos_token_ids=frozenset()))
    handle = RunHandle(lambda: iter(()), RunState(method="sps"), time.monotonic() + 600)
    feed = live_feed.LiveFeeds().open(handle, lambda r: f"{len(r.tokens)} tokens", lambda: None)
    waits = []

    async def recorded(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) == 3:  # the run's tokens arrive after three looks
            handle.events[:] = events
        if len(waits) == 5:
            handle.done.set()

    async def collect() -> list[dict]:
        return [m async for m in live_feed.messages(feed, frame_seconds=10.0)]

    monkeypatch.setattr(asyncio, "sleep", recorded)
    sent = asyncio.run(collect())
    first = live_feed.FIRST_FEED_SECONDS  # each wait is what is left of its frame after the look
    assert len(waits) == 5 and all(0 <= w <= first for w in waits[:3]) and all(first < w <= 10.0 for w in waits[3:])
    assert sum(len(m["cells"]) for m in sent) == 12 and sent[-1]["done"]
    assert next(m for m in sent if m["cells"])["status"] == "12 tokens"  # the first tokens bring the live line


def test_the_live_feed_sends_each_point_of_the_key_charts_lines_once_while_the_run_streams(tiny_pair):
    """While the run streams, each feed message carries the points the key charts' lines gained
    since the last one (`from` says where they go), with title, reference and change marks when they
    change; none while the run is parked (it says `paused`, and Gradio draws every chart), none
    with the last message (the final update draws them). Put together, the points are exactly the
    finished run's lines. The run's real events are handed to the feed one round per message, so
    nothing depends on timing."""
    import asyncio

    from engine.events import RoundEvent
    from playground.engine_loop import RunHandle
    from playground.live_feed import LiveFeeds, messages

    cfg = SpecConfig(method="cactus", temperature=0.8, top_k=20, max_new_tokens=120, seed=3,
                     inspect_top_n=inspector_width(tiny_pair.vocab_size, 20))
    events = list(generate(tiny_pair.make_target(), tiny_pair.make_drafter(), tiny_pair.tokenizer,
                           tiny_pair.encode_prompt("hi"), cfg, eos_token_ids=frozenset()))
    rounds = [i + 1 for i, e in enumerate(events) if isinstance(e, RoundEvent)]
    assert len(rounds) > 10
    handle = RunHandle(lambda: iter(()), RunState(method="cactus"), time.monotonic() + 600)
    feed = LiveFeeds().open(handle, lambda r: f"{len(r.tokens)} tokens", lambda: None,
                            lambda r: charts.live_series(r, 100.0))
    parked_at = 5

    async def collect() -> list[dict]:
        sent, feed_messages = [], messages(feed, frame_seconds=0)
        for n, end in enumerate(rounds):
            handle.events[:] = events[:end]
            handle.rounds_done, handle.parked = n + 1, n == parked_at
            handle.run.paused = handle.parked
            if end == rounds[-1]:
                handle.events[:] = events
                handle.done.set()
            sent.append(await anext(feed_messages))
        return sent

    sent = asyncio.run(collect())
    assert "series" not in sent[parked_at] and sent[parked_at]["paused"] is True
    assert sent[parked_at + 1]["paused"] is False and "paused" not in sent[parked_at + 2]
    assert sent[-1].get("done") and "series" not in sent[-1]
    streamed = [m for i, m in enumerate(sent[:-1]) if i != parked_at]
    assert all(set(m["series"]) == {"chart-throughput", "chart-divergence"} for m in streamed[1:] if "series" in m)
    final = charts.live_series(handle.state(), 100.0)
    for chart_id in ("chart-throughput", "chart-divergence"):
        parts = [m["series"][chart_id] for m in sent if chart_id in m.get("series", {})]
        points = []
        for part in parts:
            assert part["from"] == len(points)
            points += part["points"]
        assert points == [[x, y] for x, y in final[chart_id].points[:len(points)]]
        assert len(points) >= len(final[chart_id].points) - 3  # the last rounds come with the final update
        assert parts[0]["title"] == final[chart_id].title and all("title" not in p for p in parts[1:])
    assert sent[[i for i, m in enumerate(sent) if "chart-throughput" in m.get("series", {})][0]][
        "series"]["chart-throughput"]["reference"] == (100.0, "AR 100.0 tok/s")


def test_inspector_candidates_wait_for_a_reader_and_equal_the_eager_ones(tiny_pair):
    """Folding a round computes divergences and tests, not the vocabulary-wide candidates (sparse
    rows are kept for them); reading them later gives exactly what computing them at once gave."""
    from engine.decoding import _all_candidates

    state = _run(tiny_pair, method="ar")  # sparse rows (top-k); the tiny draft's dense rows get theirs eagerly
    details = state.tokens[0].details
    assert details._pending_candidates is not None and not details._candidates  # not computed by folding
    cfg, result, rows, tokens, tokenizer = details._pending_candidates
    eager = _all_candidates(cfg, result, rows, tokens, tokenizer)
    assert state.tokens[0].candidates == eager[0] and len(eager[0]) > 0
    assert details._pending_candidates is None


def test_an_engine_loop_thread_exits_with_its_last_job_so_no_idle_openmp_team_outlives_it(tiny_pair):
    """An idle OpenMP team left by a second thread (the SSD loop's, after one SSD run) throttles
    every team's spinning: each loop's thread lives only while it has calls or runs."""
    from playground.engine_loop import EngineLoop

    loop = EngineLoop("specplay-test-loop")
    thread = loop.call(threading.current_thread)
    thread.join(timeout=60)  # a hang guard only: the thread ends right after handing back the result
    assert not thread.is_alive()
    assert loop.call(threading.current_thread) is not thread  # the next job gets a fresh thread
    handle = start_run(PlaygroundContext("tiny", tiny_pair, engine=loop), SpecConfig(method="ar", max_new_tokens=8),
                       tiny_pair.encode_prompt("hi"), RunState(method="ar"), time.monotonic() + 600)
    assert handle.done.wait(120) and handle.state().finish is not None


def test_the_browser_bench_counts_each_chromium_thread_busy_inside_each_window():
    """`thread_busy` from a trace: top-level tasks are cut to the click -> first token and the
    first -> last token windows, page times placed on the trace clock by the bench's mark, and a
    task nested in another counts once."""
    from playground.browser_bench import TRACE_MARK, thread_busy

    mark = {"name": TRACE_MARK, "ph": "I", "ts": 1_000_000, "args": {"data": {"startTime": 100.0}}}
    names = [{"ph": "M", "name": "thread_name", "pid": 1, "tid": t, "args": {"name": n}}
             for t, n in ((1, "CrRendererMain"), (2, "ThreadPoolForegroundWorker"))]

    def task(tid: int, start_ms: float, ms: float, cat: str = "toplevel") -> dict:  # page ms
        return {"ph": "X", "cat": cat, "pid": 1, "tid": tid, "ts": 1_000_000 + (start_ms - 100.0) * 1e3, "dur": ms * 1e3}

    # click at 200 ms, first token at 300, last at 600; the main thread's 290-310 task runs a
    # nested top-level task (a mojo message inside a RunTask) that must not count twice
    events = names + [mark, task(1, 150, 100), task(1, 290, 20), task(1, 295, 10, cat="toplevel,mojom"),
                      task(2, 400, 30), task(2, 590, 50), task(1, 700, 40), task(2, 450, 99, cat="devtools.timeline")]
    busy = thread_busy({"traceEvents": events}, 200.0, [300.0, 450.0, 600.0])
    assert busy["CrRendererMain"] == pytest.approx((50 + 10, 10))
    assert busy["ThreadPoolForegroundWorker"] == pytest.approx((0, 30 + 10))
    assert list(busy) == ["ThreadPoolForegroundWorker", "CrRendererMain"]  # busiest in the decode first


def test_page_ab_counts_one_browsers_process_tree_and_nothing_else():
    """`tree_ticks`: the processes whose command line holds the arm's switch, and all their
    descendants at any depth; the other arm's browser, its children and unrelated processes not."""
    from playground.page_ab import ARM_SWITCH, tree_ticks

    table = {
        10: (1, 100, b"/usr/lib/chromium/chromium\x00--headless\x00" + ARM_SWITCH.encode() + b"this\x00"),
        11: (10, 20, b"/usr/lib/chromium/chromium\x00--type=zygote\x00"),
        12: (11, 300, b"/usr/lib/chromium/chromium\x00--type=renderer\x00"),
        13: (10, 4, b"/usr/lib/chromium/chromium\x00--type=gpu-process\x00"),
        20: (1, 1000, b"/usr/lib/chromium/chromium\x00" + ARM_SWITCH.encode() + b"base\x00"),
        21: (20, 5000, b"/usr/lib/chromium/chromium\x00--type=renderer\x00"),
        30: (1, 7, b"python\x00app.py\x00"),
    }
    assert tree_ticks(table, (ARM_SWITCH + "this").encode()) == 100 + 20 + 300 + 4
    assert tree_ticks(table, (ARM_SWITCH + "base").encode()) == 1000 + 5000
    assert tree_ticks(table, b"--specplay-arm=none") == 0


def test_the_learn_tab_starts_on_its_first_preset_with_no_page_load_event_to_overwrite_a_prompt(tiny_pair):
    """The Learn controls hold the first preset from the start. A page-load event that set them
    could land after the visitor had typed a prompt and replace it (it did, in CI on a loaded machine)."""
    from playground.app import build_demo
    from playground.presets import PRESETS

    config = build_demo(PlaygroundContext("tiny", tiny_pair)).config
    prompt = next(c for c in config["components"] if c.get("props", {}).get("elem_id") == "learn-prompt")
    assert prompt["props"].get("value") == next(iter(PRESETS.values())).prompt
    loads = [d for d in config["dependencies"] if any(t[1] == "load" for t in d["targets"])]
    assert all(prompt["id"] not in d["outputs"] for d in loads)


def test_every_tab_names_its_tables_and_charts_before_any_run(tiny_pair):
    """Compare's and Sweep's tables show their column names, Compare's token views the checked
    methods, and Learn's chart a title with a hint, before anyone runs anything (they read "1 2 3",
    "slot 1" and an empty box)."""
    from playground.app import build_demo

    props = {c["props"].get("elem_id"): c["props"] for c in build_demo(PlaygroundContext("tiny", tiny_pair)).config["components"]}
    assert props["c-table"]["value"]["headers"] == list(COMPARE_COLUMNS)
    assert props["sweep-table"]["value"]["headers"] == list(SWEEP_COLUMNS)
    checked = props["c-methods"]["value"]
    assert [props[f"c-slot-{i}"]["label"] for i in range(len(checked))] == [METHOD_LABELS[m] for m in checked]
    assert props[f"c-slot-{len(checked)}"]["visible"] is False
    learn = json.loads(props["learn-plot"]["value"]["plot"])["layout"]
    assert learn["title"]["text"] and "Start" in learn["annotations"][0]["text"]


def test_the_sweep_table_keeps_one_column_order_whichever_knob_a_point_sets():
    points = [{"method": "tas", "label": "ε=0.3", "posterior_threshold": 0.3, "divergence": 0.2},
              {"method": "cactus", "label": "δ=1", "delta": 1.0, "divergence": 0.1}]
    table = sweep_table(points)
    assert list(table.columns) == list(SWEEP_COLUMNS)
    assert table["delta"].isna().tolist() == [True, False] and table["posterior_threshold"].tolist()[0] == 0.3


def test_a_page_asks_for_one_ar_reference_run_before_its_first_speculative_run():
    session, cactus = Session(), SpecConfig(method="cactus", max_new_tokens=16, delta=0.4, seed=7)
    assert wants_ar_reference_run(session, cactus)
    assert not wants_ar_reference_run(session, SpecConfig(method="ar"))
    session.pause_next = True  # Pause armed: the run asked for parks after its first round
    assert not wants_ar_reference_run(session, cactus)
    session.pause_next, session.ar_reference_run = False, True  # once per session
    assert not wants_ar_reference_run(session, cactus)
    assert not wants_ar_reference_run(Session(ar_reference=ARReference(1.0, "own")), cactus)
    reference = ar_reference_config(cactus)
    assert (reference.method, reference.max_new_tokens) == ("ar", AR_REFERENCE_TOKENS)  # long enough to count
    assert (reference.delta, reference.seed, reference.temperature) == (0.4, 7, cactus.temperature)
    assert "AR reference run" in add_ar_run(session, 90.0, 32, reference_run=True).how


def test_the_throughput_line_starts_at_the_first_round_that_ran_a_forward(tiny_pair):
    """AR's first round runs no forward (the prefill's last row is its T_1): its token in about a
    millisecond is no speed, and as a point it set the live chart's scale."""
    run = _run(tiny_pair, "ar")
    points = charts.throughput_points(run.rounds, window=3)
    assert [x for x, _ in points] == [r.elapsed_seconds for r in run.rounds[1:]]
    second = run.rounds[1]
    assert points[0][1] == second.num_emitted / second.round_seconds

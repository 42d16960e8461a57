"""Playground logic without a browser: reducer, charts, inspector, limits, live tuning, stop."""

from __future__ import annotations

import threading
import time

import pytest

from engine.config import SpecConfig
from engine.decoding import generate
from playground import charts
from playground.inspector import inspect_figure, inspect_markdown
from playground.limits import Limits, build_config, inspector_width
from playground.runner import PlaygroundContext, compare_table, run_compare, stream_run, tokens_csv
from playground.session import SessionStore, apply_live_change
from playground.state import RunState, highlighted_tokens, reduce, summary
from playground.tutor import STAGES, explain_stage, round_tokens
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


def test_reducer_charts_and_inspector(tiny_pair):
    state = _run(tiny_pair)
    assert len(highlighted_tokens(state)) == len(state.tokens) == 24
    m = summary(state)
    assert m["induced_kl_exact"] is True and m["mean_induced_kl"] >= 0
    for fig in charts.live_figures(state, ar_baseline_tps=10.0):
        assert fig.layout.title.text
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


def test_stop_really_stops_the_engine(tiny_pair):
    ctx = PlaygroundContext("tiny", tiny_pair)
    stop = threading.Event()
    control = SpecConfig(method="sps", max_new_tokens=200, temperature=0.8)
    run = RunState(method="sps")
    for i, _ in enumerate(stream_run(ctx, control, tiny_pair.encode_prompt("hi"), stop, run, time.monotonic() + 60,
                                     yield_every=0)):
        if i == 2:
            stop.set()
    assert run.finish.reason == "stopped" and len(run.tokens) < 200
    assert ctx.active_runs == 0


def test_a_long_ar_run_alone_refreshes_the_ar_baseline(tiny_pair):
    """The "x AR" readouts follow the user's own AR runs: a start-up measurement taken while the
    machine was busy would otherwise skew every speedup shown."""
    ctx = PlaygroundContext("tiny", tiny_pair, ar_baseline_tps=1.0)

    def run(method: str, tokens: int) -> RunState:
        state = RunState(method=method)
        control = SpecConfig(method=method, max_new_tokens=tokens, temperature=0.8)
        for _ in stream_run(ctx, control, tiny_pair.encode_prompt("hi"), threading.Event(), state,
                            time.monotonic() + 60):
            pass
        return state

    run("ar", 8)  # too short to time
    run("sps", 40)  # not AR
    assert ctx.ar_baseline_tps == 1.0
    ar = run("ar", 40)
    assert ar.finish.metrics["new_tokens"] >= 32
    assert ctx.ar_baseline_tps == ar.finish.metrics["decode_tokens_per_s"] != 1.0
    assert "last AR run" in ctx.ar_baseline_note


def test_app_weights_flag_reaches_every_model_the_playground_makes(tiny_pair):
    import app

    args = app.parse_args(["--weights", "float32"])
    ctx = PlaygroundContext("tiny", tiny_pair, weight_dtype=args.weights)
    target, drafter = ctx.make_models("sps")
    assert target.backend_label == "fast/float32" and drafter.lm.backend_label == "fast/float32"
    with pytest.raises(SystemExit):
        app.parse_args(["--weights", "int3"])


def test_status_line_says_which_backend_and_weights_ran(tiny_pair):
    from playground.app import _status_line

    run = RunState(method="ar")
    ctx = PlaygroundContext("tiny", tiny_pair, weight_dtype="float32")
    for event in generate(*ctx.make_models("ar"), tiny_pair.tokenizer, tiny_pair.encode_prompt("hi"),
                          SpecConfig(method="ar", max_new_tokens=3)):
        reduce(run, event)
    assert "fast/float32 on cpu" in _status_line(run, None)


def test_compare_shares_draws_cactus_delta0_equals_sps(tiny_pair):
    ctx = PlaygroundContext("tiny", tiny_pair)
    cfg = SpecConfig(temperature=0.8, delta=0.0, max_new_tokens=16, seed=1)
    runs = list(run_compare(ctx, ["sps", "cactus"], cfg, tiny_pair.encode_prompt("hi"), threading.Event()))[-1][2]
    assert runs["sps"].token_ids == runs["cactus"].token_ids
    table = compare_table(runs)
    assert table["first_difference"].isna().all()
    assert tokens_csv(runs).count("\n") == 1 + 32


def test_sessions_are_separate():
    store = SessionStore()
    a, b = store.get("a"), store.get("b")
    assert a is not b and a.control is not b.control and store.get("a") is a
    store.drop("a")
    assert a.stop.is_set() and not b.stop.is_set()


def test_vllm_config_names():
    assert speculative_config(SpecConfig(method="ar"), "d") is None
    sps = speculative_config(SpecConfig(method="sps", temperature=0.7), "d")
    assert sps["num_speculative_tokens"] == 4 and sps["draft_sample_method"] == "probabilistic"
    assert speculative_config(SpecConfig(method="cactus", delta=0.5), "d")["cactus_delta"] == 0.5
    assert "typical_acceptance_sampler_posterior_threshold" in speculative_config(SpecConfig(method="tas"), "d")
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
        for _ in stream_run(ctx, cfg, tiny_pair.encode_prompt("hi"), threading.Event(), run, time.monotonic() + 120,
                            ssd=True):
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

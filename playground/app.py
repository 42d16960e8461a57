"""The Gradio Blocks: layout and wiring only. Every computation lives in the modules it calls.

Queue layout (ECOSYSTEM.md §3-4): engine jobs (generate, compare, sweep, learn) share one
`concurrency_id` with `Limits.concurrency` slots and a bounded queue; UI-only listeners (live
sliders, chart timer, token inspector, stop) have no concurrency limit, so they never wait behind
a running generation.
"""

from __future__ import annotations

import json
import tempfile
import threading
from pathlib import Path

import gradio as gr
import pandas as pd

from engine.config import SpecConfig
from engine.decoding import generate as engine_generate
from playground import charts
from playground.inspector import inspect_figure, inspect_markdown
from playground.limits import MAX_SSD_BUDGET, METHOD_LABELS, SSD_RULES, UI_METHODS, build_config, check_prompt_tokens
from playground.runner import (
    VLLM_TARGET_NAMES, PlaygroundContext, compare_table, run_compare, run_config_json, run_sweep,
    start_session_run, sweep_points, tokens_csv,
)
from playground.session import LIVE_FIELDS, Session, apply_live_change
from playground.state import STATUS_COLOURS, STATUS_MEANING, RunState, highlighted_tokens, reduce, summary
from playground.tutor import PRESETS, STAGES, explain_stage, round_figure, round_tokens
from playground.vllm_config import speculative_config_text

ENGINE_QUEUE = "engine"
CHART_HZ = 3.0
COMPARE_SLOTS = 5
CSS = """
.token-view span { font-family: ui-monospace, monospace; }
.legend-note { font-size: 0.85em; color: #555; }
"""
DEFAULT_PROMPT = "Write a short poem about the sea."
SYNC_METHODS = tuple(m for m in UI_METHODS if m != "ssd")  # the Learn tab steps a synchronous round
CHART_NAMES = ("per_position", "histogram", "divergence", "throughput", "timeline", "ssd_cache", "speedup")


def _legend() -> str:
    items = " · ".join(f"<span style='color:{STATUS_COLOURS[s]}'>■</span> <b>{s}</b>: {STATUS_MEANING[s]}"
                       for s in ("accepted", "recovered", "bonus", "generated"))
    return f"<div class='legend-note'>{items} · SSD: the cache chart colours each round green (cache hit) or red " \
           f"(miss: the backup drafted)</div>"


def _status_line(run: RunState, baseline: float | None) -> str:
    if run.start is None and not run.error:
        return "Ready."
    m = summary(run)
    state = ("error: " + run.error if run.error and run.finish is None else
             f"finished ({run.finish.reason})" if run.finish else "generating…")
    if run.error and run.finish is not None:
        state = f"finished ({run.finish.reason}): {run.error}"
    tps = m.get("decode_tokens_per_s") or m.get("tokens_per_s")
    parts = [f"**{state}**", f"{m.get('new_tokens', 0)} tokens"]
    if tps:
        parts.append(f"{tps:.1f} tok/s" + (f" ({tps / baseline:.2f}× AR)" if baseline else ""))
    if m.get("mean_acceptance_length"):
        parts.append(f"mean acceptance length {m['mean_acceptance_length']:.2f}")
    if m.get("draft_acceptance_rate") is not None:
        parts.append(f"draft acceptance {m['draft_acceptance_rate']:.0%}")
    parts.append(f"KL spent {m.get('kl_total', 0.0):.3f} nats")
    if m.get("cache_hit_rate") is not None:
        parts.append(f"SSD cache hit rate {m['cache_hit_rate']:.0%}")
    if any(w.kind == "degraded" for w in run.worker_events):
        parts.append("⚠️ draft worker lost: finished synchronously")
    if run.start:
        parts.append(f"{run.start.backend} on {run.start.devices}")  # e.g. fast/bfloat16 on cpu (2 threads)
    return " · ".join(parts)


def _details(run: RunState) -> dict:
    """The API-facing result: token ids, finish reason, metrics (what the load test compares)."""
    return {"method": run.method, "token_ids": run.token_ids,
            "finish_reason": run.finish.reason if run.finish else None, "error": run.error or None,
            "config_changes": [{"round": c.round_index, "token": c.token_index, "changes": c.changes}
                               for c in run.changes],
            "metrics": summary(run)}


def _token_view(label: str | None = None, **kwargs) -> gr.HighlightedText:
    return gr.HighlightedText(label=label, combine_adjacent=False, show_legend=True, show_inline_category=False,
                              color_map=dict(STATUS_COLOURS), elem_classes=["token-view"], **kwargs)


def build_demo(ctx: PlaygroundContext) -> gr.Blocks:
    limits = ctx.limits
    pair = ctx.pair
    start_k = min(pair.recommended_k(ctx.drafter_kind), limits.max_k)

    def session_of(request: gr.Request) -> Session:
        return ctx.sessions.get(getattr(request, "session_hash", None))

    def encode(prompt: str) -> list[int]:
        return check_prompt_tokens(limits, pair.encode_prompt(prompt))

    def validated(prompt: str, **settings) -> tuple[SpecConfig, list[int]]:
        """Settings and prompt checked together; a bad value is a readable gr.Error, never a traceback."""
        try:
            return build_config(limits, **settings), encode(prompt)
        except ValueError as err:
            raise gr.Error(str(err), print_exception=False) from None

    with gr.Blocks(title="specplay — speculative decoding playground") as demo:
        gr.Markdown(
            f"# specplay: watch speculative decoding work\n"
            f"Pair **{ctx.pair_name}**: target `{pair.target_model.config.model_type}` "
            f"({sum(p.numel() for p in pair.target_model.parameters()) / 1e6:.1f}M params), "
            f"draft: {pair.draft_description}. Devices: {ctx.devices}. {ctx.ar_baseline_note}."
        )
        with gr.Tabs():
            # ---------------------------------------------------------------- Generate
            with gr.Tab("Generate", id="generate"):
                with gr.Row():
                    with gr.Column(scale=1, min_width=320):
                        prompt = gr.Textbox(label="Prompt (chat template applied)", value=DEFAULT_PROMPT, lines=3,
                                            max_lines=8, elem_id="prompt")
                        method = gr.Radio([(METHOD_LABELS[m], m) for m in UI_METHODS], value="cactus",
                                          label="Method", elem_id="method")
                        with gr.Row():
                            generate_btn = gr.Button("Generate", variant="primary", elem_id="generate-btn")
                            stop_btn = gr.Button("Stop", variant="stop", elem_id="stop-btn")
                        gr.Markdown("**Live** (applies at the next round while generating):")
                        k = gr.Slider(1, limits.max_k, value=start_k, step=1, label="K (draft tokens per round)", elem_id="k")
                        delta = gr.Slider(0, 5, value=1.0, step=0.05, label="δ (Cactus KL budget per token, nats)",
                                          elem_id="delta")
                        temperature = gr.Slider(0, limits.max_temperature, value=0.8, step=0.05,
                                                label="temperature (0 = greedy)", elem_id="temperature")
                        with gr.Row():
                            top_p = gr.Slider(0.05, 1, value=0.95, step=0.01, label="top-p")
                            top_k = gr.Slider(0, 200, value=40, step=1, label="top-k (0 = off)")
                        with gr.Row():
                            eps = gr.Slider(0.001, 1, value=0.09, step=0.001, label="TAS ε (posterior threshold)")
                            alpha = gr.Slider(0.01, 1, value=0.3, step=0.01, label="TAS α (posterior alpha)")
                        live_msg = gr.Markdown("", elem_id="live-msg")
                        gr.Markdown("**Per run:**")
                        with gr.Row():
                            max_new = gr.Slider(1, limits.max_new_tokens, value=min(96, limits.max_new_tokens),
                                                step=1, label="max new tokens")
                            seed = gr.Number(value=0, precision=0, label="seed", minimum=0)
                        with gr.Accordion("SSD (Saguaro) settings (method SSD)", open=False):
                            ssd_rule = gr.Dropdown(list(SSD_RULES), value="sps", label="acceptance rule inside SSD")
                            fanout_mode = gr.Radio(["uniform", "geometric"], value="uniform",
                                                   label="fan-out F_0..F_K (geometric = Theorem 12)")
                            budget = gr.Slider(1, MAX_SSD_BUDGET, value=15, step=1, label="speculation budget B = Σ F_k")
                            downweight_c = gr.Slider(0.05, 1, value=1.0, step=0.05,
                                                     label="Saguaro down-weight C (1 = off)")
                            backup = gr.Dropdown(["neural", "fast", "ngram", "adaptive"], value="neural",
                                                 label="backup on a miss")
                            gr.Textbox(label="devices", value=ctx.ssd_devices or "default: draft on the last core, "
                                       "target on the others", interactive=False)
                    with gr.Column(scale=2):
                        status = gr.Markdown("Ready.", elem_id="status")
                        tokens = _token_view("Output (click a token to inspect it)", elem_id="tokens")
                        gr.Markdown(_legend())
                        with gr.Accordion("Token inspector", open=True):
                            inspect_plot = gr.Plot(label="candidates at this position", elem_id="inspector-plot")
                            inspect_md = gr.Markdown("Click a token above.", elem_id="inspector-md")
                        with gr.Accordion("Equivalent vLLM speculative_config", open=False):
                            vllm_code = gr.Code(language="python", label="vLLM", elem_id="vllm-code")
                        with gr.Accordion("Run details (JSON)", open=False):
                            details = gr.JSON(label="token ids, metrics, live changes")
                plots = []
                with gr.Row():
                    plots += [gr.Plot(elem_id="chart-per-position", show_label=False), gr.Plot(elem_id="chart-histogram", show_label=False)]
                with gr.Row():
                    plots += [gr.Plot(elem_id="chart-divergence", show_label=False), gr.Plot(elem_id="chart-throughput", show_label=False)]
                with gr.Row():
                    plots += [gr.Plot(elem_id="chart-timeline", show_label=False), gr.Plot(elem_id="chart-ssd", show_label=False)]
                with gr.Row():
                    plots += [gr.Plot(elem_id="chart-speedup", show_label=False)]
                timer = gr.Timer(1.0 / CHART_HZ, active=False)

            def generate(prompt_text, method_v, k_v, delta_v, temp_v, top_p_v, top_k_v, eps_v, alpha_v, max_new_v,
                         seed_v, rule_v="sps", fanout_mode_v="uniform", budget_v=15, c_v=1.0, backup_v="neural",
                         request: gr.Request = None):
                cfg, prompt_ids = validated(prompt_text, method=method_v, k=k_v, delta=delta_v,
                                            posterior_threshold=eps_v, posterior_alpha=alpha_v, temperature=temp_v,
                                            top_p=top_p_v, top_k=top_k_v, max_new_tokens=max_new_v, seed=seed_v,
                                            ssd_rule=rule_v, fanout_mode=fanout_mode_v, budget=budget_v,
                                            downweight_c=c_v, backup=backup_v)
                session = session_of(request)
                yield [], "generating…", gr.skip(), gr.Timer(active=True)
                for run in start_session_run(ctx, session, cfg, prompt_ids, ssd=method_v == "ssd"):
                    yield highlighted_tokens(run), _status_line(run, ctx.ar_baseline_tps), gr.skip(), gr.skip()
                yield (highlighted_tokens(run), _status_line(run, ctx.ar_baseline_tps), _details(run),
                       gr.Timer(active=False))

            def render_charts(request: gr.Request, force: bool = False):
                session = session_of(request)
                run = session.run
                if not force and run.version == session.rendered_version:
                    return [gr.skip()] * len(CHART_NAMES)
                session.rendered_version = run.version
                return list(charts.live_figures(run, ctx.ar_baseline_tps))

            def final_charts(request: gr.Request):
                return [*render_charts(request, force=True), gr.Timer(active=False)]

            def stop(request: gr.Request):
                session = session_of(request)
                session.stop.set()
                return _status_line(session.run, ctx.ar_baseline_tps).replace("generating…", "stopped")

            gen_inputs = [prompt, method, k, delta, temperature, top_p, top_k, eps, alpha, max_new, seed]
            ssd_inputs = [ssd_rule, fanout_mode, budget, downweight_c, backup]
            gen_event = generate_btn.click(
                generate, gen_inputs + ssd_inputs, [tokens, status, details, timer], api_name="generate",
                concurrency_limit=limits.concurrency, concurrency_id=ENGINE_QUEUE,
                time_limit=int(limits.max_seconds) + 30, show_progress="minimal",
            )
            gen_event.then(final_charts, None, [*plots, timer], api_visibility="private", concurrency_limit=None)
            prompt.submit(lambda: None, None, None, api_visibility="private")
            timer.tick(render_charts, None, plots, concurrency_limit=None, show_progress="hidden",
                       api_visibility="private")
            stop_btn.click(stop, None, [status], cancels=[gen_event], concurrency_limit=None, api_name="stop") \
                .then(final_charts, None, [*plots, timer], api_visibility="private", concurrency_limit=None)

            def make_live(name: str):
                def live(value, request: gr.Request) -> str:
                    session = session_of(request)
                    try:
                        apply_live_change(session.control, name, value, limits.max_k)
                    except ValueError as err:
                        return f"⚠️ not applied: {err}"
                    when = "applies at the next round" if session.run.running else "used by the next run"
                    return f"{name} = {value} ({when})"
                return live

            for name, component in zip(LIVE_FIELDS, (delta, k, temperature, top_p, top_k, eps, alpha)):
                component.change(make_live(name), [component], [live_msg], concurrency_limit=None,
                                 trigger_mode="always_last", show_progress="hidden",
                                 api_name=f"set_{name}", api_visibility="undocumented")

            def inspect(evt: gr.SelectData, request: gr.Request):
                run = session_of(request).run
                index = evt.index if isinstance(evt.index, int) else (evt.index or [0])[0]
                if not 0 <= index < len(run.tokens):
                    return gr.skip(), "That token is not part of the current run."
                return inspect_figure(run, index), inspect_markdown(run, index)

            tokens.select(inspect, None, [inspect_plot, inspect_md], concurrency_limit=None,
                          api_visibility="private")

            def show_vllm(method_v, k_v, delta_v, temp_v, top_p_v, top_k_v, eps_v, alpha_v, max_new_v, seed_v):
                try:
                    cfg = build_config(limits, method=method_v, k=k_v, delta=delta_v, posterior_threshold=eps_v,
                                       posterior_alpha=alpha_v, temperature=temp_v, top_p=top_p_v, top_k=top_k_v,
                                       max_new_tokens=max_new_v, seed=seed_v)
                except ValueError as err:
                    return f"# invalid settings: {err}"
                eagle = pair.feature_draft is not None and ctx.drafter_kind == "model"
                text = speculative_config_text(cfg, VLLM_TARGET_NAMES.get(ctx.pair_name, ctx.pair_name),
                                               pair.draft_description, "eagle" if eagle else ctx.drafter_kind)
                if method_v == "ssd":
                    return ("# vLLM has no asynchronous speculation cache (SSD); the synchronous equivalent of its "
                            "rule:\n" + text)
                return text

            vllm_inputs = gen_inputs[1:]
            for component in vllm_inputs:
                component.change(show_vllm, vllm_inputs, [vllm_code], concurrency_limit=None,
                                 show_progress="hidden", api_visibility="private")
            demo.load(show_vllm, vllm_inputs, [vllm_code], api_visibility="private")

            # ---------------------------------------------------------------- Compare
            with gr.Tab("Compare", id="compare"):
                gr.Markdown(
                    "The same prompt, seed and settings through each method. The engine draws every round's "
                    "random numbers from one seeded stream, so methods with the same K share the drafts and the "
                    "draws until their outputs first differ: differences up to there come from the rule alone "
                    "(`first_difference` in the table)."
                )
                with gr.Row():
                    c_prompt = gr.Textbox(label="Prompt", value=DEFAULT_PROMPT, lines=2, scale=3, elem_id="c-prompt")
                    c_methods = gr.CheckboxGroup([(METHOD_LABELS[m], m) for m in UI_METHODS],
                                                 value=["sps", "tas", "cactus"], label="Methods (2–5)", scale=2,
                                                 elem_id="c-methods")
                with gr.Row():
                    c_k = gr.Slider(1, limits.max_k, value=start_k, step=1, label="K")
                    c_delta = gr.Slider(0, 5, value=1.0, step=0.05, label="δ")
                    c_temp = gr.Slider(0, limits.max_temperature, value=0.8, step=0.05, label="temperature")
                    c_top_p = gr.Slider(0.05, 1, value=0.95, step=0.01, label="top-p")
                    c_top_k = gr.Slider(0, 200, value=40, step=1, label="top-k")
                with gr.Row():
                    c_eps = gr.Slider(0.001, 1, value=0.09, step=0.001, label="TAS ε")
                    c_alpha = gr.Slider(0.01, 1, value=0.3, step=0.01, label="TAS α")
                    c_max_new = gr.Slider(1, limits.max_new_tokens, value=min(64, limits.max_new_tokens), step=1,
                                          label="max new tokens")
                    c_seed = gr.Number(value=0, precision=0, label="seed", minimum=0)
                with gr.Row():
                    compare_btn = gr.Button("Run comparison", variant="primary", elem_id="compare-btn")
                    compare_stop = gr.Button("Stop", variant="stop")
                c_status = gr.Markdown("", elem_id="c-status")
                with gr.Row():
                    slots = [_token_view(f"slot {i + 1}", visible=i < 3, elem_id=f"c-slot-{i}")
                             for i in range(COMPARE_SLOTS)]
                c_table = gr.Dataframe(label="Summary (vLLM metric names)", interactive=False, elem_id="c-table")
                with gr.Row():
                    c_csv = gr.File(label="per-token data (CSV)", elem_id="c-csv")
                    c_json = gr.File(label="run config (JSON)", elem_id="c-json")

            def compare(prompt_text, methods_v, k_v, delta_v, temp_v, top_p_v, top_k_v, eps_v, alpha_v, max_new_v,
                        seed_v, request: gr.Request):
                methods_v = [m for m in (methods_v or []) if m in UI_METHODS]
                if not 2 <= len(methods_v) <= min(COMPARE_SLOTS, limits.max_compare_methods):
                    raise gr.Error("pick between 2 and 5 methods to compare", print_exception=False)
                cfg, prompt_ids = validated(prompt_text, method="sps", k=k_v, delta=delta_v,
                                            posterior_threshold=eps_v, posterior_alpha=alpha_v, temperature=temp_v,
                                            top_p=top_p_v, top_k=top_k_v, max_new_tokens=max_new_v, seed=seed_v)
                session = session_of(request)
                session.job_stop.set()
                session.job_stop = stop_event = threading.Event()

                def slot_updates(runs):
                    out = []
                    for i in range(COMPARE_SLOTS):
                        if i < len(methods_v):
                            run = runs.get(methods_v[i])
                            out.append(gr.HighlightedText(value=highlighted_tokens(run) if run else [],
                                                          label=METHOD_LABELS[methods_v[i]], visible=True))
                        else:
                            out.append(gr.HighlightedText(visible=False))
                    return out

                runs = {}
                for current, _run, runs in run_compare(ctx, methods_v, cfg, prompt_ids, stop_event):
                    if current:
                        yield [*slot_updates(runs), f"running **{current}**…", compare_table(runs), gr.skip(),
                               gr.skip()]
                folder = Path(tempfile.mkdtemp(prefix="specplay-compare-"))
                (folder / "tokens.csv").write_text(tokens_csv(runs))
                (folder / "run_config.json").write_text(run_config_json(ctx, prompt_text, prompt_ids, cfg, runs))
                done = "stopped" if stop_event.is_set() and len(runs) < len(methods_v) else "done"
                yield [*slot_updates(runs), f"**{done}**: {len(runs)} method(s)", compare_table(runs),
                       str(folder / "tokens.csv"), str(folder / "run_config.json")]

            compare_event = compare_btn.click(
                compare, [c_prompt, c_methods, c_k, c_delta, c_temp, c_top_p, c_top_k, c_eps, c_alpha, c_max_new,
                          c_seed], [*slots, c_status, c_table, c_csv, c_json], api_name="compare",
                concurrency_limit=limits.concurrency, concurrency_id=ENGINE_QUEUE,
                time_limit=int(limits.max_seconds) + 30,
            )
            def stop_job(request: gr.Request) -> None:
                session_of(request).job_stop.set()

            compare_stop.click(stop_job, None, None, cancels=[compare_event],
                               concurrency_limit=None, api_visibility="private")

            # ---------------------------------------------------------------- Sweep
            with gr.Tab("Sweep", id="sweep"):
                gr.Markdown(
                    "Acceptance against divergence: Cactus over a δ sweep, TAS over an ε sweep, SpS as the "
                    "zero-divergence reference. Divergence is the exact KL(induced ‖ target) of the first token "
                    "each round emits (`engine.acceptance.induced_distribution`), averaged over tested positions. "
                    "The Cactus paper's argument is that its points lie on the Pareto frontier."
                )
                with gr.Row():
                    s_prompt = gr.Textbox(label="Prompt", value="Write a list of twenty random, unrelated words.",
                                          lines=2, scale=3)
                    s_deltas = gr.Textbox(label="δ values (Cactus)", value="0.1, 0.5, 1, 2")
                    s_eps = gr.Textbox(label="ε values (TAS)", value="0.3, 0.09, 0.03")
                with gr.Row():
                    s_temp = gr.Slider(0.05, limits.max_temperature, value=1.0, step=0.05, label="temperature")
                    s_k = gr.Slider(1, limits.max_k, value=start_k, step=1, label="K")
                    s_max_new = gr.Slider(8, limits.max_sweep_new_tokens, value=min(48, limits.max_sweep_new_tokens),
                                          step=1, label="new tokens per point")
                    s_seed = gr.Number(value=0, precision=0, label="seed", minimum=0)
                with gr.Row():
                    sweep_btn = gr.Button("Run sweep", variant="primary", elem_id="sweep-btn")
                    sweep_stop = gr.Button("Stop", variant="stop")
                s_plot = gr.Plot(elem_id="sweep-plot", show_label=False)
                s_table = gr.Dataframe(label="Sweep points", interactive=False)

            def parse_values(text: str, label: str, lo: float, hi: float) -> list[float]:
                try:
                    values = [float(v) for v in str(text).replace(";", ",").split(",") if v.strip()]
                except ValueError:
                    raise ValueError(f"{label}: write numbers separated by commas, e.g. 0.1, 0.5, 1") from None
                bad = [v for v in values if not lo <= v <= hi]
                if bad:
                    raise ValueError(f"{label} must lie in [{lo}, {hi}]; got {bad}")
                return values

            def sweep(prompt_text, deltas_v, eps_v, temp_v, k_v, max_new_v, seed_v, request: gr.Request,
                      progress=gr.Progress()):
                try:
                    points = sweep_points(parse_values(deltas_v, "δ values", 0, limits.max_delta),
                                          parse_values(eps_v, "ε values", 1e-4, 1.0))
                    if len(points) > limits.max_sweep_points + 1:
                        raise ValueError(f"at most {limits.max_sweep_points} sweep points (δ and ε together)")
                    cfg = build_config(limits, method="sps", k=k_v, delta=1.0, posterior_threshold=0.09,
                                       posterior_alpha=0.3, temperature=temp_v, top_p=1.0, top_k=0,
                                       max_new_tokens=min(int(max_new_v), limits.max_sweep_new_tokens), seed=seed_v)
                    prompt_ids = encode(prompt_text)
                except ValueError as err:
                    raise gr.Error(str(err), print_exception=False) from None
                session = session_of(request)
                session.job_stop.set()
                session.job_stop = stop_event = threading.Event()
                results = run_sweep(ctx, cfg, prompt_ids, points, stop_event,
                                    progress=lambda f, d: progress(f, desc=d))
                table = pd.DataFrame(results).round(4) if results else pd.DataFrame()
                return charts.pareto_figure(results), table

            sweep_event = sweep_btn.click(
                sweep, [s_prompt, s_deltas, s_eps, s_temp, s_k, s_max_new, s_seed], [s_plot, s_table],
                api_name="sweep", concurrency_limit=limits.concurrency, concurrency_id=ENGINE_QUEUE,
                time_limit=int(limits.max_seconds) + 30,
            )
            sweep_stop.click(stop_job, None, None, cancels=[sweep_event],
                             concurrency_limit=None, api_visibility="private")

            # ---------------------------------------------------------------- Learn
            with gr.Tab("Learn", id="learn"):
                gr.Markdown("Step through speculative decoding one round at a time: "
                            + " → ".join(STAGES) + ". Pick a preset, press **Start**, then **Next step**.")
                with gr.Row():
                    preset = gr.Dropdown(list(PRESETS), value=next(iter(PRESETS)), label="Preset", scale=2)
                    l_method = gr.Radio([(METHOD_LABELS[m], m) for m in SYNC_METHODS], value="tas", label="Method",
                                        scale=2)
                with gr.Row():
                    l_prompt = gr.Textbox(label="Prompt", lines=2, scale=3)
                    l_k = gr.Slider(1, 8, value=4, step=1, label="K")
                    l_delta = gr.Slider(0, 5, value=0.5, step=0.05, label="δ")
                    l_temp = gr.Slider(0, limits.max_temperature, value=1.0, step=0.05, label="temperature")
                l_look_for = gr.Markdown()
                with gr.Row():
                    start_btn = gr.Button("Start", variant="primary")
                    step_btn = gr.Button("Next step")
                    round_btn = gr.Button("Next round")
                with gr.Row():
                    with gr.Column(scale=3):
                        l_tokens = _token_view("Text so far")
                        l_explain = gr.Markdown("Press Start.")
                    with gr.Column(scale=2):
                        l_plot = gr.Plot(show_label=False)

            def apply_preset(name):
                p = PRESETS[name]
                return p.prompt, p.method, p.k, p.delta, p.temperature, f"**What to look for:** {p.look_for}"

            preset.change(apply_preset, [preset], [l_prompt, l_method, l_k, l_delta, l_temp, l_look_for],
                          api_visibility="private", concurrency_limit=None)
            demo.load(apply_preset, [preset], [l_prompt, l_method, l_k, l_delta, l_temp, l_look_for],
                      api_visibility="private")

            def tutor_view(session: Session):
                run = session.tutor_state
                rnd = run.round_of(session.tutor_round)
                if rnd is None:
                    done = run.finish.reason if run.finish else "no round yet"
                    return highlighted_tokens(run), f"Generation finished ({done}). Press Start again.", gr.skip()
                these = round_tokens(run, rnd.round_index)
                shown = [t for t in run.tokens if t.round_index < rnd.round_index or
                         (t.round_index == rnd.round_index and session.tutor_stage >= 3)]
                view = [(t.text or "·", t.status) for t in shown]
                return view, explain_stage(rnd, these, session.tutor_stage), round_figure(rnd, these)

            def tutor_next_round(session: Session):
                with session.tutor_lock:
                    if session.tutor is None:
                        raise gr.Error("Press Start first.", print_exception=False)
                    for event in session.tutor:
                        reduce(session.tutor_state, event)
                        if hasattr(event, "accepted_positions"):
                            session.tutor_round, session.tutor_stage = event.round_index, 0
                            return tutor_view(session)
                    session.tutor, session.tutor_round = None, -1
                    return tutor_view(session)

            def tutor_start(prompt_text, method_v, k_v, delta_v, temp_v, preset_v, request: gr.Request):
                p = PRESETS[preset_v]
                cfg, prompt_ids = validated(prompt_text, method=method_v, k=k_v, delta=delta_v,
                                            posterior_threshold=p.posterior_threshold,
                                            posterior_alpha=p.posterior_alpha, temperature=temp_v, top_p=p.top_p,
                                            top_k=p.top_k, max_new_tokens=min(64, limits.max_new_tokens), seed=0)
                session = session_of(request)
                session.tutor_stop.set()
                session.tutor_stop = threading.Event()
                control = ctx.with_inspector(cfg)
                session.tutor_state = RunState(method=cfg.method, config=control.as_dict())
                target, drafter = ctx.make_models(cfg.method)
                session.tutor = engine_generate(target, drafter, pair.tokenizer, prompt_ids, control,
                                                eos_token_ids=pair.eos_token_ids, stop=session.tutor_stop)
                return tutor_next_round(session)

            def tutor_step(request: gr.Request):
                session = session_of(request)
                if session.tutor_round < 0:
                    raise gr.Error("Press Start first.", print_exception=False)
                if session.tutor_stage + 1 < len(STAGES):
                    session.tutor_stage += 1
                    return tutor_view(session)
                return tutor_next_round(session)

            l_outputs = [l_tokens, l_explain, l_plot]
            start_btn.click(tutor_start, [l_prompt, l_method, l_k, l_delta, l_temp, preset], l_outputs,
                            concurrency_limit=limits.concurrency, concurrency_id=ENGINE_QUEUE, api_name="learn_start")
            step_btn.click(tutor_step, None, l_outputs, concurrency_limit=limits.concurrency,
                           concurrency_id=ENGINE_QUEUE, api_name="learn_step")
            def tutor_round(request: gr.Request):
                return tutor_next_round(session_of(request))

            round_btn.click(tutor_round, None, l_outputs,
                            concurrency_limit=limits.concurrency, concurrency_id=ENGINE_QUEUE,
                            api_visibility="private")

        def health() -> str:
            return json.dumps({"pair": ctx.pair_name, "active_runs": ctx.active_runs, "sessions": len(ctx.sessions),
                               "ar_baseline_tps": ctx.ar_baseline_tps, "devices": ctx.devices})

        health_out = gr.Textbox(visible=False)
        gr.Button(visible=False).click(health, None, health_out, api_name="health", concurrency_limit=None)
        def forget_session(request: gr.Request) -> None:
            ctx.sessions.drop(getattr(request, "session_hash", None))

        demo.unload(forget_session)
    return demo


def launch(ctx: PlaygroundContext, host: str, port: int) -> None:
    demo = build_demo(ctx)
    demo.queue(max_size=ctx.limits.queue_size, default_concurrency_limit=ctx.limits.concurrency)
    demo.launch(server_name=host, server_port=port, css=CSS, theme=gr.themes.Soft(), ssr_mode=False,
                show_error=True, footer_links=["api"])

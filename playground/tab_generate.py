"""The Generate tab's wiring: one run per session, streamed, with live knobs and Pause / Step / Resume / Stop.

The run lives on the engine thread (`playground.engine_loop`); these handlers only start it, read
its folded state at the page's frame rate and forward the controls. Pause parks the engine at the
next round boundary (or, pressed before Generate, after the next run's first round), so a workshop
can change δ, K or SSD's fan-out and watch exactly one round under the new settings.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

import gradio as gr

from playground import charts
from playground.inspector import inspect_figure, inspect_markdown
from playground.live_feed import ATTACH_SECONDS
from playground.limits import DEFAULT_PROMPT, DEFAULT_SETTINGS, MAX_SSD_BUDGET, METHOD_LABELS, SSD_RULES, UI_METHODS, build_config
from playground.page import ENGINE_QUEUE, HANG_GUARD_SECONDS, Page
from playground.runner import VLLM_TARGET_NAMES, ar_reference_config, start_session_run, wants_ar_reference_run
from playground.session import LIVE_FIELDS, apply_live_change
from playground.state import RunState, highlighted_tokens
from playground.views import STREAMING_STATUS, details, legend, progress_line, status_line, token_view
from playground.vllm_config import speculative_config_text

# Chromium shares the machine with the engine: every chart redraw is CPU taken from the engine's
# threads (measured with playground.browser_bench). So while a run streams, only the two key
# charts next to the tokens are live: as lines the page draws from the live feed, or, for a page
# without one, redrawn one at a time in turn on the timer; all seven redraw when it pauses or ends.
CHART_HZ = 1.0  # the timer's chart cadence, for a page without the live feed
CHART_IDS = ("chart-per-position", "chart-histogram", "chart-divergence", "chart-throughput", "chart-timeline",
             "chart-ssd", "chart-speedup")
LIVE_CHART_IDS = ("chart-throughput", "chart-divergence")
STATUS_EVERY = 3  # token-view frames per status-line update while streaming


def build(page: Page, demo: gr.Blocks) -> dict[str, gr.components.Component]:
    ctx, limits, pair = page.ctx, page.limits, page.ctx.pair
    d = DEFAULT_SETTINGS
    start_k = min(pair.recommended_k(ctx.drafter_kind), limits.max_k)
    with gr.Row():
        with gr.Column(scale=1, min_width=320):
            prompt = gr.Textbox(label="Prompt (chat template applied)", value=DEFAULT_PROMPT, lines=3,
                                max_lines=8, elem_id="prompt")
            method = gr.Radio([(METHOD_LABELS[m], m) for m in UI_METHODS], value=d["method"], label="Method",
                              elem_id="method")
            with gr.Row():
                generate_btn = gr.Button("Generate", variant="primary", elem_id="generate-btn")
                stop_btn = gr.Button("Stop", variant="stop", elem_id="stop-btn")
            with gr.Row():
                pause_btn = gr.Button("Pause", size="sm", elem_id="pause-btn")
                step_btn = gr.Button("Step one round", size="sm", elem_id="step-btn")
                resume_btn = gr.Button("Resume", size="sm", elem_id="resume-btn")
            gr.Markdown("**Live** (applies at the next round while generating):")
            k = gr.Slider(1, limits.max_k, value=start_k, step=1, label="K (draft tokens per round)", elem_id="k")
            delta = gr.Slider(0, 5, value=d["delta"], step=0.05, label="δ (Cactus: bound on each step's KL(h‖T), nats)",
                              elem_id="delta")
            temperature = gr.Slider(0, limits.max_temperature, value=d["temperature"], step=0.05,
                                    label="temperature (0 = greedy)", elem_id="temperature")
            with gr.Row():
                top_p = gr.Slider(0.05, 1, value=d["top_p"], step=0.01, label="top-p")
                top_k = gr.Slider(0, 200, value=d["top_k"], step=1, label="top-k (0 = off)")
            with gr.Row():
                eps = gr.Slider(0.001, 1, value=d["posterior_threshold"], step=0.001, label="TAS ε (posterior threshold)")
                alpha = gr.Slider(0.01, 1, value=d["posterior_alpha"], step=0.01, label="TAS α (posterior alpha)")
            with gr.Accordion("SSD (Saguaro) settings (method SSD; live except the rule)", open=False):
                ssd_rule = gr.Dropdown(list(SSD_RULES), value="sps", label="acceptance rule inside SSD (per run)")
                fanout_mode = gr.Radio(["uniform", "geometric"], value="uniform", elem_id="fanout-mode",
                                       label="fan-out F_0..F_K (geometric = Theorem 12)")
                budget = gr.Slider(1, MAX_SSD_BUDGET, value=15, step=1, label="speculation budget B = Σ F_k",
                                   elem_id="budget")
                downweight_c = gr.Slider(0.05, 1, value=1.0, step=0.05, label="Saguaro down-weight C (1 = off)",
                                         elem_id="downweight-c")
                backup = gr.Dropdown(["neural", "fast", "ngram", "adaptive"], value="neural",
                                     label="backup on a miss", elem_id="backup")
                gr.Textbox(label="devices", value=ctx.ssd_devices or "default: draft on the last core, "
                           "target on the others", interactive=False)
            live_msg = gr.Markdown("", elem_id="live-msg")
            gr.Markdown("**Per run:**")
            with gr.Row():
                max_new = gr.Slider(1, limits.max_new_tokens, value=min(d["max_new_tokens"], limits.max_new_tokens),
                                    step=1, label="max new tokens")
                seed = gr.Number(value=d["seed"], precision=0, label="seed", minimum=0)
        with gr.Column(scale=2):
            with gr.Column(elem_id="run-view"):  # held at its height while a run streams (live_feed.PAGE_JS)
                status = gr.Markdown("Ready.", elem_id="status")
                live = gr.HTML("", elem_id="tokens-live", padding=False)  # the live feed while a run streams
                tokens = token_view("Output (click a token to inspect it)", elem_id="tokens")
            feed_id = gr.Textbox("", visible=False)  # the page's live feed, named by its click (API calls: none)
            gr.Markdown(legend())
            plots = []
            with gr.Row():
                plots += [gr.Plot(elem_id=CHART_IDS[3], show_label=False), gr.Plot(elem_id=CHART_IDS[2], show_label=False)]
            with gr.Accordion("Token inspector", open=True):
                inspect_plot = gr.Plot(label="candidates at this position", elem_id="inspector-plot")
                inspect_md = gr.Markdown("Click a token above.", elem_id="inspector-md")
            with gr.Accordion("Equivalent vLLM speculative_config", open=False):
                vllm_code = gr.Code(language="python", label="vLLM", elem_id="vllm-code")
            with gr.Accordion("Run details (JSON)", open=False):
                run_details = gr.JSON(label="token ids, metrics, live changes")
    with gr.Row():
        plots += [gr.Plot(elem_id=CHART_IDS[0], show_label=False), gr.Plot(elem_id=CHART_IDS[1], show_label=False)]
    with gr.Row():
        plots += [gr.Plot(elem_id=CHART_IDS[4], show_label=False), gr.Plot(elem_id=CHART_IDS[5], show_label=False)]
    with gr.Row():
        plots += [gr.Plot(elem_id=CHART_IDS[6], show_label=False)]
    # plots are in layout order; live_figures returns them in CHART_IDS order
    order = [CHART_IDS.index(p.elem_id) for p in plots]
    timer = gr.Timer(1.0 / CHART_HZ, active=False)

    def figures(run, reference):
        all_figures = charts.live_figures(run, reference.tokens_per_s if reference else None)
        return [all_figures[i] for i in order]

    def live_chart(session, run: RunState, turn: int):
        """The live chart whose turn it is and its figure. One per redraw: a Plotly redraw blocks the
        page's main thread, and two at once held the token view for over 0.3 s."""
        chart_id = LIVE_CHART_IDS[turn % len(LIVE_CHART_IDS)]
        if chart_id == "chart-throughput":
            reference = ctx.reference_for(session)
            return chart_id, charts.throughput(run, reference.tokens_per_s if reference else None)
        return chart_id, charts.divergence_budget(run)

    def generate(prompt_text, method_v, k_v, delta_v, temp_v, top_p_v, top_k_v, eps_v, alpha_v, max_new_v,
                 seed_v, rule_v="sps", fanout_mode_v="uniform", budget_v=15, c_v=1.0, backup_v="neural",
                 feed_v="", request: gr.Request = None):
        cfg, prompt_ids = page.validated(prompt_text, method=method_v, k=k_v, delta=delta_v,
                                         posterior_threshold=eps_v, posterior_alpha=alpha_v, temperature=temp_v,
                                         top_p=top_p_v, top_k=top_k_v, max_new_tokens=max_new_v, seed=seed_v,
                                         ssd_rule=rule_v, fanout_mode=fanout_mode_v, budget=budget_v,
                                         downweight_c=c_v, backup=backup_v)
        session = page.session(request)
        if feed_v and wants_ar_reference_run(session, cfg):  # a page's first speculative run
            session.ar_reference_run = True
            # Short: the live line must not wrap anew as its numbers grow (that moves the page below it).
            lead = f"**AR reference run** for {METHOD_LABELS[method_v]}'s × AR · "
            # The run asked for follows on the page's box, on a feed named after this one.
            run = yield from on_page(session, ar_reference_config(cfg), prompt_ids, lead=lead, feed_id=feed_v,
                                     next_id=f"{feed_v}-run")
            if not run.completed:
                yield final_update(session, run, lead)
                return
            live = session.control  # knobs turned during the reference run hold for the run asked for
            cfg = replace(cfg, **{name: getattr(live, name) for name in LIVE_FIELDS})
            feed_v = f"{feed_v}-run"
        run = yield from on_page(session, cfg, prompt_ids, ssd=method_v == "ssd", feed_id=feed_v)
        yield final_update(session, run)

    def on_page(session, cfg, prompt_ids, *, ssd=False, feed_id="", next_id=None, lead=""):
        """Stream one session run to the page (over the live feed `feed_id` where the page named one)
        and return its final state; the caller sends the final update. `lead`: the AR reference run's
        words before its status lines."""
        runs = start_session_run(ctx, session, cfg, prompt_ids, ssd=ssd, reference_run=bool(lead))
        run, live_feed = next(runs), None
        if feed_id:  # the page streams tokens from the live feed; Gradio updates the status line only
            handle, loop = session.handle, loop_of(session)  # when the run pauses, resumes or ends

            def live_lines(r: RunState) -> dict[str, charts.LiveSeries]:
                reference = ctx.reference_for(session)
                return charts.live_series(r, reference.tokens_per_s if reference else None)

            live_feed = ctx.feeds.open(handle, lambda r: lead + progress_line(r, ctx.reference_for(session)),
                                       lambda: loop.stop(handle), live_lines, feed_id=feed_id, next_id=next_id)
        shown, frames, paused = None, 0, False
        for run in runs:
            if live_feed is not None and (live_feed.opened.is_set()
                                          or time.monotonic() - live_feed.created < ATTACH_SECONDS):
                if run.paused != paused and run.start is not None:  # the timer draws every chart while paused
                    paused = run.paused
                    yield (gr.skip(), lead + status_line(run, ctx.reference_for(session)) if paused
                           else STREAMING_STATUS, gr.skip(), gr.Timer(active=paused), gr.skip())
                continue  # the page reads the feed (or is about to open it)
            frame = (run.version, run.paused)
            if frame != shown:
                shown, frames = frame, frames + 1
                # The status line is Markdown (costly to re-render in the browser): every third frame.
                status_now = frames % STATUS_EVERY == 1 or run.paused
                # The first frame empties the live view: a page whose feed this run does not use gets
                # its token view back.
                yield (highlighted_tokens(run), lead + status_line(run, ctx.reference_for(session)) if status_now
                       else gr.skip(), gr.skip(), gr.Timer(active=True) if frames == 1 else gr.skip(),
                       "" if frames == 1 else gr.skip())
        return run

    def final_update(session, run, lead=""):
        reference = ctx.reference_for(session)
        return (highlighted_tokens(run), lead + status_line(run, reference), details(run, reference),
                gr.Timer(active=False), "")

    def render_charts(request: gr.Request, force: bool = False):
        session = page.session(request)
        run = session.handle.state() if session.handle is not None else session.run
        streaming = run.running and not run.paused and not force
        if not force and (run.version, streaming) == session.rendered_version:
            return [gr.skip()] * len(plots)
        session.rendered_version = (run.version, streaming)
        if not streaming:
            return figures(run, ctx.reference_for(session))
        live, figure = live_chart(session, run, session.chart_turn)
        session.chart_turn += 1
        return [figure if p.elem_id == live else gr.skip() for p in plots]

    def final_charts(request: gr.Request):
        return [*render_charts(request, force=True), gr.Timer(active=False)]

    def current(request: gr.Request):
        session = page.session(request)
        handle = session.handle
        return session, (handle if handle is not None and not handle.done.is_set() else None)

    def loop_of(session):
        return ctx.loop_for(session.handle_ssd)

    def pause(request: gr.Request) -> str:
        session, handle = current(request)
        if handle is None:
            session.pause_next = True
            return "Pause armed: the next run parks after its first round (then Step or Resume)."
        loop_of(session).pause(handle)
        handle.wait(lambda h: h.parked or h.done.is_set(), HANG_GUARD_SECONDS)
        return status_line(handle.state(), ctx.reference_for(session))

    def step(request: gr.Request) -> str:
        session, handle = current(request)
        if handle is None or not handle.paused:
            return "Step works on a paused run: press Pause first."
        before = handle.rounds_done
        loop_of(session).step(handle)
        handle.wait(lambda h: h.done.is_set() or (h.parked and h.rounds_done > before), HANG_GUARD_SECONDS)
        return status_line(handle.state(), ctx.reference_for(session))

    def resume(request: gr.Request) -> str:
        session, handle = current(request)
        session.pause_next = False
        if handle is None:
            return "Nothing paused."
        loop_of(session).resume(handle)
        return "Resumed."

    def stop(request: gr.Request) -> str:
        session, handle = current(request)
        session.pause_next = False
        if handle is None:
            return "Nothing running."
        loop_of(session).stop(handle)
        return "Stopping at the next round boundary…"

    gen_inputs = [prompt, method, k, delta, temperature, top_p, top_k, eps, alpha, max_new, seed]
    ssd_inputs = [ssd_rule, fanout_mode, budget, downweight_c, backup]
    # The click first runs in the browser alone (live_feed.PAGE_JS): the streaming status line, an
    # empty token view and the live box on the page's own feed, before the server has the request.
    start_js = ("() => { const [id, box] = window.specplayFeed ? window.specplayFeed() : ['', '']; "
                f"return [[], {json.dumps(STREAMING_STATUS)}, box, id]; }}")
    gen_event = generate_btn.click(None, None, [tokens, status, live, feed_id], js=start_js, queue=False,
                                   show_progress="hidden").then(
        generate, gen_inputs + ssd_inputs + [feed_id], [tokens, status, run_details, timer, live],
        api_name="generate", concurrency_limit=limits.concurrency, concurrency_id=ENGINE_QUEUE,
        time_limit=int(limits.max_seconds) + 30, show_progress="hidden",  # a spinner repaints every frame
    )
    gen_event.then(final_charts, None, [*plots, timer], api_visibility="private", concurrency_limit=None,
                   show_progress="hidden")
    timer.tick(render_charts, None, plots, concurrency_limit=None, show_progress="hidden", api_visibility="private")
    for button, handler, name in ((pause_btn, pause, "pause"), (step_btn, step, "step"),
                                  (resume_btn, resume, "resume"), (stop_btn, stop, "stop")):
        button.click(handler, None, [live_msg], concurrency_limit=None, api_name=name, show_progress="hidden")

    def make_live(name: str):
        def live(value, request: gr.Request) -> str:
            session = page.session(request)
            try:
                apply_live_change(session.control, name, value, limits.max_k)
            except ValueError as err:
                return f"⚠️ not applied: {err}"
            run = session.run
            when = ("used by the next run" if not run.running else
                    "applies within two rounds: SSD asks its worker for a round's speculation one round ahead"
                    if run.method == "ssd" else "applies at the next round")
            return f"{name} = {value} ({when})"
        return live

    live_components = {"delta": delta, "num_speculative_tokens": k, "temperature": temperature, "top_p": top_p,
                       "top_k": top_k, "posterior_threshold": eps, "posterior_alpha": alpha,
                       "ssd_fanout_mode": fanout_mode, "ssd_budget": budget, "downweight_c": downweight_c,
                       "ssd_backup": backup}
    for name, component in live_components.items():
        component.change(make_live(name), [component], [live_msg], concurrency_limit=None,
                         trigger_mode="always_last", show_progress="hidden",
                         api_name=f"set_{name}", api_visibility="undocumented")

    def method_changed(method_v, request: gr.Request) -> str:
        run = page.session(request).run
        if run.running and method_v != run.method:
            return (f"Method {METHOD_LABELS[method_v]} applies to the next run; this run stays "
                    f"{METHOD_LABELS.get(run.method, run.method)}.")
        return ""

    method.change(method_changed, [method], [live_msg], concurrency_limit=None, show_progress="hidden",
                  api_visibility="private")

    def inspect(evt: gr.SelectData, request: gr.Request):
        run = page.session(request).run
        index = evt.index if isinstance(evt.index, int) else (evt.index or [0])[0]
        if not 0 <= index < len(run.tokens):
            return gr.skip(), "That token is not part of the current run."
        return inspect_figure(run, index), inspect_markdown(run, index)

    tokens.select(inspect, None, [inspect_plot, inspect_md], concurrency_limit=None, api_visibility="private")

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
            return "# vLLM has no asynchronous speculation cache (SSD); the synchronous equivalent of its rule:\n" + text
        return text

    vllm_inputs = gen_inputs[1:]
    for component in vllm_inputs:
        component.change(show_vllm, vllm_inputs, [vllm_code], concurrency_limit=None, show_progress="hidden",
                         api_visibility="private")
    demo.load(show_vllm, vllm_inputs, [vllm_code], api_visibility="private", show_progress="hidden")
    # The first screen: every chart titled, with a one-line hint, before any run (this also loads
    # Plotly before the first run instead of blocking the page when the first tokens arrive).
    demo.load(lambda: figures(RunState(), None), None, plots, api_visibility="private", show_progress="hidden")
    return {"prompt": prompt, "method": method, "k": k, "delta": delta, "temperature": temperature, "top_p": top_p,
            "top_k": top_k, "posterior_threshold": eps, "posterior_alpha": alpha}

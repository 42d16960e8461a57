"""The Learn tab's wiring: one round at a time, stage by stage.

The round runs on the engine thread as a paused run: Start parks it after its first round and
Next round steps it once (`EngineLoop.step`), so the tutor never calls the engine from a UI thread.
"""

from __future__ import annotations

import time

import gradio as gr

from playground import charts
from playground.limits import METHOD_LABELS, UI_METHODS
from playground.page import ENGINE_QUEUE, HANG_GUARD_SECONDS, Page
from playground.presets import PRESETS
from playground.runner import start_run
from playground.session import Session
from playground.state import RunState, highlighted_tokens
from playground.tutor import STAGES, divergence_line, explain_stage, round_figure, round_tokens, shown_tokens, stages
from playground.views import token_view

TUTOR_SECONDS = 1800.0  # a paused lesson may sit between clicks; the engine loop ends it after this
GENERATE_FIELDS = ("prompt", "method", "k", "delta", "temperature", "top_p", "top_k", "posterior_threshold",
                   "posterior_alpha")  # the Generate controls "Open in Generate" fills
SYNC_METHODS = tuple(m for m in UI_METHODS if m != "ssd")  # the Learn tab steps a synchronous round


def build(page: Page, tabs: gr.Tabs, generate: dict[str, gr.components.Component]) -> None:
    """`tabs` and the Generate tab's controls (`tab_generate.build`'s return) serve "Open in Generate"."""
    ctx, limits = page.ctx, page.limits
    gr.Markdown("Step through speculative decoding one round at a time: "
                + " → ".join(STAGES) + " (AR: the target samples one token). Pick a preset, press **Start**, "
                "then **Next step**.")

    def apply_preset(name):
        p = PRESETS[name]
        claim = getattr(p, "claim", "")
        text = (f"**Claim:** {claim}\n\n" if claim else "") + f"**What to look for:** {p.look_for}"
        return p.prompt, p.method, p.k, p.delta, p.temperature, text

    # The first preset is the controls' initial value, not a page-load event: a load event that
    # landed after the visitor had typed a prompt replaced it (seen in CI on a loaded machine).
    first = next(iter(PRESETS))
    prompt0, method0, k0, delta0, temp0, look_for0 = apply_preset(first)
    with gr.Row():
        preset = gr.Dropdown(list(PRESETS), value=first, label="Preset", scale=2)
        l_method = gr.Radio([(METHOD_LABELS[m], m) for m in SYNC_METHODS], value=method0, label="Method",
                            scale=2, elem_id="learn-method")
    with gr.Row():
        l_prompt = gr.Textbox(prompt0, label="Prompt", lines=2, scale=3, elem_id="learn-prompt")
        l_k = gr.Slider(1, 8, value=k0, step=1, label="K")
        l_delta = gr.Slider(0, 5, value=delta0, step=0.05, label="δ")
        l_temp = gr.Slider(0, limits.max_temperature, value=temp0, step=0.05, label="temperature")
    l_look_for = gr.Markdown(look_for0)
    with gr.Row():
        start_btn = gr.Button("Start", variant="primary", elem_id="learn-start")
        step_btn = gr.Button("Next step", elem_id="learn-step")
        round_btn = gr.Button("Next round")
        open_btn = gr.Button("Open in Generate", elem_id="learn-open-generate")
    with gr.Row():
        with gr.Column(scale=3):
            l_tokens = token_view("Text so far", elem_id="learn-tokens")
            l_explain = gr.Markdown("Press Start.", elem_id="learn-explain")
            l_divergence = gr.Markdown(elem_id="learn-divergence")
        with gr.Column(scale=2):
            l_plot = gr.Plot(charts.empty_chart("One round, stage by stage", "press Start: each step draws one stage: "
                                                + " → ".join(STAGES)),
                             show_label=False, elem_id="learn-plot")

    preset.change(apply_preset, [preset], [l_prompt, l_method, l_k, l_delta, l_temp, l_look_for],
                  api_visibility="private", concurrency_limit=None, show_progress="hidden")

    def tutor_view(session: Session):
        run = session.tutor_state
        rnd = run.round_of(session.tutor_round)
        if rnd is None:
            done = run.finish.reason if run.finish else "no round yet"
            return (highlighted_tokens(run), f"Generation finished ({done}). Press Start again.",
                    divergence_line(run, len(run.rounds), 0), gr.skip())
        stage, these = session.tutor_stage, round_tokens(run, rnd.round_index)
        view = [(t.text or "·", t.status) for t in shown_tokens(run, rnd.round_index, stage)]
        return (view, explain_stage(rnd, these, stage), divergence_line(run, rnd.round_index, stage),
                round_figure(rnd, these, stage))

    def tutor_next_round(session: Session):
        """Show the next round: one already run, else step the parked run once on the engine thread."""
        with session.tutor_lock:
            handle = session.tutor
            if handle is None:
                raise gr.Error("Press Start first.", print_exception=False)
            run = handle.state()
            if session.tutor_round + 1 >= len(run.rounds) and not handle.done.is_set():
                before = handle.rounds_done
                ctx.engine.step(handle)
                handle.wait(lambda h: h.done.is_set() or (h.parked and h.rounds_done > before), HANG_GUARD_SECONDS)
                run = handle.state()
            session.tutor_state = run
            if session.tutor_round + 1 < len(run.rounds):
                session.tutor_round, session.tutor_stage = session.tutor_round + 1, 0
            else:
                session.tutor, session.tutor_round = None, -1
            return tutor_view(session)

    def tutor_start(prompt_text, method_v, k_v, delta_v, temp_v, preset_v, request: gr.Request):
        p = PRESETS[preset_v]
        cfg, prompt_ids = page.validated(prompt_text, method=method_v, k=k_v, delta=delta_v,
                                         posterior_threshold=p.posterior_threshold,
                                         posterior_alpha=p.posterior_alpha, temperature=temp_v, top_p=p.top_p,
                                         top_k=p.top_k, max_new_tokens=min(64, limits.max_new_tokens), seed=0)
        session = page.session(request)
        with session.tutor_lock:
            if session.tutor is not None:
                ctx.engine.stop(session.tutor)
            control = ctx.with_inspector(cfg)
            # Paused from the start with no step: the first "next round" below runs the prefill and round 0.
            session.tutor = start_run(ctx, control, prompt_ids, RunState(method=cfg.method, config=control.as_dict()),
                                      time.monotonic() + TUTOR_SECONDS, paused=True, steps=0)
            session.tutor_round = -1
        return tutor_next_round(session)

    def tutor_step(request: gr.Request):
        session = page.session(request)
        if session.tutor_round < 0:
            raise gr.Error("Press Start first.", print_exception=False)
        rnd = session.tutor_state.round_of(session.tutor_round)
        if rnd is not None and session.tutor_stage + 1 < len(stages(rnd)):
            session.tutor_stage += 1
            return tutor_view(session)
        return tutor_next_round(session)

    l_outputs = [l_tokens, l_explain, l_divergence, l_plot]
    start_btn.click(tutor_start, [l_prompt, l_method, l_k, l_delta, l_temp, preset], l_outputs,
                    concurrency_limit=limits.concurrency, concurrency_id=ENGINE_QUEUE, api_name="learn_start")
    step_btn.click(tutor_step, None, l_outputs, concurrency_limit=limits.concurrency,
                   concurrency_id=ENGINE_QUEUE, api_name="learn_step")

    def tutor_round(request: gr.Request):
        return tutor_next_round(page.session(request))

    round_btn.click(tutor_round, None, l_outputs,
                    concurrency_limit=limits.concurrency, concurrency_id=ENGINE_QUEUE,
                    api_visibility="private")

    def open_in_generate(prompt_text, method_v, k_v, delta_v, temp_v, preset_v):
        """The lesson's settings, with the preset's sampling and TAS knobs, as the Generate tab's controls."""
        p = PRESETS[preset_v]
        values = {"prompt": prompt_text, "method": method_v, "k": min(int(k_v), limits.max_k), "delta": delta_v,
                  "temperature": temp_v, "top_p": p.top_p, "top_k": p.top_k,
                  "posterior_threshold": p.posterior_threshold, "posterior_alpha": p.posterior_alpha}
        return [values[name] for name in GENERATE_FIELDS] + [gr.Tabs(selected="generate")]

    open_btn.click(open_in_generate, [l_prompt, l_method, l_k, l_delta, l_temp, preset],
                   [generate[name] for name in GENERATE_FIELDS] + [tabs],
                   api_visibility="private", concurrency_limit=None)

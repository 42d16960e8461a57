"""The Compare tab's wiring: one prompt through several methods in turn, with × AR when AR is among them."""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path

import gradio as gr

from playground.limits import DEFAULT_PROMPT, METHOD_LABELS, UI_METHODS
from playground.page import ENGINE_QUEUE, Page
from playground.runner import compare_table, run_compare, run_config_json, tokens_csv
from playground.state import highlighted_tokens
from playground.views import token_view

COMPARE_SLOTS = 5


def slot_props(methods: list[str] | None, i: int) -> dict:
    """Slot i's label and visibility for the checked methods: each shown slot is named by its method,
    before any run too."""
    methods = [m for m in (methods or []) if m in UI_METHODS]
    return {"label": METHOD_LABELS[methods[i]], "visible": True} if i < len(methods) else {"visible": False}


def build(page: Page) -> None:
    ctx, limits = page.ctx, page.limits
    start_k = min(ctx.pair.recommended_k(ctx.drafter_kind), limits.max_k)
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
        slots = [token_view(**slot_props(c_methods.value, i), elem_id=f"c-slot-{i}") for i in range(COMPARE_SLOTS)]
    c_table = gr.Dataframe(compare_table({}), label="Summary (vLLM metric names)", interactive=False,
                           elem_id="c-table")
    c_methods.change(lambda methods_v: [gr.HighlightedText(**slot_props(methods_v, i)) for i in range(COMPARE_SLOTS)],
                     c_methods, slots, api_visibility="private", concurrency_limit=None, show_progress="hidden")
    with gr.Row():
        c_csv = gr.File(label="per-token data (CSV)", elem_id="c-csv")
        c_json = gr.File(label="run config (JSON)", elem_id="c-json")

    def compare(prompt_text, methods_v, k_v, delta_v, temp_v, top_p_v, top_k_v, eps_v, alpha_v, max_new_v,
                seed_v, request: gr.Request):
        methods_v = [m for m in (methods_v or []) if m in UI_METHODS]
        if not 2 <= len(methods_v) <= min(COMPARE_SLOTS, limits.max_compare_methods):
            raise gr.Error("pick between 2 and 5 methods to compare", print_exception=False)
        cfg, prompt_ids = page.validated(prompt_text, method="sps", k=k_v, delta=delta_v,
                                    posterior_threshold=eps_v, posterior_alpha=alpha_v, temperature=temp_v,
                                    top_p=top_p_v, top_k=top_k_v, max_new_tokens=max_new_v, seed=seed_v)
        session = page.session(request)
        session.job_stop.set()
        session.job_stop = stop_event = threading.Event()

        def slot_updates(runs):
            shown = [methods_v[i] if i < len(methods_v) else None for i in range(COMPARE_SLOTS)]
            return [gr.HighlightedText(value=highlighted_tokens(runs[m]) if m in runs else [], **slot_props(methods_v, i))
                    for i, m in enumerate(shown)]

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
        page.session(request).job_stop.set()

    compare_stop.click(stop_job, None, None, cancels=[compare_event],
                       concurrency_limit=None, api_visibility="private")

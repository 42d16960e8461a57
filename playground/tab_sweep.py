"""The Sweep tab's wiring: acceptance against the exact induced divergence over δ and ε."""

from __future__ import annotations

import threading

import gradio as gr

from playground import charts
from playground.limits import build_config
from playground.page import ENGINE_QUEUE, Page
from playground.runner import run_sweep, sweep_points, sweep_table


def build(page: Page) -> None:
    ctx, limits = page.ctx, page.limits
    start_k = min(ctx.pair.recommended_k(ctx.drafter_kind), limits.max_k)
    gr.Markdown(
        "Acceptance against divergence: Cactus over a δ sweep, TAS over an ε sweep, SpS as the "
        "zero-divergence reference. Divergence is the exact KL(induced ‖ target) of what the rule emits at "
        "every position it tests a draft (`engine.divergence`, on the full support of T and D), averaged over "
        "those positions. The Cactus paper samples at T 0.6, top-p 0.95, top-k 20 (the defaults here) and argues "
        "its points lie on the Pareto frontier. **Stop** ends the sweep after the running point and keeps the "
        "finished ones."
    )
    with gr.Row():
        s_prompt = gr.Textbox(label="Prompt", value="Tell me a bedtime story about a small dragon.",
                              lines=2, scale=3)
        s_deltas = gr.Textbox(label="δ values (Cactus)", value="0.1, 0.5, 1, 2")
        s_eps = gr.Textbox(label="ε values (TAS)", value="0.3, 0.09, 0.03")
    with gr.Row():
        s_temp = gr.Slider(0.05, limits.max_temperature, value=0.6, step=0.05, label="temperature")
        s_top_p = gr.Slider(0.05, 1.0, value=0.95, step=0.01, label="top-p")
        s_top_k = gr.Slider(0, 200, value=20, step=1, label="top-k (0 = off)")
        s_k = gr.Slider(1, limits.max_k, value=start_k, step=1, label="K")
        s_max_new = gr.Slider(8, limits.max_sweep_new_tokens, value=min(48, limits.max_sweep_new_tokens),
                              step=1, label="new tokens per point")
        s_seed = gr.Number(value=0, precision=0, label="seed", minimum=0)
    with gr.Row():
        sweep_btn = gr.Button("Run sweep", variant="primary", elem_id="sweep-btn")
        sweep_stop = gr.Button("Stop", variant="stop")
    s_status = gr.Markdown("Press **Run sweep**.")
    s_plot = gr.Plot(charts.pareto_figure([]), elem_id="sweep-plot", show_label=False)
    s_table = gr.Dataframe(sweep_table([]), label="Sweep points", interactive=False, elem_id="sweep-table")

    def parse_values(text: str, label: str, lo: float, hi: float) -> list[float]:
        try:
            values = [float(v) for v in str(text).replace(";", ",").split(",") if v.strip()]
        except ValueError:
            raise ValueError(f"{label}: write numbers separated by commas, e.g. 0.1, 0.5, 1") from None
        bad = [v for v in values if not lo <= v <= hi]
        if bad:
            raise ValueError(f"{label} must lie in [{lo}, {hi}]; got {bad}")
        return values

    def sweep(prompt_text, deltas_v, eps_v, temp_v, top_p_v, top_k_v, k_v, max_new_v, seed_v, request: gr.Request):
        try:
            points = sweep_points(parse_values(deltas_v, "δ values", 0, limits.max_delta),
                                  parse_values(eps_v, "ε values", 1e-4, 1.0))
            if len(points) > limits.max_sweep_points + 1:
                raise ValueError(f"at most {limits.max_sweep_points} sweep points (δ and ε together)")
            cfg = build_config(limits, method="sps", k=k_v, delta=1.0, posterior_threshold=0.09,
                               posterior_alpha=0.3, temperature=temp_v, top_p=top_p_v, top_k=top_k_v,
                               max_new_tokens=min(int(max_new_v), limits.max_sweep_new_tokens), seed=seed_v)
            prompt_ids = page.encode(prompt_text)
        except ValueError as err:
            raise gr.Error(str(err), print_exception=False) from None
        session = page.session(request)
        session.job_stop.set()
        session.job_stop = stop_event = threading.Event()
        for results, note in run_sweep(ctx, cfg, prompt_ids, points, stop_event):
            table = sweep_table(results) if results else gr.skip()
            yield charts.pareto_figure(results, note), table, f"**Sweep:** {note}"

    sweep_btn.click(
        sweep, [s_prompt, s_deltas, s_eps, s_temp, s_top_p, s_top_k, s_k, s_max_new, s_seed],
        [s_plot, s_table, s_status], api_name="sweep", concurrency_limit=limits.concurrency,
        concurrency_id=ENGINE_QUEUE, time_limit=int(limits.max_seconds) + 30,
    )

    def stop_job(request: gr.Request) -> None:
        """Stop after the point that is running: the finished points stay on the plot and in the table."""
        page.session(request).job_stop.set()

    sweep_stop.click(stop_job, None, None, concurrency_limit=None, api_visibility="private")

"""The Gradio Blocks: the header, one tab per module, the health endpoint, the launch.

Queue layout (ECOSYSTEM.md §3-4): engine jobs (generate, compare, sweep, learn) share one
`concurrency_id` with `Limits.concurrency` slots and a bounded queue; UI-only listeners (live
sliders, chart timer, token inspector, pause / step / stop) have no concurrency limit, so they
never wait behind a running generation. No handler calls the engine itself: runs live on the
engine thread (`playground.engine_loop`) and the tabs read their state.
"""

from __future__ import annotations

import gc
import json

import gradio as gr
import uvicorn
from fastapi import FastAPI

from playground import tab_compare, tab_generate, tab_learn, tab_sweep
from playground.live_feed import PAGE_JS, add_route
from playground.page import Page
from playground.runner import VLLM_TARGET_NAMES, PlaygroundContext
from playground.tracker_clock import ClockFirst

CSS = """
.token-view span { font-family: ui-monospace, monospace; }
.legend-note { font-size: 0.85em; color: #555; }
/* A tracker whose event hides its progress is left at opacity 0 but laid out: its clock's text
   changed ten times a second and each change re-laid-out and repainted the page during a run. */
.block > .wrap.hide { display: none !important; }
#tokens-live { contain: content; }  /* a feed message re-lays-out and repaints this box only */
/* While a run streams its row has a fixed height and scrolls: a row that grew moved everything
   below it, and Chromium repainted and re-rastered the whole 2,400 px page on every feed message
   (half its busy time over the decode; playground.browser_bench --trace). */
#tokens-live .live-tokens { line-height: 1.9; padding: 4px 0; height: 15.2em; overflow-y: auto; contain: strict; }
/* The output a run leaves scrolls at about the live row's height, as the live row does: the charts
   stay in view, and the height the page holds through the next run (live_feed.PAGE_JS) stays small. */
#tokens { max-height: 270px; overflow-y: auto; }
#tokens-live .live-token { border-radius: 3px; padding: 1px 1px; white-space: pre-wrap; }
#tokens-live .live-status { padding: 2px 0; }
/* A key chart's live line (live_feed.py), over the chart until Plotly redraws it. */
.live-preview { position: absolute; inset: 0; width: 100%; height: 100%; z-index: 5; pointer-events: none; }
"""


def header(ctx: PlaygroundContext) -> str:
    pair = ctx.pair
    target = VLLM_TARGET_NAMES.get(ctx.pair_name, ctx.pair_name)
    params = sum(p.numel() for p in pair.target_model.parameters()) / 1e6
    reference = ctx.startup_reference
    return (
        f"# specplay: watch speculative decoding work\n"
        f"Target **{target}** ({params:.1f}M params) · draft: {pair.draft_description} · {ctx.devices}. "
        f"**× AR** divides a run's tok/s by your own AR runs on this page (≥ 32 tokens, alone on the engine, "
        f"unpaused; your first speculative run starts with one, on the same prompt and settings); "
        f"for API clients and until then, by " + (reference.how if reference else "nothing (not measured)") + "."
    )


def build_demo(ctx: PlaygroundContext) -> gr.Blocks:
    page = Page(ctx)
    with gr.Blocks(title="specplay — speculative decoding playground") as demo:
        gr.Markdown(header(ctx), elem_id="header")
        with gr.Tabs() as tabs:
            with gr.Tab("Generate", id="generate"):
                generate_controls = tab_generate.build(page, demo)
            with gr.Tab("Compare", id="compare"):
                tab_compare.build(page)
            with gr.Tab("Sweep", id="sweep"):
                tab_sweep.build(page)
            with gr.Tab("Learn", id="learn"):
                tab_learn.build(page, tabs, generate_controls)

        def health() -> str:
            reference = ctx.startup_reference
            return json.dumps({"pair": ctx.pair_name, "active_runs": ctx.active_runs, "sessions": len(ctx.sessions),
                               "ar_reference_tps": reference.tokens_per_s if reference else None,
                               "devices": ctx.devices})

        health_out = gr.Textbox(visible=False)
        gr.Button(visible=False).click(health, None, health_out, api_name="health", concurrency_limit=None)

        def forget_session(request: gr.Request) -> None:
            ctx.sessions.drop(getattr(request, "session_hash", None))

        demo.unload(forget_session)
    return demo


def launch(ctx: PlaygroundContext, host: str, port: int) -> None:
    """Serve the Blocks at / on a FastAPI app that also carries the live feed's route."""
    demo = build_demo(ctx)
    demo.queue(max_size=ctx.limits.queue_size, default_concurrency_limit=ctx.limits.concurrency)
    app = FastAPI()
    add_route(app, ctx.feeds)
    app = gr.mount_gradio_app(app, demo, path="/", css=CSS, theme=gr.themes.Soft(), head=PAGE_JS, ssr_mode=False,
                              show_error=True, footer_links=["api"])
    app.add_middleware(ClockFirst)
    # What exists now (the models, the tokenizer, the Blocks: ~460k objects) lives as long as the
    # server. Out of the collector's sight, a full collection walks only what came after: 26-33 ms
    # instead of 280-320 ms with the GIL held, stalling the engine thread of whichever run it hit.
    gc.freeze()
    print(f"* Running on http://{host}:{port}", flush=True)
    # An open feed or queue stream must not hold a shutdown (SIGTERM) for long.
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=2)

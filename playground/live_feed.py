"""The Generate tab's live feed: a run's new tokens and its status line, streamed to the page over
one EventSource, outside Gradio's event pipeline.

Why: every Gradio streaming update costs the browser tens of milliseconds of main-thread work
whatever it carries (the loading status of every component, clones of the state, a Svelte flush,
the token view's re-render). With Chromium on the same 2 cores as the engine, 7 updates a second
kept 0.4-0.5 of a core busy and took a third of the engine's speed (`playground.browser_bench`,
AMD EPYC Zen 4). A feed message appends the new tokens' spans and sets one line of text.

The page asks for a feed (the Generate click's `js` sets a hidden flag); the handler then opens one
per run and stops sending Gradio frames once the page is reading it. Gradio still delivers the
first and the final update (the clickable token view, the details) and the status line when the
run pauses or resumes (moments the engine is not running), and any other client (gradio_client,
curl) gets the usual frames. A page that leaves stops its run, as a closed Gradio stream does.

The live charts ride the same feed: every `CHART_EVERY` messages one of them, in turn, as a
figure the page hands to `Plotly.react` on the chart already drawn. Through Gradio, a tick
redrawing one `gr.Plot` held Chromium's main thread for 90-180 ms in the middle of the decode;
`Plotly.react` on the same figure takes 20-30 ms alone, and a feed message carrying one 27-80 ms
(traces, AMD EPYC Zen 4, 2 cores).
"""

from __future__ import annotations

import asyncio
import html
import json
import re
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from playground.engine_loop import RunHandle
from playground.state import EMPTY_TOKEN_TEXT, STATUS_COLOURS, RunState

ROUTE = "/specplay/live/{feed_id}"
# How often a feed sends what the run added. Each message wakes Chromium's threads for a frame, and
# with the browser on the engine's cores a wake-up stalls both engine threads, whose GEMMs split
# evenly. Page / engine for SpS / Cactus / AR, medians of per-repeat ratios (playground.browser_bench,
# interleaved, AMD EPYC Zen 4): 10 messages a second 0.84 / 0.76 / 0.72, 5 a second 0.86 / 0.83 /
# 0.81 (9 repeats each); with the fixed-height row (app.py), 10 a second 0.64 / 0.67 / 0.72 and 5 a
# second 0.84 / 0.81 / 0.75 (6 and 12 repeats); 6.7 a second was not told apart from 5. The longest gap between updates
# stays under 0.3 s in most runs at 5 a second; the VM's stalls make some longer at any rate.
FEED_SECONDS = 0.2
FIRST_FEED_SECONDS = 0.02  # until the first token is sent, the feed looks this often (time to first token)
STATUS_EVERY = 2  # feed messages per status-line refresh
CHART_EVERY = 5  # feed messages per live-chart redraw (one chart a second, in turn: each every 2 s)
ATTACH_SECONDS = 2.0  # a page that asked for a feed but has not opened it by then gets Gradio frames
FEED_TTL_SECONDS = 600.0  # an unopened feed is forgotten after this


@dataclass
class Feed:
    """One run's feed: the run, how to word its status line, and whether the page has opened it."""

    id: str
    handle: RunHandle
    status: Callable[[RunState], str]  # the live line above the tokens (Markdown with **bold**)
    stop_run: Callable[[], None]
    chart: Callable[[RunState, int], tuple[str, dict]] | None = None  # (turn) -> (chart elem_id, Plotly figure JSON)
    opened: threading.Event = field(default_factory=threading.Event)
    created: float = field(default_factory=time.monotonic)


class LiveFeeds:
    """The open feeds, keyed by an unguessable id (the page learns it from the run's first update)."""

    def __init__(self) -> None:
        self._feeds: dict[str, Feed] = {}
        self._lock = threading.Lock()

    def open(self, handle: RunHandle, status: Callable[[RunState], str], stop_run: Callable[[], None],
             chart: Callable[[RunState, int], tuple[str, dict]] | None = None) -> Feed:
        feed = Feed(secrets.token_urlsafe(16), handle, status, stop_run, chart)
        with self._lock:
            for stale in [k for k, f in self._feeds.items() if feed.created - f.created > FEED_TTL_SECONDS]:
                del self._feeds[stale]
            self._feeds[feed.id] = feed
        return feed

    def get(self, feed_id: str) -> Feed | None:
        with self._lock:
            return self._feeds.get(feed_id)

    def close(self, feed_id: str) -> None:
        with self._lock:
            self._feeds.pop(feed_id, None)


def feed_html(feed_id: str) -> str:
    """The live view's value: an empty token row that the page script fills from the feed. The URL
    is relative to the page, so it holds behind a proxy that serves the app under a path."""
    return (f"<div class='live-feed' data-feed='{ROUTE.format(feed_id=feed_id).lstrip('/')}'>"
            "<div class='live-status'></div><div class='live-tokens token-view'></div></div>")


def status_html(markdown: str) -> str:
    """The status line's Markdown (only **bold**) as HTML."""
    return re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", html.escape(markdown, quote=False))


def _fold(feed: Feed, chart_turn: int | None) -> tuple[RunState, dict]:
    """(on a worker thread) The run folded up to now and, for a chart turn, that chart's figure."""
    run = feed.handle.state()
    if chart_turn is None or feed.chart is None or not run.rounds:
        return run, {}
    chart_id, figure = feed.chart(run, chart_turn)
    return run, {chart_id: figure}


async def messages(feed: Feed, frame_seconds: float = FEED_SECONDS) -> AsyncIterator[dict]:
    """What the page is sent, every `frame_seconds` (every `FIRST_FEED_SECONDS` until the first token):
    the cells ([text, status]) the run added since the last message and, where it changed (looked at
    every `STATUS_EVERY` messages, and at every one while paused), the live line; every `CHART_EVERY`
    messages, while the run streams and has done a round since, the next live chart; the last has
    done=True (the final Gradio update draws every chart). Nothing new, nothing sent. The run's
    events are folded, and charts built, on a worker thread (the divergences of a round are computed
    there), never on the server's event loop; that time is inside the frame, so messages keep the
    cadence whatever a fold costs."""
    feed.opened.set()
    sent, count, shown, turn, charted = 0, 0, None, 0, None
    while True:
        looked_at = time.monotonic()  # the cadence counts from here: folding and sending are inside the frame
        done = feed.handle.done.is_set()
        chart_now = (not done and not feed.handle.parked and count % CHART_EVERY == CHART_EVERY - 1
                     and feed.handle.rounds_done != charted)
        run, charts = await asyncio.to_thread(_fold, feed, turn if chart_now else None)
        cells = [[t.text or EMPTY_TOKEN_TEXT, t.status] for t in run.tokens[sent:]]
        sent += len(cells)
        count += 1
        message: dict = {"cells": cells}
        if done or count % STATUS_EVERY == 1 or run.paused:
            status = status_html(feed.status(run))
            if status != shown or done:  # the last message always carries the final line
                message["status"] = shown = status
        if charts:
            message["charts"], charted, turn = charts, feed.handle.rounds_done, turn + 1
        if done:
            message["done"] = True
        if cells or len(message) > 1:
            yield message
        if done:
            return
        frame = frame_seconds if sent else min(frame_seconds, FIRST_FEED_SECONDS)
        await asyncio.sleep(max(0.0, looked_at + frame - time.monotonic()))


def add_route(app, feeds: LiveFeeds) -> None:
    """GET `ROUTE`: the feed as server-sent events. Leaving the page (the stream closes before the
    run ends) stops the run at its next round boundary."""
    from fastapi import HTTPException
    from fastapi.responses import StreamingResponse

    @app.get(ROUTE)
    async def live(feed_id: str) -> StreamingResponse:
        feed = feeds.get(feed_id)
        if feed is None:
            raise HTTPException(404, "no such run (it ended, or the page was reloaded)")

        async def stream() -> AsyncIterator[str]:
            finished = False
            try:
                async for message in messages(feed):
                    finished = message.get("done", False)
                    yield f"data: {json.dumps(message)}\n\n"
            finally:
                feeds.close(feed_id)
                if not finished:
                    feed.stop_run()

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# The page side: once the live view holds a feed URL, follow it. While it streams, its row stands in
# for Gradio's token view (hidden, then shown again when the final update empties the live view);
# each message appends its cells with the token view's classes and colours and sets the live line.
PAGE_JS = """
<script>
(() => {
  const colours = %s;
  const escape = (s) => s.replace(/[&<>"']/g, (c) => ({'&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;'}[c]));
  const showGradio = (on) => {
    const el = document.querySelector('#tokens');
    if (el) el.style.display = on ? '' : 'none';
  };
  const follow = (box) => {
    const tokens = box.querySelector('.live-tokens'), status = box.querySelector('.live-status');
    const source = new EventSource(box.dataset.feed);
    source.onmessage = (event) => {
      const m = JSON.parse(event.data);
      if (m.cells.length) {
        const following = tokens.scrollTop + tokens.clientHeight >= tokens.scrollHeight - 4;
        tokens.insertAdjacentHTML('beforeend', m.cells.map(([text, s]) =>
          `<span class="token live-token" data-status="${s}" style="background:${colours[s]}33">${escape(text)}</span>`).join(''));
        if (following) tokens.scrollTop = tokens.scrollHeight;  // keep the newest tokens in view
      }
      if (m.status !== undefined) status.innerHTML = m.status;
      for (const [id, figure] of Object.entries(m.charts || {})) {  // onto the chart Gradio drew
        const plot = document.querySelector(`#${id} .js-plotly-plot`);
        if (plot && window.Plotly) window.Plotly.react(plot, figure.data, figure.layout);
      }
      if (box.isConnected) showGradio(false);  // (the final update may already have replaced the box)
      if (m.done) source.close();
    };
    source.onerror = () => source.close();
  };
  // One cheap query per batch of DOM changes: a new feed box starts following, a removed one (the
  // run's final update) gives the token view back.
  let current = null;
  new MutationObserver(() => {
    const box = document.querySelector('#tokens-live [data-feed]');
    if (box && box !== current) follow(box);
    if (!box && current) showGradio(true);
    current = box;
  }).observe(document.documentElement, {subtree: true, childList: true});
})();
</script>
""" % json.dumps(STATUS_COLOURS)

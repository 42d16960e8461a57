"""The Generate tab's live feed: a run's new tokens and its status line, streamed to the page over
one EventSource, outside Gradio's event pipeline.

Why: every Gradio streaming update costs the browser tens of milliseconds of main-thread work
whatever it carries (the loading status of every component, clones of the state, a Svelte flush,
the token view's re-render). With Chromium on the same 2 cores as the engine, 7 updates a second
kept 0.4-0.5 of a core busy and took a third of the engine's speed (`playground.browser_bench`,
AMD EPYC Zen 4). A feed message appends the new tokens' spans and sets one line of text.

The page names its feed: the Generate click first runs a browser-only event (no server call, no
loading-status pass) that sets the streaming status line, empties the token view, puts up the live
box and hands the server a fresh random feed id (`window.specplayFeed`); the box opens the feed at
once, and the route waits for the run to register under that id. So the server's handler sends
Gradio nothing until the final update (the clickable token view, the details), apart from the
status line when the run pauses or resumes (moments the engine is not running). Each Gradio message
costs the page a pass over every component's loading status (a deep copy of each one's props) and a
Svelte flush, on the engine's cores: a first update naming a server-chosen feed was one, at the
run's start, and a second for a run that follows the page's AR reference run; that second run now
follows on the same box (the reference run's last message names the next feed). Any other client
(gradio_client, curl) gets the usual frames. A page that leaves stops its run, as a closed Gradio
stream does.

The two key charts ride the same feed as lines (`charts.LiveSeries`): each message carries the
points added since the last one, and the page draws them on a canvas over the chart, replaced
by the full Plotly chart when the run pauses or ends. Through Gradio, a tick redrawing one
`gr.Plot` held Chromium's main thread for 90-180 ms in the middle of the decode; `Plotly.react` on
the same figure over the feed took 18-28 ms alone (react, extendTraces and restyle alike) and
27-80 ms in a run, and with those redraws (one chart a second) page / engine was 0.77 / 0.77 /
0.765 for AR / SpS / Cactus against 0.89 / 0.90 / 0.80 without them (medians of four
`playground.browser_bench` runs each, AMD EPYC Zen 4, 2 cores, Chromium on the same cores).
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

from playground.charts import LiveSeries
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
ATTACH_SECONDS = 2.0  # a page that asked for a feed but has not opened it by then gets Gradio frames
FEED_TTL_SECONDS = 600.0  # an unopened feed is forgotten after this
FEED_WAIT_SECONDS = 600.0  # how long an opened feed waits for its run to start (queued behind other sessions)
KEEPALIVE_SECONDS = 15.0  # a comment line this often while it waits, so that no proxy drops the idle stream
FEED_ID = re.compile(r"[A-Za-z0-9_-]{16,64}")  # what a page may name its feed (window.specplayFeed: 32 hex digits)


@dataclass
class Feed:
    """One run's feed: the run, how to word its status line, and whether the page has opened it."""

    id: str
    handle: RunHandle
    status: Callable[[RunState], str]  # the live line above the tokens (Markdown with **bold**)
    stop_run: Callable[[], None]
    series: Callable[[RunState], dict[str, LiveSeries]] | None = None  # the key charts' live lines, by chart id
    next_id: str | None = None  # the feed of the run that follows this one if it completes (after an AR reference run)
    opened: threading.Event = field(default_factory=threading.Event)
    created: float = field(default_factory=time.monotonic)


class LiveFeeds:
    """The open feeds, keyed by an unguessable id: the page's own random one, or one made here."""

    def __init__(self) -> None:
        self._feeds: dict[str, Feed] = {}
        # feeds a page opened before their run registered: the waiters' loops and events, by id
        self._waiting: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = {}
        self._lock = threading.Lock()

    def open(self, handle: RunHandle, status: Callable[[RunState], str], stop_run: Callable[[], None],
             series: Callable[[RunState], dict[str, LiveSeries]] | None = None, *, feed_id: str | None = None,
             next_id: str | None = None) -> Feed | None:
        """Register a run's feed under `feed_id` (None: a new random id). None where the id is not one a
        page may name, or is taken: that run streams through Gradio instead."""
        feed = Feed(secrets.token_urlsafe(16) if feed_id is None else feed_id, handle, status, stop_run, series,
                    next_id)
        if not FEED_ID.fullmatch(feed.id):
            return None
        with self._lock:
            for stale in [k for k, f in self._feeds.items() if feed.created - f.created > FEED_TTL_SECONDS]:
                del self._feeds[stale]
            if feed.id in self._feeds:
                return None
            self._feeds[feed.id] = feed
            for loop, registered in self._waiting.pop(feed.id, []):
                loop.call_soon_threadsafe(registered.set)
        return feed

    def get(self, feed_id: str) -> Feed | None:
        with self._lock:
            return self._feeds.get(feed_id)

    async def wait_for(self, feed_id: str, timeout: float) -> AsyncIterator[Feed | None]:
        """Yields None every KEEPALIVE_SECONDS while no run has registered `feed_id`, then the feed;
        ends without it after `timeout` (the page named a feed for a click that started no run).
        Woken by the registration itself (`open`, on a handler's thread), not by polling: a page
        whose run waits in the queue costs the server nothing until it starts."""
        registered = asyncio.Event()
        waiter = (asyncio.get_running_loop(), registered)
        with self._lock:
            feed = self._feeds.get(feed_id)
            if feed is None:
                self._waiting.setdefault(feed_id, []).append(waiter)
        try:
            give_up = time.monotonic() + timeout
            while feed is None:
                left = give_up - time.monotonic()
                if left <= 0:
                    return
                try:
                    await asyncio.wait_for(registered.wait(), min(KEEPALIVE_SECONDS, left))
                    feed = self.get(feed_id)
                except TimeoutError:
                    yield None
            yield feed
        finally:
            with self._lock:
                waiters = self._waiting.get(feed_id, [])
                if waiter in waiters:
                    waiters.remove(waiter)
                if not waiters:
                    self._waiting.pop(feed_id, None)

    def close(self, feed_id: str) -> None:
        with self._lock:
            self._feeds.pop(feed_id, None)


def feed_url(feed_id: str) -> str:
    """The feed's URL, relative to the page, so it holds behind a proxy that serves the app under a path."""
    return ROUTE.format(feed_id=feed_id).lstrip("/")


def feed_html(feed_id: str) -> str:
    """The live view's value: an empty token row that the page script fills from the feed (the page
    builds it from this with its own id: `PAGE_JS`)."""
    return (f"<div class='live-feed' data-feed='{feed_url(feed_id)}'>"
            "<div class='live-status'></div><div class='live-tokens token-view'></div></div>")


def status_html(markdown: str) -> str:
    """The status line's Markdown (only **bold**) as HTML."""
    return re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", html.escape(markdown, quote=False))


def _fold(feed: Feed, with_series: bool) -> tuple[RunState, dict[str, LiveSeries]]:
    """(on a worker thread) The run folded up to now and, if asked, the key charts' live lines."""
    run = feed.handle.state()
    return run, feed.series(run) if with_series and feed.series is not None else {}


def _series_delta(series: dict[str, LiveSeries], sent: dict[str, int], shown: dict[str, tuple]) -> dict[str, dict]:
    """Per chart, the points after the `sent` ones (`from`: the index of the first) and, where they
    changed since last `shown`, its title, axis labels, reference line and change marks."""
    delta = {}
    for chart_id, s in series.items():
        first = sent.get(chart_id, 0)
        meta = (s.title, s.x_label, s.y_label, s.reference, s.marks)
        if len(s.points) == first and shown.get(chart_id) == meta:
            continue
        entry: dict = {"from": first, "points": [[x, y] for x, y in s.points[first:]]}
        if shown.get(chart_id) != meta:
            entry.update(title=s.title, x=s.x_label, y=s.y_label, reference=s.reference, marks=s.marks)
            shown[chart_id] = meta
        sent[chart_id] = len(s.points)
        delta[chart_id] = entry
    return delta


async def messages(feed: Feed, frame_seconds: float = FEED_SECONDS) -> AsyncIterator[dict]:
    """What the page is sent, every `frame_seconds` (every `FIRST_FEED_SECONDS` until the first token):
    the cells ([text, status]) the run added since the last message and, where it changed (looked at
    every `STATUS_EVERY` messages, with the first tokens, and at every one while paused), the live
    line; while the run streams, the key charts' new points (`series`); `paused` when the run parks
    or goes on (Gradio draws every chart while it is parked); the last has done=True (the final
    Gradio update draws every chart) and, after an AR reference run that completed, `next`: the feed
    of the run it was for. Nothing new, nothing sent. The run's events are folded, and the lines
    built, on a worker thread (the divergences of a round are computed there), never on the server's
    event loop; that time is inside the frame, so messages keep the cadence whatever a fold costs."""
    feed.opened.set()
    sent, count, shown, paused = 0, 0, None, False
    points_sent: dict[str, int] = {}
    series_shown: dict[str, tuple] = {}
    while True:
        looked_at = time.monotonic()  # the cadence counts from here: folding and sending are inside the frame
        done = feed.handle.done.is_set()
        streaming = not done and not feed.handle.parked
        run, series = await asyncio.to_thread(_fold, feed, streaming)
        cells = [[t.text or EMPTY_TOKEN_TEXT, t.status] for t in run.tokens[sent:]]
        first_tokens = cells and not sent  # the line said "starting…" until now
        sent += len(cells)
        count += 1
        message: dict = {"cells": cells}
        if done or count % STATUS_EVERY == 1 or run.paused or first_tokens:
            status = status_html(feed.status(run))
            if status != shown or done:  # the last message always carries the final line
                message["status"] = shown = status
        delta = _series_delta(series, points_sent, series_shown)
        if delta:
            message["series"] = delta
        if run.paused != paused:
            message["paused"] = paused = run.paused
        if done:
            message["done"] = True
            if feed.next_id is not None and run.completed:
                message["next"] = feed_url(feed.next_id)
        if cells or len(message) > 1:
            yield message
        if done:
            return
        frame = frame_seconds if sent else min(frame_seconds, FIRST_FEED_SECONDS)
        await asyncio.sleep(max(0.0, looked_at + frame - time.monotonic()))


def add_route(app, feeds: LiveFeeds) -> None:
    """GET `ROUTE`: the feed as server-sent events, from the moment its run registers (the page opens
    it at the click, before the server has the request). Leaving the page (the stream closes before
    the run ends) stops the run at its next round boundary. A feed whose run never comes ends with
    `gone`."""
    from fastapi import HTTPException
    from fastapi.responses import StreamingResponse

    @app.get(ROUTE)
    async def live(feed_id: str) -> StreamingResponse:
        if not FEED_ID.fullmatch(feed_id):
            raise HTTPException(404, "no such run")

        async def stream() -> AsyncIterator[str]:
            feed = None
            async for feed in feeds.wait_for(feed_id, FEED_WAIT_SECONDS):
                if feed is None:
                    yield ": waiting for the run to start\n\n"
            if feed is None:
                yield f"data: {json.dumps({'cells': [], 'done': True, 'gone': True})}\n\n"
                return
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


# The page side: `window.specplayFeed()` gives the Generate click a fresh feed id and its live box
# (the click's browser-only event puts the box into the live view); once the live view holds a feed
# URL, follow it. While it streams, its row stands in for Gradio's token view (hidden, then shown
# again when the final update empties the live view); each message appends its cells with the token
# view's classes and colours and sets the live line; a last message that names the next run's feed
# (after the AR reference run) goes on with that one in the same box.
PAGE_JS = """
<script>
(() => {
  const colours = %s, template = %s;
  let active = null;  // [id, box] of the feed this page follows, from the click to its last message
  window.specplayFeed = () => {
    if (!active) {
      const id = [...crypto.getRandomValues(new Uint8Array(16))].map(b => b.toString(16).padStart(2, '0')).join('');
      active = [id, template.replace('__FEED__', id)];
    }
    return active;
  };
  const escape = (s) => s.replace(/[&<>"']/g, (c) => ({'&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;'}[c]));
  const showGradio = (on) => {
    const el = document.querySelector('#tokens');
    if (el) el.style.display = on ? '' : 'none';
  };
  const follow = (box, url) => {
    const tokens = box.querySelector('.live-tokens'), status = box.querySelector('.live-status');
    const source = box.source = new EventSource(url);
    source.onmessage = (event) => {
      const m = JSON.parse(event.data);
      box.heard = true;
      if (m.cells.length) {
        const following = tokens.scrollTop + tokens.clientHeight >= tokens.scrollHeight - 4;
        tokens.insertAdjacentHTML('beforeend', m.cells.map(([text, s]) =>
          `<span class="token live-token" data-status="${s}" style="background:${colours[s]}33">${escape(text)}</span>`).join(''));
        if (following) tokens.scrollTop = tokens.scrollHeight;  // keep the newest tokens in view
      }
      if (m.status !== undefined) status.innerHTML = m.status;
      for (const [id, s] of Object.entries(m.series || {})) preview(id, s);
      if (m.paused === true) hidePreviews();  // Gradio draws every chart while the run is parked
      if (box.isConnected) showGradio(false);  // (the final update may already have replaced the box)
      if (m.done) {
        source.close();
        if (m.next) {  // the run the AR reference run was for: same box, its own tokens and lines
          tokens.replaceChildren();
          hidePreviews(); previews = {};
          follow(box, m.next);
        } else if (m.gone) {
          release(box);
        } else {
          active = null; handOver();
        }
      }
    };
    source.onerror = () => { source.close(); active = null; handOver(); };
  };
  // A click whose run never came (a refused setting, a full queue): Gradio's view back, box hidden.
  const release = (box) => {
    if (box.source) box.source.close();
    box.style.display = 'none';
    active = null; showGradio(true); hold(false);
  };
  // The key charts' live lines: drawn on a canvas over each chart while the run streams (a Plotly
  // redraw costs the page 20-70 ms of main thread; this, well under one), until Plotly redraws it.
  let previews = {};
  const preview = (id, s) => {
    const p = previews[id] = previews[id] || {points: [], marks: []};
    p.points.push(...s.points);
    if (s.title !== undefined) Object.assign(p, {title: s.title, x: s.x, y: s.y, reference: s.reference, marks: s.marks});
    draw(id, p);
  };
  const draw = (id, p) => {
    const host = document.querySelector(`#${id}`);
    if (!host || !p.points.length) return;
    if (!p.canvas || !p.canvas.isConnected) {
      p.canvas = document.createElement('canvas');
      p.canvas.className = 'live-preview';
      host.style.position = 'relative';
      host.appendChild(p.canvas);
    }
    const c = p.canvas, ratio = window.devicePixelRatio || 1, w = host.clientWidth, h = host.clientHeight;
    if (c.width !== w * ratio || c.height !== h * ratio) { c.width = w * ratio; c.height = h * ratio; }
    const g = c.getContext('2d');
    g.setTransform(ratio, 0, 0, ratio, 0, 0);
    g.fillStyle = '#fff'; g.fillRect(0, 0, w, h);
    const left = 56, right = w - 16, top = 34, bottom = h - 40;
    const xs = p.points.map(q => q[0]), ys = p.points.map(q => q[1]);
    const x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1e-9);
    const y1 = Math.max(...ys, p.reference ? p.reference[0] : 0) * 1.1 || 1;
    const X = (x) => left + (right - left) * (x - x0) / (x1 - x0), Y = (y) => bottom - (bottom - top) * y / y1;
    g.font = '14px sans-serif'; g.fillStyle = '#333'; g.textAlign = 'left'; g.textBaseline = 'top';
    g.fillText(p.title, 8, 8, w - 16);
    g.font = '11px sans-serif'; g.fillStyle = '#666';
    g.strokeStyle = '#ccc'; g.lineWidth = 1; g.strokeRect(left, top, right - left, bottom - top);
    g.textBaseline = 'middle'; g.textAlign = 'right';
    for (const v of [0, y1 / 2, y1]) g.fillText(v.toPrecision(3), left - 4, Y(v));
    g.textAlign = 'center'; g.textBaseline = 'top';
    g.fillText(x0.toPrecision(3), left, bottom + 4); g.fillText(x1.toPrecision(3), right, bottom + 4);
    g.fillText(p.x, (left + right) / 2, bottom + 18);
    g.save(); g.translate(12, (top + bottom) / 2); g.rotate(-Math.PI / 2); g.fillText(p.y, 0, -6); g.restore();
    g.textAlign = 'left'; g.textBaseline = 'top';
    g.setLineDash([3, 3]); g.strokeStyle = '#d62728'; g.fillStyle = '#d62728';
    for (const [x, label] of p.marks || []) {
      if (x < x0 || x > x1) continue;
      g.beginPath(); g.moveTo(X(x), top); g.lineTo(X(x), bottom); g.stroke(); g.fillText(label, X(x) + 3, top + 2);
    }
    if (p.reference) {
      g.setLineDash([6, 4]); g.strokeStyle = '#555'; g.fillStyle = '#555';
      g.beginPath(); g.moveTo(left, Y(p.reference[0])); g.lineTo(right, Y(p.reference[0])); g.stroke();
      g.textAlign = 'right'; g.textBaseline = 'bottom'; g.fillText(p.reference[1], right - 2, Y(p.reference[0]) - 2);
    }
    g.setLineDash([]); g.strokeStyle = colours.accepted; g.lineWidth = 2;
    g.beginPath();
    p.points.forEach(([x, y], i) => (i ? g.lineTo(X(x), Y(y)) : g.moveTo(X(x), Y(y))));
    g.stroke();
  };
  const hidePreviews = () => {
    for (const p of Object.values(previews)) if (p.canvas) { p.canvas.remove(); p.canvas = null; }
  };
  // The run is over: each line stays until Gradio has drawn its chart (or a few seconds at most).
  const handOver = () => {
    const ending = previews;
    previews = {};
    for (const [id, p] of Object.entries(ending)) {
      const drop = () => { if (p.canvas) p.canvas.remove(); p.canvas = null; };
      const plot = document.querySelector(`#${id} .js-plotly-plot`);
      if (plot && plot.once) plot.once('plotly_afterplot', drop);
      setTimeout(drop, 5000);
    }
  };
  // From the Generate click until the run's final update the status line and token area keep at
  // least the height they had: the shorter streaming status and live row would otherwise move the
  // seven charts below up, a re-layout and re-raster of the page on the engine's cores.
  let held = false, toasts = 0;  // toasts: Gradio's error toasts on the page at the click
  const countToasts = () => document.querySelectorAll('.toast-body').length;
  const hold = (on) => {
    const view = document.querySelector('#run-view');
    if (view) view.style.minHeight = on ? `${view.offsetHeight}px` : '';
    held = on;
    toasts = countToasts();
  };
  document.addEventListener('click', (event) => {
    if (event.target.closest && event.target.closest('#generate-btn')) hold(true);
  }, true);
  // One cheap query per batch of DOM changes: a new feed box starts following, a removed one (the
  // run's final update) gives the token view back. A click that starts no run (a refused setting, a
  // full queue) ends in a new Gradio error toast while its box has heard nothing: that lets go too.
  // Not a timer: a run can start seconds after the click on a loaded machine (a model loading).
  let current = null;
  new MutationObserver(() => {
    const box = document.querySelector('#tokens-live [data-feed]');
    if (box && box !== current) { hidePreviews(); previews = {}; showGradio(false); follow(box, box.dataset.feed); }
    if (!box && current) {
      if (current.source && current.source.readyState !== 2) { current.source.close(); handOver(); }
      active = null; showGradio(true); hold(false);
    }
    if (held && !(box && box.heard) && countToasts() > toasts) box ? release(box) : hold(false);
    current = box;
  }).observe(document.documentElement, {subtree: true, childList: true});
})();
</script>
""" % (json.dumps(STATUS_COLOURS), json.dumps(feed_html("__FEED__")))

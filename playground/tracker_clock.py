"""Gradio's status-tracker clock, ticked ten times a second in one timer instead of on every animation frame.

Why: Gradio's StatusTracker counts a pending event's elapsed time in a `requestAnimationFrame` loop
(`performance.now()` every frame; it shows tenths of a second) until an effect sees the status
leave "pending". The app's own loading tracker is unmounted the moment the app has loaded, before
that effect runs, so its loop never stops: every open page asked Chromium for a frame 50-80 times
a second for as long as it stayed open (Gradio 6.31; seen by counting the loop's calls per tracker). With Chromium on the
engine's two cores that kept an idle page at 0.06-0.09 cores, and cost the same during every run.
A script that runs before Gradio's modules capture `window.requestAnimationFrame` takes that one
callback out of the frame loop: every clock waiting is called from one timer each `TICK_MS`, with
no frame asked for. A clock whose tracker shows changes its text, and that change draws the next
frame as any DOM change does; a hidden tracker's clock (the app CSS sets `.block > .wrap.hide` to display none)
changes nothing drawn, so no frame. During a run each of the run's pending output trackers had a
clock of its own, each drawing ten frames a second (session 39: 35-48 frames a second over the
decode; `playground.browser_bench --trace`).

Gradio places a Blocks' `head` into the page at run time, after its modules load, so the script
goes into the served HTML itself (`ClockFirst`). The clock's callback is recognised by its
source (it reads `performance.now()` against its start, divides by 1e3 and re-arms itself); a
Gradio that words it differently is not throttled, and the browser test that counts the deferred
ticks fails.
"""

from __future__ import annotations

TICK_MS = 100  # the clock shows tenths of a second
CLOCK_SOURCE = r"performance\.now\(\)-\w+\(\w+\)\)\/1e3\),\w+&&\w+\(\)"  # the clock callback's source, minified

TRACKER_CLOCK_JS = """<script>
(() => {
  const frame = window.requestAnimationFrame.bind(window);
  const clock = /%s/;
  let waiting = [];
  const tick = () => {
    const due = waiting;
    waiting = [];
    const now = performance.now();
    for (const callback of due) callback(now);
  };
  window.specplayClockTicks = 0;  // how many clock ticks were deferred (the browser test reads it)
  window.requestAnimationFrame = (callback) => {
    if (!clock.test(Function.prototype.toString.call(callback))) return frame(callback);
    window.specplayClockTicks++;
    if (waiting.push(callback) === 1) setTimeout(tick, %d);
    return 0;
  };
})();
</script>""" % (CLOCK_SOURCE, TICK_MS)


class ClockFirst:
    """ASGI middleware: `TRACKER_CLOCK_JS` first in the <head> of every HTML page served. Any other
    response (the queue's and the live feed's event streams included) passes through untouched."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "GET":
            await self.app(scope, receive, send)
            return
        start: dict | None = None
        body: list[bytes] = []

        async def rewrite(message: dict) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers", []))
                if not headers.get(b"content-type", b"").startswith(b"text/html"):
                    await send(message)
                    return
                start = message  # held until the whole page is in
            elif start is None:
                await send(message)
            else:
                body.append(message.get("body", b""))
                if not message.get("more_body", False):
                    page = b"".join(body).replace(b"<head>", b"<head>" + TRACKER_CLOCK_JS.encode(), 1)
                    headers = [(k, str(len(page)).encode() if k == b"content-length" else v)
                               for k, v in start.get("headers", [])]
                    await send({**start, "headers": headers})
                    await send({"type": "http.response.body", "body": page})

        await self.app(scope, receive, rewrite)

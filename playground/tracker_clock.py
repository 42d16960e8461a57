"""Gradio's status-tracker clock, ticked ten times a second instead of on every animation frame.

Why: Gradio's StatusTracker counts a pending event's elapsed time in a `requestAnimationFrame` loop
(`performance.now()` every frame; it shows tenths of a second), and the app's own loading tracker
is unmounted while still pending, so its loop never stops: every open page asked Chromium for a
frame 50-80 times a second, for as long as it stayed open (Gradio 6.31). With Chromium on the
engine's two cores that kept an idle page at 0.06-0.09 cores, and cost the same during every run.
A script that runs before Gradio's modules capture `window.requestAnimationFrame` hands that one
callback to the next frame after `TICK_MS` instead: the clock still shows every tenth of a second.

Gradio places a Blocks' `head` into the page at run time, after its modules load, so the script
goes into the served HTML itself (`add_to_page`). The clock's callback is recognised by its
source (it reads `performance.now()` against its start, divides by 1e3 and re-arms itself); a
Gradio that words it differently is not throttled, and the browser test that counts the deferred
ticks fails.
"""

from __future__ import annotations

TICK_MS = 100  # the clock shows tenths of a second

TRACKER_CLOCK_JS = """<script>
(() => {
  const frame = window.requestAnimationFrame.bind(window);
  const clock = /performance\\.now\\(\\)-\\w+\\(\\w+\\)\\)\\/1e3\\),\\w+&&\\w+\\(\\)/;
  window.specplayClockTicks = 0;  // how many clock ticks were deferred (the browser test reads it)
  window.requestAnimationFrame = (callback) => clock.test(Function.prototype.toString.call(callback))
    ? (window.specplayClockTicks++, setTimeout(() => frame(callback), %d))
    : frame(callback);
})();
</script>""" % TICK_MS


def add_to_page(app) -> None:
    """Put `TRACKER_CLOCK_JS` first in the <head> of every HTML page the app serves."""
    from starlette.responses import Response

    @app.middleware("http")
    async def clock_first(request, call_next):
        response = await call_next(request)
        if request.method != "GET" or not response.headers.get("content-type", "").startswith("text/html"):
            return response
        body = b"".join([chunk async for chunk in response.body_iterator])
        body = body.replace(b"<head>", b"<head>" + TRACKER_CLOCK_JS.encode(), 1)
        headers = {k: v for k, v in response.headers.items() if k.lower() != "content-length"}
        return Response(body, status_code=response.status_code, headers=headers)

"""`python -m playground.browser_bench`: the engine alone against the same run watched in a browser.

For each method at the Generate tab's default settings (default prompt, seed 0) it runs, side by
side and interleaved repeat by repeat, (1) `engine.generate` / the SSD engine on this process's
main thread with the page's inspector width, and (2) the same request through a real playground
server (`python app.py`) in headless Debian Chromium via Playwright, timing the token view in the
page itself (a MutationObserver stamps every change of the token count with performance.now()).
It prints medians of: engine-only decode tok/s; the same request through the server's API with no
browser (gradio_client: what the server's pipeline costs); the page's tok/s (the engine's own decode
rate as the page ran it, shown in its status line); their ratio (the median of per-repeat ratios,
each page run against the engine-only run just before it, and each ratio); "× AR" as the engine alone gives it and as
the page's status line reads it (against this session's own AR run, when AR is among the methods), and
as a fresh page's first run of the method reads it (after the AR reference run that run starts with); the rate the browser saw tokens arrive;
time to first token (click to first token drawn); the longest gap between token-view updates
after the first token; the longest main-thread task Chromium reported; the cores Chromium kept
busy during the run (its CPU seconds over the run's wall time: what it took from the engine); and
its CPU ms a run, click to "finished". That last one is the steadiest measure of a page-side change on
a noisy VM: session 38's feed change read 635 -> 590 ms a run where the speed ratios' repeats spread
0.70-1.35.

Run by hand on a quiet machine (not in CI): `flock -x /tmp/specplay-cpu.lock python -m playground.browser_bench`.
`--browser-nice 19` starts Chromium at the lowest priority, the nearest this machine gets to a
visitor's browser on another machine: what is left of the gap is the server's pipeline and the
memory and caches the two share.
`--trace DIR` adds one traced page run per method after the repeats: a Chromium trace per method
in DIR and, per Chromium thread, its busy ms from the click to the first token and over the decode.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from engine.decoding import generate
from engine.events import FinishEvent
from engine.models import load_pair
from engine.ssd.ssd_decoding import SSDEngine
from playground.limits import DEFAULT_PROMPT, DEFAULT_SETTINGS, METHOD_LABELS, UI_METHODS, Limits, build_config, inspector_width

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("SPECPLAY_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
STARTUP_GUARD_SECONDS = 300  # hang guards only
RUN_GUARD_MS = 180_000
SETTLE_GUARD_SECONDS = 60
SETTLED_CORES = 0.15  # Chromium's rate on an idle page is 0.06-0.09 cores (Gradio's animation-frame loop)
SETTLE_WINDOW_SECONDS = 0.5

# Stamps every change of the token count (the live feed's row while the run streams, then the final
# token view) once the status line has left the previous run's "finished"; __done when Gradio's
# status line says "finished" again.
WATCH_JS = """() => {
  for (const o of window.__observers || []) o.disconnect();
  window.__observers = [];
  window.__marks = [];
  window.__longest = 0;
  window.__done = false;
  const tasks = new PerformanceObserver(l => { for (const e of l.getEntries()) window.__longest = Math.max(window.__longest, e.duration); });
  tasks.observe({type: 'longtask', buffered: false});
  window.__observers.push(tasks);
  const view = document.querySelector('#tokens'), live = document.querySelector('#tokens-live');
  const status = document.querySelector('#status');
  let last = -1, running = false;
  const watch = () => {
    const finished = status.textContent.includes('finished');  // textContent: no layout forced
    if (!finished) running = true;
    if (!running) return;  // still the previous run's view
    const n = Math.max(view.querySelectorAll('.token').length, live.querySelectorAll('.token').length);
    if (n !== last) { last = n; window.__marks.push([performance.now(), n]); }
    if (finished) window.__done = true;
  };
  for (const el of [view, live, status]) {
    const o = new MutationObserver(watch);
    o.observe(el, {subtree: true, childList: true, characterData: true});
    window.__observers.push(o);
  }
  window.__t0 = performance.now();
  document.querySelector('#generate-btn').click();
}"""


def settings(method: str, k: int) -> dict:
    return {**DEFAULT_SETTINGS, "method": method, "k": k}


def engine_only(pair, method: str, k: int, ssd: SSDEngine | None) -> float:
    """Decode tok/s of the engine alone on the main thread, the page's settings and inspector width."""
    cfg = build_config(Limits(), **settings(method, k))
    cfg = replace(cfg, inspect_top_n=inspector_width(pair.vocab_size, cfg.top_k))
    ids = pair.encode_prompt(DEFAULT_PROMPT)
    if method == "ssd":
        events = ssd.generate([ids], cfg, eos_token_ids=pair.eos_token_ids)
    else:
        drafter = None if method == "ar" else pair.make_drafter("model")
        events = generate(pair.make_target(), drafter, pair.tokenizer, ids, cfg, eos_token_ids=pair.eos_token_ids)
    finish = [e for e in events if isinstance(e, FinishEvent)][-1]
    return finish.metrics["decode_tokens_per_s"]


def api_run(client, method: str, k: int) -> float:
    """Decode tok/s of one /generate call at the page's defaults through the API (no browser)."""
    d = settings(method, k)
    outputs = client.predict(DEFAULT_PROMPT, method, k, d["delta"], d["temperature"], d["top_p"], d["top_k"],
                             d["posterior_threshold"], d["posterior_alpha"], d["max_new_tokens"], d["seed"],
                             api_name="/generate")
    return outputs[2]["metrics"]["decode_tokens_per_s"]


def start_server(pair: str, port: int, log: Path, root: Path = ROOT) -> subprocess.Popen:
    """`python app.py` of the tree at `root` on `port`, once it answers (its log in `log`)."""
    proc = subprocess.Popen([sys.executable, "app.py", "--pair", pair, "--host", "127.0.0.1", "--port", str(port),
                             "--devices", "cpu"], cwd=root, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONUNBUFFERED="1", GRADIO_ANALYTICS_ENABLED="False"))
    guard = time.monotonic() + STARTUP_GUARD_SECONDS
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the playground exited with {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2):
                return proc
        except OSError:
            if time.monotonic() > guard:
                raise RuntimeError("the playground did not start") from None
            time.sleep(0.5)


def page_run(page, method: str, cpu_seconds: Callable[[], float] | None = None) -> dict:
    """One Generate click at the defaults; the page's own tok/s, the browser's view of the stream
    and the cores Chromium kept busy meanwhile (CPU seconds over the run's wall time, and in all;
    `cpu_seconds` reads them, every Chromium process's by default)."""
    cpu_seconds = cpu_seconds or browser_cpu_seconds
    page.get_by_label(METHOD_LABELS[method]).check()
    # A method change re-renders the vLLM config's code view and the SSD controls (a server call and
    # ~50 ms of main thread). A visitor picks the method before reaching for Generate; clicking in the
    # same millisecond put that work on the engine's cores inside the measured run.
    settle()
    cpu_before, wall_before = cpu_seconds(), time.monotonic()
    page.evaluate(WATCH_JS)
    # Polled every 250 ms, not every animation frame: a rAF poll makes the page draw 60 frames a
    # second on the engine's cores, a cost no real visitor's browser adds.
    page.wait_for_function("window.__done", timeout=RUN_GUARD_MS, polling=250)
    browser_cpu, wall = cpu_seconds() - cpu_before, time.monotonic() - wall_before
    marks, t0, longest = page.evaluate("[window.__marks, window.__t0, window.__longest]")
    settle()
    marks = [(t, n) for t, n in marks if n > 0]
    status = page.locator("#status").inner_text()
    tps = float(status.split(" tok/s")[0].split("·")[-1].strip())
    times = [t for t, _ in marks]
    gaps = [b - a for a, b in zip(times, times[1:])]
    span = (times[-1] - times[0]) / 1e3 if len(times) > 1 else 0.0
    x_ar = re.search(r"([\d.]+)× AR", status)
    return {"page_tps": tps, "x_ar": float(x_ar.group(1)) if x_ar else None,
            "tokens": marks[-1][1], "first_token_s": (times[0] - t0) / 1e3,
            "longest_gap_s": max(gaps, default=0.0) / 1e3,
            "seen_tps": (marks[-1][1] - marks[0][1]) / span if span else None, "long_task_ms": longest,
            "browser_cores": browser_cpu / wall, "browser_cpu_ms": 1e3 * browser_cpu}


def open_page(browser, url: str):
    """The playground at `url` in a new 1440x900 page of `browser`, once its Generate button is there."""
    page = browser.new_page(viewport={"width": 1440, "height": 900})
    page.goto(url)
    page.wait_for_selector("#generate-btn")
    return page


def first_run_x_ar(browser, url: str, method: str) -> float | None:
    """"× AR" as a new visitor's first run of `method` reads it: a fresh page (a new session, with no
    AR run of its own), one Generate click. That run starts with the page's AR reference run."""
    page = open_page(browser, url)
    try:
        settle()
        return page_run(page, method)["x_ar"]
    finally:
        page.close()


TRACE_CATEGORIES = ["toplevel", "devtools.timeline", "blink.user_timing"]
TRACE_MARK = "specplay-trace"


def traced_run(browser, page, method: str, path: Path) -> dict[str, tuple[float, float]]:
    """One more page run under a Chromium trace, written to `path` (open it in Perfetto or
    chrome://tracing): per Chromium thread, its busy ms from the click to the first token and over
    the decode (first to last token). This is how the growing token row was found to repaint and
    re-raster the whole page on every feed message."""
    browser.start_tracing(page=page, path=str(path), categories=TRACE_CATEGORIES)
    page.evaluate(f"performance.mark('{TRACE_MARK}')")
    page_run(page, method)
    marks, t0 = page.evaluate("[window.__marks.filter(m => m[1] > 0).map(m => m[0]), window.__t0]")
    browser.stop_tracing()
    return thread_busy(json.loads(path.read_text()), t0, marks)


def thread_busy(trace: dict | list, t0: float, marks: list[float]) -> dict[str, tuple[float, float]]:
    """Busy ms per thread name in (click -> first token, first -> last token), from the trace's
    top-level tasks; page times (performance.now()) are placed on the trace clock by TRACE_MARK.
    Top-level tasks nest (a RunTask holds the mojo message or the microtask checkpoint it runs), so
    each thread's busy time is the union of their intervals (before session 39 it was their sum)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    mark = next(e for e in events if e.get("name") == TRACE_MARK)

    def to_trace(ms: float) -> float:  # page ms -> trace µs
        return mark["ts"] + (ms - mark["args"]["data"]["startTime"]) * 1e3

    windows = [(to_trace(t0), to_trace(marks[0])), (to_trace(marks[0]), to_trace(marks[-1]))]
    tasks: dict[tuple, list[tuple[float, float]]] = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat", "").startswith("toplevel") and "dur" in e:
            tasks[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    busy: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for thread, intervals in tasks.items():
        for start, end in _union(intervals):
            for i, (a, b) in enumerate(windows):
                overlap = min(b, end) - max(a, start)
                if overlap > 0:
                    busy[names.get(thread, str(thread[1]))][i] += overlap / 1e3
    return {name: (first, decode) for name, (first, decode) in
            sorted(busy.items(), key=lambda item: -item[1][1])}


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The disjoint intervals covering the same time as `intervals`."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def settle() -> None:
    """Wait until Chromium is back to its idle rate: after a run's final update the page still
    draws the seven final charts (about a second of main thread), which would otherwise land on
    the next measurement, engine-only or page, and on neither in a visitor's use."""
    guard = time.monotonic() + SETTLE_GUARD_SECONDS
    while time.monotonic() < guard:
        before = browser_cpu_seconds()
        time.sleep(SETTLE_WINDOW_SECONDS)
        if (browser_cpu_seconds() - before) / SETTLE_WINDOW_SECONDS < SETTLED_CORES:
            return


def browser_cpu_seconds() -> float:
    """User + system CPU seconds of every live Chromium process (/proc: this bench's browser is the
    only one on a quiet machine): core-time the engine's two threads do not have. (Before the
    kernels' work pool, session 37, it stalled the whole forward, not just one thread's share.)"""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # exited meanwhile
            continue
        name, rest = text[text.index("(") + 1: text.rindex(")")], text[text.rindex(")") + 2:].split()
        if name.startswith(("chrom", "headless")):
            total += int(rest[11]) + int(rest[12])  # utime, stime (fields 14 and 15 of stat)
    return total / ticks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default="default", choices=("default", "tiny"))
    ap.add_argument("--methods", default=",".join(UI_METHODS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--browser-nice", type=int, default=0,
                    help="run Chromium at this nice level (0-19): a visitor's browser is not on the server's "
                         "cores, so 19 shows what the page's pipeline costs the engine without its CPU")
    ap.add_argument("--trace", type=Path, default=None,
                    help="folder: after the repeats, one traced page run per method (trace-<method>.json)")
    args = ap.parse_args(argv)
    from gradio_client import Client
    from playwright.sync_api import sync_playwright

    methods = [m for m in args.methods.split(",") if m]
    pair = load_pair(args.pair)
    k = pair.recommended_k("model")
    ssd = SSDEngine(pair) if "ssd" in methods else None
    port = args.port or free_port()
    log = ROOT / "artifacts" / "browser-bench-server.log"
    log.parent.mkdir(exist_ok=True)
    server = start_server(args.pair, port, log)
    rows: dict[str, list[tuple[float, dict]]] = {m: [] for m in methods}
    traces: dict[str, dict[str, tuple[float, float]]] = {}
    api: dict[str, list[float]] = {m: [] for m in methods}
    first_runs: dict[str, list[float]] = {m: [] for m in methods if m != "ar"}
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=niced(CHROMIUM, args.browser_nice, log.parent), args=CHROMIUM_ARGS)
            page = open_page(browser, f"http://127.0.0.1:{port}")
            settle()
            client = Client(f"http://127.0.0.1:{port}/", verbose=False)
            for method in methods:  # warm-up: first SSD worker start, first chart draw
                engine_only(pair, method, k, ssd)
                api_run(client, method, k)
                page_run(page, method)
            for _ in range(args.repeats):
                for method in methods:
                    rows[method].append((engine_only(pair, method, k, ssd), page_run(page, method)))
                    api[method].append(api_run(client, method, k))
                    print(method, f"engine {rows[method][-1][0]:.1f} tok/s, API {api[method][-1]:.1f}, page",
                          rows[method][-1][1], flush=True)
                for method in first_runs:
                    first_runs[method].append(first_run_x_ar(browser, f"http://127.0.0.1:{port}", method))
                    print(method, "a fresh page's first run:", first_runs[method][-1], "x AR", flush=True)
            if args.trace is not None:
                args.trace.mkdir(parents=True, exist_ok=True)
                for method in methods:
                    traces[method] = traced_run(browser, page, method, args.trace / f"trace-{method}.json")
            browser.close()
    finally:
        server.terminate()
        server.wait(timeout=30)
        if ssd is not None:
            ssd.close()
    print(f"pair {args.pair}, K {k}, defaults {DEFAULT_SETTINGS}, median of {args.repeats}; CPU: {cpu_name()}; "
          f"Chromium at nice {args.browser_nice}")
    print(f"{'method':8} {'engine tok/s':>12} {'API tok/s':>9} {'page tok/s':>10} {'ratio':>6} {'x AR engine':>11} {'x AR page':>9} "
          f"{'x AR 1st run':>12} {'seen tok/s':>10} {'1st token s':>11} {'longest gap s':>13} {'long task ms':>12} "
          f"{'browser cores':>13} {'browser CPU ms':>14}  page/engine per repeat")
    # Ratios are medians of per-repeat ratios (each page run against the engine-only run just before
    # it; each method against AR in the same repeat), so the VM's drift between repeats cancels.
    for method, results in rows.items():
        def med(key: str) -> float:
            return _median([r[key] for _, r in results])

        engine = statistics.median(e for e, _ in results)
        ratios = [r["page_tps"] / e for e, r in results]
        x_ar_engine = statistics.median(e / ar for (e, _), (ar, _) in zip(results, rows["ar"])) \
            if rows.get("ar") and method != "ar" else float("nan")
        print(f"{method:8} {engine:12.1f} {statistics.median(api[method]):9.1f} {med('page_tps'):10.1f} "
              f"{statistics.median(ratios):6.2f} {x_ar_engine:11.2f} {med('x_ar'):9.2f} "
              f"{_median(first_runs.get(method, [])):12.2f} "
              f"{med('seen_tps'):10.1f} {med('first_token_s'):11.2f} {max(r['longest_gap_s'] for _, r in results):13.2f} "
              f"{max(r['long_task_ms'] for _, r in results):12.0f} {med('browser_cores'):13.2f} "
              f"{med('browser_cpu_ms'):14.0f}  "
              + " / ".join(f"{x:.2f}" for x in ratios))
    for method, busy in traces.items():
        alone = not any(decode for _, decode in busy.values())  # every token in one update
        print(f"{method}: Chromium threads' busy ms, click to first token / decode (traced run, {args.trace})"
              + (": every token arrived in one update, no decode window" if alone else ""))
        for name, (first, decode) in list(busy.items())[:6]:
            print(f"  {name:28} {first:7.1f} {decode:7.1f}")
    return 0


def _median(values: list[float | None]) -> float:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else float("nan")


def niced(executable: str, level: int, folder: Path) -> str:
    """`executable`, or a wrapper that starts it at nice `level` (every process and thread it
    spawns inherits the level: Linux keeps one per thread, so renicing after launch would miss some)."""
    if level == 0:
        return executable
    wrapper = folder / f"chromium-nice{level}"
    wrapper.write_text(f'#!/bin/sh\nexec nice -n {level} {executable} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())

"""Plotly figure builders: pure functions of a `RunState` (no Gradio, no engine calls).

Each figure is bounded (the last MAX_TOKENS tokens / MAX_ROUNDS rounds), because every `gr.Plot`
update ships the whole figure as JSON; live-tuning changes are drawn as dotted vertical lines.
Figures are built in one `go.Figure(data, layout)` call from plain dicts: plotly's incremental
`add_*`/`update_*` calls and named templates cost 30+ ms per figure, too slow for live redraws.
"""

from __future__ import annotations

import html
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass

import plotly.graph_objects as go

from playground.state import STATUS_COLOURS, RunState, summary

MAX_TOKENS = 400
MAX_ROUNDS = 200
THROUGHPUT_WINDOW = 5  # rounds per point of the tokens/s line
GANTT_ROUNDS = 30
HEIGHT = 270
HINT_WIDTH = 48  # characters per line of an empty chart's hint
CHANGE_COLOUR = "#d62728"
AXIS_STYLE = {"gridcolor": "#eaeaea", "zerolinecolor": "#cccccc", "linecolor": "#cccccc"}


def figure(traces: Sequence[dict], title: str, x: str = "", y: str = "", *, shapes: Sequence[dict] = (),
           annotations: Sequence[dict] = (), height: int = HEIGHT, xaxis: dict | None = None,
           yaxis: dict | None = None, caption: str = "", margin: dict | None = None, **layout) -> go.Figure:
    """One light-styled figure from trace dicts (the shared look of every chart). A `caption` goes
    under the title in small type, wrapped to fit a half-width chart (`_captioned`)."""
    margin = {"l": 50, "r": 20, "t": 40, "b": 40, **(margin or {})}
    if caption:
        title, margin["t"] = _captioned(title, caption)
    return go.Figure(data=list(traces), layout={
        "template": None, "paper_bgcolor": "white", "plot_bgcolor": "white",
        "font": {"family": "sans-serif", "size": 11, "color": "#333"},
        "title": {"text": title, "font": {"size": 14}}, "height": height,
        "margin": margin, "uirevision": "keep",
        "legend": {"orientation": "h", "y": -0.25, "font": {"size": 10}},
        "xaxis": {**AXIS_STYLE, "title": {"text": x}, **(xaxis or {})},
        "yaxis": {**AXIS_STYLE, "title": {"text": y}, **(yaxis or {})},
        "shapes": list(shapes), "annotations": list(annotations), **layout,
    })


def empty_chart(title: str, message: str) -> go.Figure:
    """A titled chart with a one-line hint (wrapped: Plotly does not wrap annotations, and half-width charts are narrow)."""
    return figure([], title, annotations=[{"text": "<br>".join(textwrap.wrap(message, HINT_WIDTH)), "showarrow": False, "x": 0.5, "y": 0.5, "xref": "paper",
                                           "yref": "paper", "font": {"size": 13, "color": "#666"}}],
                  xaxis={"visible": False}, yaxis={"visible": False})


def _vline(x: float, label: str, colour: str = CHANGE_COLOUR) -> tuple[dict, dict]:
    return ({"type": "line", "x0": x, "x1": x, "y0": 0, "y1": 1, "xref": "x", "yref": "paper",
             "line": {"dash": "dot", "color": colour, "width": 1.5}},
            {"x": x, "y": 1, "xref": "x", "yref": "paper", "text": label, "showarrow": False, "xanchor": "left",
             "yanchor": "top", "font": {"size": 10, "color": colour}})


def _hline(y: float, label: str, colour: str = "#555") -> tuple[dict, dict]:
    return ({"type": "line", "x0": 0, "x1": 1, "y0": y, "y1": y, "xref": "paper", "yref": "y",
             "line": {"dash": "dash", "color": colour, "width": 1.5}},
            {"x": 1, "y": y, "xref": "paper", "yref": "y", "text": label, "showarrow": False, "xanchor": "right",
             "yanchor": "bottom", "font": {"size": 10, "color": colour}})


def change_marks(state: RunState, axis: str, lo: float = float("-inf")) -> tuple[list[dict], list[dict]]:
    """Dotted vertical lines and labels where a live-tuning change took effect
    (axis: token index | round index | time in seconds | time in ms, all since the generation started)."""
    position = {"token": lambda c: c.token_index - 0.5, "round": lambda c: c.round_index - 0.5,
                "time": lambda c: c.elapsed_seconds, "ms": lambda c: c.elapsed_seconds * 1e3}[axis]
    shapes, notes = [], []
    for change in state.changes:
        x = position(change)
        if x >= lo:
            shape, note = _vline(x, change.label)
            shapes.append(shape)
            notes.append(note)
    return shapes, notes


def acceptance_per_position(state: RunState) -> go.Figure:
    """Per draft position: how often it was kept (after the first-rejection cut) and how often its own test passed."""
    rounds = [r for r in state.rounds[-MAX_ROUNDS:] if r.num_draft_tokens]
    if not rounds:
        return empty_chart("Acceptance per draft position", "AR drafts nothing" if state.method == "ar"
                      else "how often each draft position survives: deeper positions need every earlier one kept")
    width = max(r.num_draft_tokens for r in rounds)
    drafted = [sum(1 for r in rounds if r.num_draft_tokens > i) for i in range(width)]
    kept = [sum(1 for r in rounds if r.num_accepted > i) for i in range(width)]
    passed = [sum(1 for r in rounds if len(r.accepted_positions) > i and r.accepted_positions[i]) for i in range(width)]
    x = list(range(1, width + 1))
    return figure([
        {"type": "bar", "x": x, "y": [k / d if d else 0 for k, d in zip(kept, drafted)], "name": "kept",
         "marker": {"color": STATUS_COLOURS["accepted"]}, "customdata": drafted,
         "hovertemplate": "position %{x}: %{y:.0%} kept of %{customdata} drafted<extra></extra>"},
        {"type": "scatter", "x": x, "y": [p / d if d else 0 for p, d in zip(passed, drafted)],
         "mode": "markers+lines", "name": "passed its own test", "marker": {"color": "#555"},
         "line": {"dash": "dot"}},
    ], "Acceptance per draft position", "draft position", "rate",
        yaxis={"range": [0, 1.05]}, xaxis={"dtick": 1})


def acceptance_histogram(state: RunState) -> go.Figure:
    """Rounds that accepted exactly j drafts (vLLM `acceptance_histogram`)."""
    rounds = [r for r in state.rounds if r.num_draft_tokens]
    if not rounds:
        return empty_chart("Acceptance length", "AR drafts nothing" if state.method == "ar"
                      else "drafts accepted per round: more to the right = fewer target passes per token")
    counts = [0] * (max(r.num_draft_tokens for r in rounds) + 1)
    for r in rounds:
        counts[r.num_accepted] += 1
    mean = 1 + sum(r.num_accepted for r in rounds) / len(rounds)
    return figure([{"type": "bar", "x": list(range(len(counts))), "y": counts,
                    "marker": {"color": STATUS_COLOURS["bonus"]}}],
                  f"Accepted drafts per round (mean acceptance length {mean:.2f})", "drafts accepted in the round",
                  "rounds", xaxis={"dtick": 1})


def _round_config(state: RunState, round_index: int) -> dict:
    r = state.round_of(round_index)
    return r.config if r is not None else state.config


DIVERGENCE_CAPTION = {
    "sps": "SpS is lossless: it emits T itself, so KL(induced ‖ T) = 0 at every tested position.",
    "tas": "TAS keeps a draft whose T(x) passes its threshold and recovers with argmax T: it enforces no "
           "divergence bound.",
    "cactus": "Bars: KL(h ‖ T) per step, which δ bounds. What is emitted is bounded by "
              "min(Γ(δ), KL(D ‖ T)) (Thm 3), not by δ.",
}
CAPTION_WIDTH = 58  # characters per caption line: the chart is half the page wide; in two lines the
# caption stays in the title's margin (Plotly centres a title there, and a third line reached the plot)
NOTE_WIDTH = 90  # characters per line of a note inside a half-width plot (10 px text)


def _captioned(title: str, caption: str) -> tuple[str, int]:
    """(title text, top margin) for a short title over a caption in small type, wrapped to fit a
    half-width chart: a long title is cut off at the chart's edge, where Plotly does not wrap it."""
    lines = textwrap.wrap(caption, CAPTION_WIDTH)
    return title + "".join(f"<br><sub>{line}</sub>" for line in lines), 50 + 16 * len(lines)


def _note(text: str) -> dict:
    """A note in the plot's top-left corner, wrapped (Plotly does not wrap annotations)."""
    return {"text": "<br>".join(textwrap.wrap(text, NOTE_WIDTH)), "showarrow": False, "x": 0, "y": 1.0,
            "xref": "paper", "yref": "paper", "xanchor": "left", "yanchor": "top", "align": "left",
            "bgcolor": "rgba(255,255,255,0.85)", "font": {"size": 10, "color": CHANGE_COLOUR}}


INDUCED_COLOUR, DRAFT_COLOUR, CONSTRAINT_COLOUR = "#9467bd", "#7f7f7f", "#8c564b"


def divergence_budget(state: RunState) -> go.Figure:
    """Divergence from the target at every tested position: the exact KL(induced ‖ T) of what the rule
    emits, KL(D ‖ T) of sampling the draft alone (Cactus Thm 3's ceiling) and, for Cactus, its
    per-step constraint KL(h ‖ T) against δ. The running total of the induced divergence is on the right axis."""
    tokens = state.tokens[-MAX_TOKENS:]
    caption = DIVERGENCE_CAPTION.get(state.method, "")
    if not any(t.index in state.divergence for t in tokens):
        return empty_chart("Divergence from the target", caption or
                      "exact KL(induced ‖ T) at every position a rule tests a draft; AR tests none")
    x = [t.index for t in tokens]
    tested = [t for t in tokens if t.index in state.divergence]
    configs = {t.index: _round_config(state, t.round_index) for t in tokens}
    traces = []
    if any(configs[t.index].get("method") == "cactus" for t in tested):
        traces.append({"type": "bar", "x": [t.index for t in tested], "y": [t.constraint_kl for t in tested],
                       "name": "KL(h ‖ T): Cactus's per-step constraint", "marker": {"color": CONSTRAINT_COLOUR},
                       "opacity": 0.45})
        traces.append({"type": "scatter", "x": x, "y": [configs[i].get("delta") for i in x], "mode": "lines",
                       "line": {"shape": "hv", "color": CHANGE_COLOUR, "dash": "dash"},
                       "name": "δ: the constraint's bound (second order, Cor. 5)"})
    draft = [(t.index, state.divergence[t.index].draft_kl) for t in tested]
    finite = [(i, v) for i, v in draft if v != float("inf")]
    outside = len(draft) - len(finite)
    traces.append({"type": "scatter", "x": [i for i, _ in finite], "y": [v for _, v in finite], "mode": "markers",
                   "name": "KL(D ‖ T): the draft alone" + (" (Thm 3 ceiling)" if state.method == "cactus" else "")
                   + (f"<br>∞ at {outside} positions: D outside T's support" if outside else ""),
                   "marker": {"symbol": "x", "size": 5, "color": DRAFT_COLOUR}})
    traces.append({"type": "scatter", "x": [t.index for t in tested],
                   "y": [state.divergence[t.index].induced_kl for t in tested], "mode": "markers",
                   "name": "KL(induced ‖ T): what is emitted (exact)",
                   "marker": {"symbol": "diamond", "size": 7, "color": INDUCED_COLOUR}})
    shown = [(i, v) for i, v in running_induced_kl(state) if i >= x[0]]
    traces.append({"type": "scatter", "x": [i for i, _ in shown], "y": [v for _, v in shown], "mode": "lines",
                   "name": "Σ KL(induced ‖ T) so far (right axis)", "yaxis": "y2", "line": {"color": "#333"}})
    shapes, notes = change_marks(state, "token", x[0] - 1)
    return figure(traces, "Divergence from the target", "token index", "nats at a tested position", shapes=shapes,
                  annotations=notes, caption=caption, height=HEIGHT + 150, margin={"r": 50, "b": 150},
                  legend={"orientation": "h", "y": -0.22, "yanchor": "top", "font": {"size": 10}},
                  yaxis2={"overlaying": "y", "side": "right", "title": {"text": "total nats"}, "showgrid": False})


def running_induced_kl(state: RunState) -> list[tuple[int, float]]:
    """(token index, Σ KL(induced ‖ T) up to it) at every tested position so far."""
    total, running = 0.0, []
    for index, divergence in sorted(state.divergence.items()):
        total += divergence.induced_kl
        running.append((index, total))
    return running


def throughput_points(rounds: Sequence, window: int = THROUGHPUT_WINDOW) -> list[tuple[float, float]]:
    """(seconds since start, tokens/s over the last `window` rounds) at the end of each round from the
    second on. The first round's first row is the prefill's last one, already computed: AR's first
    round runs no forward at all, and its 1 token in about a millisecond (1,160 tok/s) set the live
    chart's scale for the whole run, with the real line squashed at the bottom."""
    points = []
    for i, r in enumerate(rounds):
        if r.round_index == 0:
            continue
        chunk = [c for c in rounds[max(0, i - window + 1): i + 1] if c.round_index > 0]
        seconds = sum(c.round_seconds for c in chunk)
        points.append((r.elapsed_seconds, sum(c.num_emitted for c in chunk) / seconds if seconds > 0 else 0.0))
    return points


def throughput(state: RunState, ar_baseline_tps: float | None, window: int = THROUGHPUT_WINDOW) -> go.Figure:
    """Tokens/s over time (a moving window of rounds) with the measured AR baseline."""
    rounds = state.rounds[-MAX_ROUNDS:]
    if not rounds:
        return empty_chart("Tokens/s over time", "speed as it runs, against your AR reference; live changes are marked")
    points = throughput_points(rounds, window)
    xs, ys = [x for x, _ in points], [y for _, y in points]
    shapes, notes = change_marks(state, "time", rounds[0].elapsed_seconds - rounds[0].round_seconds)
    if ar_baseline_tps:
        shape, note = _hline(ar_baseline_tps, f"AR baseline {ar_baseline_tps:.1f} tok/s")
        shapes.append(shape)
        notes.append(note)
    return figure([{"type": "scatter", "x": xs, "y": ys, "mode": "lines+markers",
                    "name": f"{state.method} (last {window} rounds)", "marker": {"size": 4},
                    "line": {"color": STATUS_COLOURS["accepted"]}}],
                  "Tokens/s over time", "seconds since start", "tokens/s", shapes=shapes, annotations=notes)


@dataclass(frozen=True)
class LiveSeries:
    """A key chart's live view while the run streams: one line the page draws on a canvas over the
    chart (a Plotly redraw holds Chromium's main thread 20-70 ms, with the browser on the engine's
    cores a cost the engine paid; a canvas line takes well under a millisecond). Points only ever
    get appended, so the feed sends each one once. The full chart is drawn when the run pauses or ends."""

    title: str
    x_label: str
    y_label: str
    points: list[tuple[float, float]]
    reference: tuple[float, str] | None = None  # a horizontal line: (y, label)
    marks: tuple[tuple[float, str], ...] = ()  # live changes: (x, label)


def live_series(state: RunState, ar_baseline_tps: float | None) -> dict[str, LiveSeries]:
    """The two key charts' live lines, keyed by chart id: tokens/s against the AR reference, and the
    running total of the exact induced divergence."""
    reference = (ar_baseline_tps, f"AR {ar_baseline_tps:.1f} tok/s") if ar_baseline_tps else None
    return {
        "chart-throughput": LiveSeries(
            f"Tokens/s over time (live, last {THROUGHPUT_WINDOW} rounds)", "seconds since start", "tokens/s",
            throughput_points(state.rounds), reference,
            tuple((c.elapsed_seconds, c.label) for c in state.changes)),
        "chart-divergence": LiveSeries(
            "Σ KL(induced ‖ T) so far (live)", "token index", "total nats",
            running_induced_kl(state), None, tuple((c.token_index - 0.5, c.label) for c in state.changes)),
    }


SSD_LANES = {"draft": "#17becf", "target": "#bcbd22", "wait": "#d62728"}


def ssd_timeline(state: RunState) -> go.Figure:
    """SSD's Gantt: the draft worker's serve/fill intervals overlap the target's verifications."""
    rounds = state.ssd_rounds[-GANTT_ROUNDS:]
    traces = []
    for lane, colour in SSD_LANES.items():
        spans = [s for r in rounds for s in r.timeline if s.lane == lane]
        traces.append({
            "type": "bar", "orientation": "h", "name": lane, "y": [lane] * len(spans),
            "x": [(s.end - s.start) * 1e3 for s in spans], "base": [s.start * 1e3 for s in spans],
            "marker": {"color": colour}, "text": [s.label for s in spans],
            "hovertemplate": "%{text}: %{x:.1f} ms<extra>" + lane + "</extra>", "textposition": "none",
        })
    devices = state.start.devices if state.start else ""
    first = min((s.start for r in rounds for s in r.timeline), default=0.0)
    shapes, notes = change_marks(state, "ms", first * 1e3)
    return figure(traces, f"SSD timeline (last {len(rounds)} rounds)", "ms since start", "", barmode="overlay",
                  shapes=shapes, annotations=notes,
                  caption=f"{devices}: the draft fills the cache while the target verifies")


def draft_verify_timeline(state: RunState) -> go.Figure:
    """Gantt of the last rounds: when the draft and the target ran. Synchronous methods never overlap."""
    if state.ssd_rounds:
        return ssd_timeline(state)
    rounds = state.rounds[-GANTT_ROUNDS:]
    if not rounds:
        return empty_chart("Draft / verify timeline", "when the draft and the target ran: synchronous methods alternate")
    traces = []
    for lane, colour, offset_of, seconds_of in (
        ("draft", "#17becf", lambda r: 0.0, lambda r: r.draft_seconds),
        ("verify", "#bcbd22", lambda r: r.draft_seconds, lambda r: r.verify_seconds),
    ):
        traces.append({
            "type": "bar", "orientation": "h", "name": lane, "y": [lane] * len(rounds),
            "x": [seconds_of(r) * 1e3 for r in rounds], "marker": {"color": colour},
            "base": [(r.elapsed_seconds - r.round_seconds + offset_of(r)) * 1e3 for r in rounds],
            "customdata": [r.round_index for r in rounds],
            "hovertemplate": "round %{customdata}: %{x:.1f} ms<extra>" + lane + "</extra>",
        })
    devices = state.start.devices if state.start else ""
    return figure(traces, f"Draft / verify timeline (last {len(rounds)} rounds)", "ms since start", "",
                  barmode="overlay", caption=f"{devices}; synchronous: the draft and the target take turns")


def ssd_cache_hits(state: RunState) -> go.Figure:
    """Tokens per round, coloured by cache hit or miss (and the backup that ran), with the cache's
    contents (keys (k, y) and fan-out per depth) on hover."""
    rounds = state.ssd_rounds[-MAX_ROUNDS:]
    if not rounds:
        return empty_chart("SSD cache hits per round", "SSD only: green = the draft guessed the outcome ahead (cache hit)")
    colours = {"cache": STATUS_COLOURS["accepted"], "sync": "#7f7f7f", "local": "#7f7f7f"}
    hover = [_cache_hover(r) for r in rounds]
    trace = {"type": "bar", "x": [r.round_index for r in rounds], "y": [r.num_emitted[0] for r in rounds],
             "marker": {"color": [colours.get(r.sources[0], "#d62728") for r in rounds]},
             "customdata": [r.sources[0] for r in rounds], "text": hover, "textposition": "none",
             "hovertemplate": "round %{x}: %{y} tokens (%{customdata})<br>%{text}<extra></extra>"}
    m = state.finish.metrics if state.finish else {}
    last = rounds[-1]
    hit = f"{last.hit_rate:.0%}" if last.hit_rate is not None else "–"
    per = [f"{kind} {m[key]:.2f}" for kind, key in (("hit", "tokens_per_round_hit"), ("miss", "tokens_per_round_miss"))
           if m.get(key) is not None]
    per = f"; tokens/round {', '.join(per)}" if per else ""
    notes = [f"{w.kind}: {w.message}" for w in state.worker_events if w.kind != "started"] or \
        [r.fill_note for r in rounds[-1:] if r.fill_note]
    annotations = [_note(notes[-1])] if notes else []
    shapes, marks = change_marks(state, "round", rounds[0].round_index - 0.5)
    return figure([trace], f"SSD cache: hit rate {hit}", "round", "tokens emitted", shapes=shapes,
                  annotations=annotations + marks,
                  caption=f"green hit, red miss → backup, grey drafted by the target{per}")


def _cache_hover(r) -> str:
    """Round r's lookup and the keys its cache held, each key (k, y) as k and y's text."""
    if r.sources[0] == "local":
        return "drafted in the target process (no cache lookup)"
    keys, texts = r.cache_keys[0], (r.cache_key_texts[0] if r.cache_key_texts else ())
    lookup = r.lookup_keys[0]
    looked_up = "none (a first round, or the first after rounds drafted by the target)" if lookup is None else \
        _key_text(lookup, r.lookup_texts[0] if r.lookup_texts else str(lookup[1]))
    shown = ", ".join(_key_text(key, text) for key, text in zip(keys[:12], texts or map(str, (y for _, y in keys))))
    return (f"lookup {looked_up} in {len(keys)} keys, F={list(r.fanouts)}<br>"
            f"keys: {shown}{'…' if len(keys) > 12 else ''}{_first_token_note(r)}")


def _first_token_note(r) -> str:
    """A feature draft's hit redraws its first token from the real features (engine/ssd/worker.py): say
    whether the cached one survived, since a replaced one ends the speculation at that one token."""
    kept = r.first_kept[0] if r.first_kept else None
    if kept is None:
        return ""
    if kept:
        return f"<br>first token: the cached one, kept by the redraw (branch depth {r.cache_depth})"
    return "<br>first token redrawn from the real features: the round serves that one token"


def _key_text(key: tuple[int, int], text: str) -> str:
    return f"k={key[0]} {html.escape(repr(text))}"


def ssd_speedup(state: RunState) -> go.Figure:
    """Theorem 7's speedup from the measured hit rate, E_hit/E_miss and T_p/T_b, next to the measured one."""
    rounds = [r for r in state.ssd_rounds if r.theoretical_speedup is not None]
    if not rounds:
        local = state.ssd_rounds and all(s == "local" for r in state.ssd_rounds for s in r.sources)
        return empty_chart("SSD speedup (Theorem 7)", "no cache lookups: every round was drafted in the target process "
                      "(the cache chart says why)" if local else "needs a few SSD rounds")
    x = [r.round_index for r in rounds]
    traces = [
        {"type": "scatter", "x": x, "y": [r.theoretical_speedup for r in rounds], "mode": "lines",
         "name": "Theorem 7 (measured p_hit, E, T_p, T_b)", "line": {"color": "#7f7f7f"}},
        {"type": "scatter", "x": x, "y": [r.measured_speedup for r in rounds], "mode": "lines",
         "name": "measured (tokens per verification-time)", "line": {"color": CHANGE_COLOUR}},
    ]
    r = rounds[-1].rates
    shape, note = _hline(1.0, "one token per verification", "#aaaaaa")
    shapes, notes = change_marks(state, "round", x[0] - 0.5)
    t_p, t_b = r.get("t_p"), r.get("t_b")
    return figure(traces, "SSD speedup (Theorem 7)", "round", "speedup", shapes=[shape, *shapes],
                  annotations=[note, *notes],
                  caption=f"T_p={t_p or 0:.2f}, T_b={t_b or 0:.2f}, backup {r.get('backup')}, r={r.get('power_r', 0):.2f}")


def expected_speedup(alpha: float, k: int, cost_ratio: float) -> float:
    """Leviathan et al.: E[tokens per round] / (1 + K·c) with i.i.d. acceptance α and draft/target cost c."""
    tokens = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (1 + k * cost_ratio)


def speedup_curve(state: RunState, ar_baseline_tps: float | None) -> go.Figure:
    """Theoretical speedup against α for this run's K and measured cost ratio c, with the measured point."""
    rounds = [r for r in state.rounds if r.num_draft_tokens]
    if not rounds:
        return empty_chart("Speedup vs acceptance rate α", "theory for this K and draft cost, with this run's measured point")
    drafted = sum(r.num_draft_tokens for r in rounds)
    alpha = sum(r.num_accepted for r in rounds) / drafted
    k = rounds[-1].num_speculative_tokens or rounds[-1].num_draft_tokens
    verify = sum(r.verify_seconds for r in rounds) / len(rounds)
    cost_ratio = (sum(r.draft_seconds for r in rounds) / drafted) / verify if verify > 0 else 0.0
    alphas = [i / 50 for i in range(51)]
    traces = [{"type": "scatter", "x": alphas, "y": [expected_speedup(a, k, cost_ratio) for a in alphas],
               "mode": "lines", "name": f"theory: K={k}, c={cost_ratio:.2f}", "line": {"color": "#7f7f7f"}}]
    tps = summary(state).get("decode_tokens_per_s")  # the status line's figure
    if ar_baseline_tps and tps:
        traces.append({"type": "scatter", "x": [alpha], "y": [tps / ar_baseline_tps], "mode": "markers",
                       "name": f"measured (α={alpha:.2f}, {tps / ar_baseline_tps:.2f}×)",
                       "marker": {"size": 12, "color": CHANGE_COLOUR, "symbol": "x"}})
    shape, note = _hline(1.0, "AR", "#aaaaaa")
    return figure(traces, "Speedup vs acceptance rate α (theory and this run)", "draft acceptance rate α",
                  "speedup over AR", shapes=[shape], annotations=[note])


def live_figures(state: RunState, ar_baseline_tps: float | None) -> tuple[go.Figure, ...]:
    """Every live chart of the Generate tab, in layout order."""
    return (
        acceptance_per_position(state), acceptance_histogram(state), divergence_budget(state),
        throughput(state, ar_baseline_tps), draft_verify_timeline(state), ssd_cache_hits(state),
        ssd_speedup(state) if state.ssd_rounds else speedup_curve(state, ar_baseline_tps),
    )


def pareto_front(points: Sequence[dict]) -> list[dict]:
    """Points no other point beats on both axes (less divergence, more acceptance)."""
    ordered = sorted(points, key=lambda p: (p["divergence"], -p["mean_acceptance_length"]))
    front, best = [], float("-inf")
    for p in ordered:
        if p["mean_acceptance_length"] > best:
            front.append(p)
            best = p["mean_acceptance_length"]
    return front


LABEL_SIDES = ("top center", "bottom center")


def pareto_figure(points: Sequence[dict], note: str = "") -> go.Figure:
    """Sweep result: acceptance against divergence, one line per method, the Pareto frontier dotted.

    Point labels alternate above and below in order of divergence, so two points at nearly the same
    place (ε = 0.3 and ε = 0.09 often are) never print their labels on top of each other."""
    if not points:
        return empty_chart("Acceptance vs divergence", note or "run a sweep: each finished point appears here")
    colours = {"cactus": "#2ca02c", "tas": "#ff7f0e", "sps": "#1f77b4"}
    order = sorted(range(len(points)), key=lambda i: (points[i]["divergence"], points[i]["mean_acceptance_length"]))
    side = {i: LABEL_SIDES[rank % 2] for rank, i in enumerate(order)}
    traces = []
    for method in dict.fromkeys(p["method"] for p in points):
        rows = sorted((i for i, p in enumerate(points) if p["method"] == method), key=lambda i: points[i]["divergence"])
        traces.append({"type": "scatter", "x": [points[i]["divergence"] for i in rows],
                       "y": [points[i]["mean_acceptance_length"] for i in rows], "mode": "lines+markers+text",
                       "name": method, "text": [points[i]["label"] for i in rows],
                       "textposition": [side[i] for i in rows], "textfont": {"size": 9},
                       "marker": {"color": colours.get(method), "size": 9}})
    frontier = pareto_front(points)
    traces.append({"type": "scatter", "x": [p["divergence"] for p in frontier],
                   "y": [p["mean_acceptance_length"] for p in frontier], "mode": "lines", "name": "Pareto frontier",
                   "line": {"dash": "dot", "color": "#333"}})
    title = "Mean acceptance length vs induced divergence" + (f"<br><sub>{note}</sub>" if note else "")
    return figure(traces, title, "exact KL(induced ‖ T) per tested position, nats (mean)",
                  "mean acceptance length", height=400, margin={"l": 50, "r": 20, "t": 60, "b": 40})

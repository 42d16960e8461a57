"""Text views of a run shared by the tabs: the status line, the API details, the token view, the legend."""

from __future__ import annotations

import gradio as gr

from playground.runner import ARReference
from playground.state import STATUS_COLOURS, STATUS_MEANING, RunState, summary


def legend() -> str:
    items = " · ".join(f"<span style='color:{STATUS_COLOURS[s]}'>■</span> <b>{s}</b>: {STATUS_MEANING[s]}"
                       for s in ("accepted", "recovered", "bonus", "generated"))
    return f"<div class='legend-note'>{items} · SSD: the cache chart colours each round green (cache hit) or red " \
           f"(miss: the backup drafted)</div>"


def status_line(run: RunState, reference: ARReference | None) -> str:
    """One line that agrees with the charts: state, tokens, tok/s and × AR against the session's reference."""
    if run.start is None and not run.error:
        return "Starting…" if run.config else "Ready."
    m, parts = _headline(run, reference, say_how=True)
    if m.get("mean_acceptance_length"):
        parts.append(f"mean acceptance length {m['mean_acceptance_length']:.2f}")
    if m.get("draft_acceptance_rate") is not None:
        parts.append(f"draft acceptance {m['draft_acceptance_rate']:.0%}")
    parts.extend(divergence_parts(run.method, m))
    if m.get("cache_hit_rate") is not None:
        parts.append(f"SSD cache hit rate {m['cache_hit_rate']:.0%}")
    if m.get("first_tokens_redrafted"):
        parts.append(f"each hit's first token redrafted from the target's real features, as SpS would draft it "
                     f"(cached one kept in {m['first_token_kept_rate']:.0%} of {m['first_tokens_redrafted']}; "
                     "a replaced one is served alone): a hit drafts as well as SpS but still costs that one draft step")
    if any(w.kind == "degraded" for w in run.worker_events):
        parts.append("⚠️ draft worker lost: finished synchronously")
    if run.start:
        parts.append(f"{run.start.backend} on {run.start.devices}")  # e.g. fast/bfloat16 on cpu (2 threads)
    return " · ".join(parts)


def progress_line(run: RunState, reference: ARReference | None) -> str:
    """The live feed's short line while tokens stream: the status line's state, tokens, tok/s and
    × AR (the status line gives the rest when the run pauses or ends)."""
    if run.start is None and not run.error:
        return "starting…"
    return " · ".join(_headline(run, reference, say_how=False)[1])


def _headline(run: RunState, reference: ARReference | None, *, say_how: bool) -> tuple[dict, list[str]]:
    """The run's summary and the first parts of its lines: state, tokens, tok/s and × AR (with how
    the reference was measured when `say_how`)."""
    m = summary(run)
    state = ("error: " + run.error if run.error and run.finish is None else
             f"finished ({run.finish.reason})" if run.finish else
             f"paused after round {len(run.rounds) - 1} (Step or Resume)" if run.paused else "generating…")
    if run.error and run.finish is not None:
        state = f"finished ({run.finish.reason}): {run.error}"
    tps = m.get("decode_tokens_per_s")  # live too: the rate × AR divides, never one with the prefill in it
    parts = [f"**{state}**", f"{m.get('new_tokens', 0)} tokens"]
    if not tps and run.finish is None:
        parts.append("– tok/s")  # until a round has verified: the line keeps its shape (a line that wraps anew moves the page)
    if tps:
        speed = f"{tps:.1f} tok/s"
        if reference and run.method != "ar":
            x_ar = f"{tps / reference.tokens_per_s:.2f}× AR"
            speed += f" (**{x_ar}**; reference {reference.how})" if say_how else f" ({x_ar})"
        parts.append(speed)
        if run.max_concurrent > 1:  # the engine thread interleaves runs round by round
            others = run.max_concurrent - 1
            parts.append(f"shared the engine with {others} other run{'s' if others > 1 else ''} at times: "
                         "this rate is its share, not the engine's speed")
    return m, parts


STREAMING_STATUS = ("**generating…** · tokens and speed stream below; this line gives the whole picture when "
                    "the run pauses or ends")


def divergence_parts(method: str, m: dict) -> list[str]:
    """The status line's divergence: the exact induced KL per tested position, and Cactus's constraint."""
    if not m.get("tested_positions"):
        return []
    parts = [f"KL(induced ‖ T) {m['mean_induced_kl']:.3f} nats per tested position, exact "
             f"(Σ {m['induced_kl_total']:.2f} over {m['tested_positions']})"]
    if method == "cactus":
        parts.append(f"constraint Σ KL(h ‖ T) {m.get('constraint_kl_total', 0.0):.2f} nats")
    return parts


def details(run: RunState, reference: ARReference | None) -> dict:
    """The API-facing result: token ids, finish reason, metrics, the × AR reference (what tests compare)."""
    return {"method": run.method, "token_ids": run.token_ids,
            "finish_reason": run.finish.reason if run.finish else None, "error": run.error or None,
            "config_changes": [{"round": c.round_index, "token": c.token_index, "changes": c.changes}
                               for c in run.changes],
            "ar_reference": {"tokens_per_s": reference.tokens_per_s, "how": reference.how} if reference else None,
            "metrics": summary(run)}


def token_view(label: str | None = None, **kwargs) -> gr.HighlightedText:
    return gr.HighlightedText(label=label, combine_adjacent=False, show_legend=True, show_inline_category=False,
                              color_map=dict(STATUS_COLOURS), elem_classes=["token-view"], **kwargs)

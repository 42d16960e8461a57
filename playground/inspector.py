"""Token inspector: what the rule saw at one position (pure functions of a `RunState`)."""

from __future__ import annotations

import plotly.graph_objects as go

from playground.charts import figure
from playground.state import STATUS_MEANING, RunState

BAR_CANDIDATES = 10


def _shown(text: str) -> str:
    return repr(text)[1:-1] or "∅"


def inspect_figure(state: RunState, index: int) -> go.Figure:
    """Grouped bars over the top candidates: draft, target, residual and (Cactus) h."""
    token = state.tokens[index]
    config = state.round_of(token.round_index).config if state.round_of(token.round_index) else state.config
    tested = token.draft_prob is not None
    candidates = sorted(token.candidates, key=lambda c: c.target_prob + c.draft_prob, reverse=True)[:BAR_CANDIDATES]
    if not candidates:
        return figure([], f"Token {index}", annotations=[{"text": "no candidates recorded for this token",
                                                          "showarrow": False, "x": 0.5, "y": 0.5,
                                                          "xref": "paper", "yref": "paper"}])
    labels = [f"{_shown(c.text)} ({c.token_id})" + (" ◀" if c.token_id == token.token_id else "") for c in candidates]
    series = [("target T", [c.target_prob for c in candidates], "#1f77b4")]
    if tested:
        series.insert(0, ("draft D", [c.draft_prob for c in candidates], "#17becf"))
        if config.get("method") == "cactus":
            series.append(("Cactus h", [c.h_prob for c in candidates], "#2ca02c"))
        series.append(("residual norm(max(h−D,0))", [c.residual_prob for c in candidates], "#ff7f0e"))
    traces = [{"type": "bar", "x": labels, "y": values, "name": name, "marker": {"color": colour}}
              for name, values, colour in series]
    return figure(traces, f"Token {index}: {_shown(token.text)} ({token.status}), round {token.round_index}, "
                          f"position {token.draft_position} (◀ = emitted token)", "", "probability",
                  barmode="group", height=320, margin={"l": 50, "r": 20, "t": 40, "b": 70},
                  legend={"orientation": "h", "y": -0.35})


def inspect_markdown(state: RunState, index: int) -> str:
    """The numbers behind the bars: acceptance probability, γ, the divergences at this position, entropy."""
    token = state.tokens[index]
    rnd = state.round_of(token.round_index)
    rows = [
        ("status", f"**{token.status}**: {STATUS_MEANING.get(token.status, '')}"),
        ("token", f"`{_shown(token.text)}` (id {token.token_id})"),
        ("round / position", f"{token.round_index} / {token.draft_position}"),
        ("target prob T(x)", f"{token.target_prob:.4f}"),
    ]
    if token.draft_prob is not None:
        rows.append(("draft prob D(x)", f"{token.draft_prob:.4f}"))
    if token.acceptance_prob is not None:
        tested = "the drafted token" if token.status == "accepted" else "the rejected draft"
        rows.append(("acceptance probability", f"{token.acceptance_prob:.4f} (of {tested})"))
    if token.gamma is not None:
        rows.append(("γ (Cactus raised T of the draft)", f"{token.gamma:.4f}"))
    if token.gamma is not None:
        rows.append(("Cactus's constraint KL(h‖T) here", f"{token.constraint_kl:.4f} nats (bounded by δ)"))
    if token.index in state.divergence:
        d = state.divergence[token.index]
        rows.append(("KL(induced‖T) here", f"{d.induced_kl:.4f} nats (exact: what the rule emits at this position)"))
        rows.append(("KL(D‖T) here", f"{d.draft_kl:.4f} nats (sampling the draft alone)"))
    rows.append(("target entropy H(T)", f"{token.target_entropy:.3f} nats"))
    if token.status == "recovered" and rnd is not None and rnd.rejected_text is not None:
        rows.append(("rejected draft", f"`{_shown(rnd.rejected_text)}` (id {rnd.rejected_token_id})"))
    if rnd is not None:
        rows.append(("rule / settings", f"{rnd.method}, K={rnd.num_speculative_tokens}, δ={rnd.config.get('delta')}, "
                                        f"T={rnd.config.get('temperature')}"))
    return "| | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)

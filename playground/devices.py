"""Where the models run: CPU by default; on a GPU Space the target on cuda:0 and the draft on cuda:1.

The placement is checked with a two-token generation per method before the app serves anyone; if
the engine cannot run that placement the pair goes back to CPU and the reason is shown in the UI,
rather than failing on the first user's request.
"""

from __future__ import annotations

import torch

from engine.config import SpecConfig
from engine.decoding import generate
from engine.models.registry import ModelPair


def place_pair(pair: ModelPair, spec: str = "auto") -> str:
    """Move the pair's models per `spec` ("cpu" or "auto"); return a one-line description."""
    gpus = torch.cuda.device_count() if spec == "auto" else 0
    if gpus == 0:
        return f"cpu ({torch.get_num_threads()} threads)"
    target, draft = "cuda:0", ("cuda:1" if gpus >= 2 and not _shares_weights(pair) else "cuda:0")
    pair.target_model.to(target)
    if pair.draft_model is not None:
        pair.draft_model.to(draft)
    try:
        ids = pair.encode_prompt("hi")
        for method in ("ar", "sps", "cactus"):
            drafter = None if method == "ar" else pair.make_drafter("model")
            list(generate(pair.make_target(), drafter, pair.tokenizer, ids,
                          SpecConfig(method=method, max_new_tokens=2, temperature=0.7), stop=None))
    except Exception as err:  # noqa: BLE001 - any failure means: serve from CPU and say why
        pair.target_model.to("cpu")
        if pair.draft_model is not None:
            pair.draft_model.to("cpu")
        return f"cpu (GPU placement target={target}, draft={draft} failed self-check: {type(err).__name__}: {err})"
    return f"target {target}, draft {draft}" + (" (two GPUs)" if target != draft else " (one GPU)")


def _shares_weights(pair: ModelPair) -> bool:
    """An early-exit draft is made of the target's own layers: it must stay on the target's device."""
    if pair.draft_model is None:
        return False
    target_ids = {id(p) for p in pair.target_model.parameters()}
    return any(id(p) in target_ids for p in pair.draft_model.parameters())

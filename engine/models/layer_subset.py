"""A draft made of a subset of the target's own layers (self-speculation / early exit).

It reuses the target's embedding, final norm and LM head and copies only the chosen decoder
layers, so it needs no extra weights on disk and shares the target's vocabulary by construction.
Untrained, it is a weak draft; it is the honest baseline the trained draft must beat.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from transformers import AutoModelForCausalLM, PreTrainedModel


def layer_subset_model(target: PreTrainedModel, layers: Sequence[int]) -> PreTrainedModel:
    n_layers = target.config.num_hidden_layers
    if not layers or any(not 0 <= i < n_layers for i in layers):
        raise ValueError(f"layer indices must be in [0, {n_layers}), got {list(layers)}")
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = len(layers)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in layers]
    draft = AutoModelForCausalLM.from_config(config, dtype=target.dtype)
    draft.model.embed_tokens = target.model.embed_tokens
    draft.lm_head = target.lm_head
    draft.model.norm.load_state_dict(target.model.norm.state_dict())
    for new_idx, old_idx in enumerate(layers):
        draft.model.layers[new_idx].load_state_dict(target.model.layers[old_idx].state_dict())
    return draft.eval()

"""Our draft with its reduced head, as a vLLM EAGLE model (`EagleSpecplayMistralForCausalLM`).

vLLM's `EagleMistralForCausalLM` already computes our feature draft exactly (see
specplay_vllm/export_draft.py); the one thing it lacks is our 16,384-token head V'. This subclass
adds it: the shared target head's logits outside V' become -inf, so the draft puts zero mass there,
as `engine.feature_drafter.FeatureDrafter` does (the same tokens, not a 16k matmul: vLLM computes
the full head and masks). The token set comes from the export's `vocab_ids` tensor.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.models.mistral_eagle import EagleMistralForCausalLM


class EagleSpecplayMistralForCausalLM(EagleMistralForCausalLM):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        size = int(self.config.specplay_head_size)
        self.vocab_ids = nn.Parameter(torch.zeros(size, dtype=torch.long), requires_grad=False)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden_states)
        if logits is None:
            return None
        masked = torch.full_like(logits, float("-inf"))
        masked[:, self.vocab_ids] = logits[:, self.vocab_ids]
        return masked

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        rest = []
        for name, tensor in weights:
            if name == "vocab_ids":
                self.vocab_ids.data.copy_(tensor.long())
            else:
                rest.append((name, tensor))
        return super().load_weights(rest) | {"vocab_ids"}

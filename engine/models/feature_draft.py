"""The feature-level draft (EAGLE, Li et al. 2024): a decoder layer that reads the target's features.

A small independent draft must learn the language from scratch; on this project's budget (a few
hundred thousand distillation tokens on two CPU cores) it cannot. EAGLE's observation is that
the target's final hidden state f_i already encodes what comes next, so a single decoder layer
that maps (embedding of t_{i+1}, f_i) to a prediction of f_{i+1} drafts far better for the same
cost. The target's frozen embedding and LM head are reused; only `fc` (2H → H), the layer and its
final norm are trained and shipped.

The draft head may be restricted to a frequent-token subset V' (a reduced-vocabulary head): the
draft then puts zero mass outside V', which costs a little acceptance but keeps SpS exact, and
makes the head -- the largest matmul by far for a 49k vocabulary -- several times cheaper.

Shapes: `features(tokens [B, T], prev [B, T, H]) -> [B, T, H]` where prev[:, j] = f_{j-1} and
tokens[:, j] = t_j; the output at j predicts f_j, whose LM-head distribution is p(t_{j+1} | t_≤j).
"""

from __future__ import annotations

import copy
import json
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaForCausalLM, PreTrainedModel
from transformers.initialization import no_init_weights

from engine.models.q4_1_blocks import round_to_q4_1


class FeatureDraft(nn.Module):
    def __init__(self, target: PreTrainedModel, vocab_ids: torch.Tensor, num_layers: int = 1,
                 init_from_layer: int | None = -1) -> None:
        super().__init__()
        cfg = copy.deepcopy(target.config)
        cfg.num_hidden_layers = num_layers
        cfg.tie_word_embeddings = False
        hidden = cfg.hidden_size
        with no_init_weights():  # every weight is shared, copied or loaded below: skip random init
            self.model = LlamaForCausalLM(cfg).eval()
        # The target's embedding and head are shared, frozen and never saved with the draft.
        self.model.model.embed_tokens.weight = target.model.embed_tokens.weight
        self.model.lm_head.weight = target.lm_head.weight
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        with torch.no_grad():
            if init_from_layer is not None:  # start from a target layer: a far better init than random
                for layer in self.model.model.layers:
                    layer.load_state_dict(target.model.layers[init_from_layer].state_dict())
                self.model.model.norm.weight.copy_(target.model.norm.weight)
            self.fc.weight.copy_(torch.cat([torch.eye(hidden), torch.eye(hidden)], dim=1))
        self.register_buffer("vocab_ids", vocab_ids.to(torch.long).sort().values, persistent=False)
        for p in (self.model.model.embed_tokens.weight, self.model.lm_head.weight):
            p.requires_grad_(False)
        self.q4_1_rounded = False  # set on `rounded_to_q4_1`'s copies: their head rows get rounded too

    @property
    def head_weight(self) -> torch.Tensor:
        return self.model.lm_head.weight

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """Only what the draft adds to the target: fc, the layers and the final norm."""
        return {k: v for k, v in self.state_dict().items()
                if not k.endswith(("embed_tokens.weight", "lm_head.weight"))}

    def features(self, tokens: torch.Tensor, prev_features: torch.Tensor) -> torch.Tensor:
        x = self.fc(torch.cat([self.model.model.embed_tokens(tokens), prev_features], dim=-1))
        return self.model.model(inputs_embeds=x).last_hidden_state

    def subset_logits(self, features: torch.Tensor) -> torch.Tensor:
        """Logits over V' only ([..., |V'|]), in `vocab_ids` order."""
        return F.linear(features, self.head_weight[self.vocab_ids])

    def save(self, path: Path, card: dict) -> None:
        """fp16 on disk (the fast backend decodes with fp16 weights anyway): small enough for the
        repository and for a Space without Git LFS."""
        state = {k: v.detach().half().contiguous() for k, v in self.trainable_state().items()}
        state["vocab_ids"] = self.vocab_ids.to(torch.int32).contiguous()
        meta = {"format": "specplay-feature-draft-v1", "num_layers": str(len(self.model.model.layers)),
                "card": json.dumps(card)}
        save_file(state, str(path), metadata=meta)


def load_feature_draft(path: Path, target: PreTrainedModel) -> FeatureDraft:
    """Rebuild a shipped draft around `target`'s frozen embedding and head."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if meta.get("format") != "specplay-feature-draft-v1":
        raise ValueError(f"{path} is not a feature draft (format {meta.get('format')!r})")
    state = {k: v.float() if v.is_floating_point() else v for k, v in load_file(str(path)).items()}
    vocab_ids = state.pop("vocab_ids")
    draft = FeatureDraft(target, vocab_ids, num_layers=int(meta["num_layers"]), init_from_layer=None)
    missing, unexpected = draft.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith(("embed_tokens.weight", "lm_head.weight"))]
    if missing or unexpected:
        raise ValueError(f"{path} does not match the draft's shape: missing {missing}, unexpected {unexpected}")
    return draft.eval()


_ROUNDED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def rounded_to_q4_1(draft: FeatureDraft) -> FeatureDraft:
    """A copy of `draft` whose fc and layer projections hold the nearest Q4_1 weights (a lossy
    rounding: a trained draft has no GGUF blocks), and whose drafter rounds its head rows the same
    way; the target's embedding and head stay shared, untouched. Built once per draft.

    Why: the q4_1_a16 kernels then run the whole draft step from 8.5 instead of 18.4 MB (fc and
    layer 8.4 MB in bfloat16, the reduced head's 10 MB of Q8_0 blocks). A draft needs no exactness,
    since every rule verifies a token against the D it was drawn from (SpS stays exact for any
    draft); the rounding costs acceptance, measured in assets/FAST_BACKEND.md (session 21)."""
    if draft not in _ROUNDED:
        shared = {id(p): p for p in (draft.model.model.embed_tokens.weight, draft.model.lm_head.weight)}
        twin = copy.deepcopy(draft, memo=shared)
        with torch.no_grad():
            for module in [twin.fc, *twin.model.model.layers.modules()]:
                if isinstance(module, nn.Linear):
                    module.weight.copy_(round_to_q4_1(module.weight))
        twin.q4_1_rounded = True
        _ROUNDED[draft] = twin
    return _ROUNDED[draft]


def draft_card(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return json.loads((f.metadata() or {}).get("card", "{}"))

"""The model interface the engine decodes with: append tokens to a KV cache, get logits, roll back.

Speculative decoding needs exactly three operations from a model: feed some tokens and read the
logits of the last few positions (one call verifies K+1 tokens), and cut the cache back to the
accepted length. Everything else (sampling, acceptance) lives outside the model.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch
from transformers import DynamicCache, PreTrainedModel

if TYPE_CHECKING:  # annotations only
    from engine.acceptance import NativeRule


class FeatureRows(Protocol):
    """Where a feature-level draft keeps the target's hidden states by position, as contiguous
    float32 rows [*, hidden]: a backend that computes them natively writes a verify's rows straight
    there (`CausalLM.feature_rows`), saving the tensor hand-over and copy after every round."""

    def rows_at(self, start: int, n: int) -> int:
        """The address of rows [start, start + n), the buffer grown first to hold them."""
        ...


class CausalLM(ABC):
    """A causal LM plus one sequence's KV cache. Cheap to create: weights are shared, state is not."""

    name: str
    backend: str
    vocab_size: int
    supports_tree = False  # whether forward_tree exists (SSD's batched branch decode)

    def __init__(self) -> None:
        self.length = 0  # tokens held in the KV cache
        self.forward_seconds = 0.0  # wall time spent inside model forwards (for overhead metrics)
        self.num_forwards = 0
        # Feature-level drafts read the target's final (post-norm) hidden states of every fed
        # token; backends that would pay extra to keep them do so only when asked.
        self.keep_hidden = False
        # [tokens fed in the last forward, hidden]; None after a forward with a rule that wrote them
        # into `feature_rows` (a feature draft's own buffer, set per generation, cleared by reset)
        # or that was not asked to keep them
        self.last_hidden: torch.Tensor | None = None
        self.feature_rows: FeatureRows | None = None

    def forward(self, tokens: Sequence[int], last_n: int = 1) -> torch.Tensor:
        """Append `tokens` to the cache; return float32 logits [last_n, V] of the last positions."""
        if not tokens:
            raise ValueError("forward needs at least one token")
        start = time.perf_counter()
        logits = self._forward(tokens, last_n)
        self.book_forward(len(tokens), start)
        return logits

    def forward_after(self, first: torch.Tensor, tokens: Sequence[int]) -> torch.Tensor:
        """Logits [1 + len(tokens), V]: `first`, a row kept from an earlier forward (the prefill's
        last, which is the first round's T_1), then `forward` of every fed position. A backend may
        write them into one buffer instead of concatenating (a torch op that may wake an OpenMP
        team right after a native forward)."""
        return torch.cat([first, self.forward(tokens, last_n=len(tokens))])

    def forward_with_rule(self, tokens: Sequence[int], rule: NativeRule) -> torch.Tensor | None:
        """`forward` of every fed position (logits [len(tokens), V]) with the round's prepared rule run
        on them in the same native call, where this backend has one; None where it has not (nothing
        ran: the caller forwards and runs the rule itself). The rule's own time is not the forward's.
        The logits are the rule's input: a backend may overwrite them in its next such call. With
        `feature_rows` set, a backend may write the fed positions' hidden states there (into rows at
        their positions) and leave `last_hidden` None: no tensor is handed over and copied; with
        `keep_hidden` off it may leave `last_hidden` None too."""
        return None

    def forward_embeds(self, embeds: torch.Tensor) -> torch.Tensor:
        """Append input vectors [n, hidden] (not token ids) to the cache; return the final-norm hidden
        states [n, hidden]. Feature-level drafts feed fc([embedding; target feature]) this way."""
        start = time.perf_counter()
        hidden = self._forward_embeds(embeds)
        self.book_forward(embeds.shape[0], start)
        return hidden

    def book_forward(self, tokens: int, start: float) -> None:
        """Count a forward that appended `tokens` to the cache and began at `time.perf_counter()` = start
        (also for a caller that ran the layers itself, as `cpu_kernels.FeatureStep` does)."""
        self.length += tokens
        self.forward_seconds += time.perf_counter() - start
        self.num_forwards += 1

    def _forward_embeds(self, embeds: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"the {self.backend} backend cannot take input vectors")

    def reserve(self, length: int) -> None:
        """Make room for `length` cached positions now, so that no forward of the coming generation
        stops to grow the cache. A backend whose cache grows cheaply (or not at all) ignores it."""

    def rollback(self, length: int) -> None:
        """Keep only the first `length` cached tokens (rejected drafts are dropped this way)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back a cache of {self.length} tokens to {length}")
        if length < self.length:
            self._crop(self.length - length)
            self.length = length

    def forward_tree(self, tokens: Sequence[int], positions: Sequence[int], slot: int,
                     visible: torch.Tensor) -> torch.Tensor:
        """Scratch forward for a token tree: logits [n, V] of every token, cache length unchanged.

        Token j has rotary position `positions[j]`, its K/V go to cache slot `slot + j`
        (slot >= length: past the committed tokens, so `rollback` by length stays valid), and it
        attends to the keys where `visible[j]` ([n, slot + n] bool) is True. SSD decodes all
        speculation-cache branches this way, one tree depth per call.
        """
        raise NotImplementedError(f"the {self.backend} backend has no tree forward")

    @property
    def backend_label(self) -> str:
        """What ran, for reports: the backend and, where it matters, the weight format."""
        return self.backend

    def reset(self) -> None:
        self._reset()
        self.length = 0
        self.feature_rows = None

    @abstractmethod
    def _forward(self, tokens: Sequence[int], last_n: int) -> torch.Tensor: ...

    @abstractmethod
    def _crop(self, tokens_to_remove: int) -> None: ...

    @abstractmethod
    def _reset(self) -> None: ...


class HFCausalLM(CausalLM):
    """Backend for any Hugging Face causal LM, using its `DynamicCache`."""

    backend = "transformers"

    def __init__(self, model: PreTrainedModel, name: str, vocab_size: int | None = None) -> None:
        super().__init__()
        self.model = model.eval()
        self.name = name
        # Tokenizer-sized vocabulary: some checkpoints pad the LM head past the tokenizer.
        self.vocab_size = vocab_size or model.config.vocab_size
        self.device = next(model.parameters()).device
        self.cache = DynamicCache(config=model.config)

    @torch.inference_mode()
    def _forward(self, tokens: Sequence[int], last_n: int) -> torch.Tensor:
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=last_n,
                         output_hidden_states=self.keep_hidden)
        if self.keep_hidden:
            self.last_hidden = out.hidden_states[-1][0].float()
        logits = out.logits[0, -last_n:, : self.vocab_size].float()
        self._finish()
        return logits

    def _finish(self) -> None:
        """On a GPU, wait for the forward's kernels: the caller times a forward from its return
        (verify_seconds, SSD's timeline), and without this it would time the launches alone and
        charge the GPU's work to whatever synchronises next (the rule, or the draft)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def _forward_embeds(self, embeds: torch.Tensor) -> torch.Tensor:
        out = self.model.model(inputs_embeds=embeds[None].to(self.device), cache=self.cache, use_cache=True)
        hidden = out.last_hidden_state[0].float()
        self._finish()
        return hidden

    def _crop(self, tokens_to_remove: int) -> None:
        self.cache.crop(-tokens_to_remove)

    def _reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)

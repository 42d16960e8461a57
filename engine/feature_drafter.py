"""Drafting with the feature-level draft (see engine/models/feature_draft.py for the model).

The recurrence (EAGLE): draft KV entry j holds the input x_j = fc([emb(t_j); f_{j-1}]), and the
layer's output f̂_j gives the draft distribution D(t_{j+1}) = softmax(head(f̂_j)). Target features
f arrive after every target forward (`observe_target`); positions the target has not seen yet
(the tokens being drafted, or an SSD branch) use the draft's own f̂ instead, exactly as in
training pass 2. Entries computed from a predicted feature are recomputed once the real one is
known, so the draft never drifts from the target's view of the committed text.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence

import torch

from engine.drafters import Drafter, Proposal, ProposalShape, branch_proposals, uniform_floats
from engine.growing_rows import GrowingRows
from engine.models import cpu_kernels
from engine.models.causal_lm import CausalLM, FeatureRows
from engine.models.fast_llama import PackedLinear, onto_huge_pages
from engine.models.feature_draft import FeatureDraft
from engine.models.q4_1_blocks import round_to_q4_1
from engine.sampling import (SamplingParams, dense_probs, logits_to_probs, native_draw_settings, sample_from,
                             sample_sparse, sparse_probs)
from engine.support_rows import SupportBlocks


_PACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _packed(draft: FeatureDraft, dtype: str, head_dtype: str, full_head: bool,
            vocab_size: int) -> tuple[PackedLinear, PackedLinear]:
    """The draft's fc and head in the fast backend's formats, built once per draft and formats: packing
    them (q4_1's exact-block search) took 250 ms, paid by every playground run that made a drafter.
    A draft `rounded_to_q4_1` has its head rows rounded to Q4_1 weights too."""
    per_draft = _PACKED.setdefault(draft, {})
    key = (dtype, head_dtype, full_head, vocab_size)
    if key not in per_draft:
        head = draft.head_weight[:vocab_size]
        with torch.no_grad():
            rows = head if full_head else head[draft.vocab_ids]
            per_draft[key] = (PackedLinear(draft.fc.weight, dtype),
                              PackedLinear(round_to_q4_1(rows) if draft.q4_1_rounded else rows, head_dtype))
            onto_huge_pages(per_draft[key])
    return per_draft[key]


def _joined(rows: list[torch.Tensor]) -> torch.Tensor:
    """One tensor of the per-token rows; a single row as it is (each torch op costs ~10 us with the
    caches cold after the target's forward, and K = 1 drafts one row a round)."""
    return rows[0] if len(rows) == 1 else torch.cat(rows)


class FeatureDrafter(Drafter):
    kind = "feature"
    needs_target_features = True

    def __init__(self, draft: FeatureDraft, lm: CausalLM, name: str, vocab_size: int,
                 full_head: bool = False, head_dtype: str | None = None) -> None:
        """`head_dtype`: the head's weight format (the target's tied embedding: by default the draft
        layer's format, `lm.weight_dtype`); fc always takes the layer's."""
        self.lm = lm  # the draft's decoder layer(s) with their own KV cache, fed through forward_embeds
        self.name = name
        self.vocab_size = vocab_size
        dtype = getattr(lm, "weight_dtype", "float32")
        self.head_ids = None if full_head else draft.vocab_ids
        self.embed = draft.model.model.embed_tokens.weight.detach()
        self.fc, self.head = _packed(draft, dtype, head_dtype or dtype, full_head, vocab_size)
        # Real target features f_0..f_{F-1} in the first F rows; f̂ of draft KV entry i in row i of `_drafted`.
        self._features = GrowingRows(self.embed.shape[1])
        self._num_features = 0
        self._entries: list[int] = []  # t_j of each draft KV entry j-1 (entry i is position i+1)
        self._drafted = GrowingRows(self.embed.shape[1])
        self._real_entries = 0  # leading entries computed from real target features
        self._extra_seconds = 0.0  # fc and head time one call at a time (the layer's, and a native step's, are lm's)
        # A step (feed, then draw from the last f̂) as one native call where the layers run on the native
        # decoder and the head is a reduced one (`_propose_native`); its draws' supports go into blocks.
        decoder = getattr(getattr(lm, "w", None), "native_decoder", None)
        self._step = (cpu_kernels.FeatureStep(self.embed, self.fc, self.head, self.head_ids, decoder)
                      if decoder is not None and self.head_ids is not None and self.fc.native and self.head.native
                      and hasattr(lm, "native_slots") else None)
        self._supports = SupportBlocks()

    def start(self) -> None:
        self.lm.reset()
        self._num_features = 0
        self._entries, self._real_entries = [], 0

    @property
    def forward_seconds(self) -> float:
        """The whole draft model: fc, the decoder layer(s) and the head (not just the layer)."""
        return self.lm.forward_seconds + self._extra_seconds

    def observe_target(self, start: int, hidden: torch.Tensor) -> None:
        self._check_start(start)
        end = start + hidden.shape[0]
        self._features.hold(end, self._num_features)
        self._features.rows[start:end] = hidden.detach()
        self._num_features = end

    def target_feature_rows(self) -> FeatureRows:
        return self

    def rows_at(self, start: int, n: int) -> int:
        """`causal_lm.FeatureRows`: the target's forward writes rows [start, start + n) here itself.
        A verify writes every fed position; `observe_target_rows` then keeps the committed ones."""
        self._check_start(start)
        self._features.hold(start + n, self._num_features)
        return self._features.address(start)

    def observe_target_rows(self, start: int, n: int) -> None:
        self._check_start(start)
        self._num_features = start + n

    def _check_start(self, start: int) -> None:
        if start > self._num_features:
            raise ValueError(f"target features jump from position {self._num_features} to {start}")

    def _last_output(self) -> torch.Tensor:
        """f̂ of the last draft KV entry [1, hidden]."""
        n = len(self._entries)
        return self._drafted.rows[n - 1:n]

    def propose(self, context: Sequence[int], k: int, params: SamplingParams, uniforms: Sequence[float]) -> Proposal:
        # No inference_mode here (~10 us a round with the caches cold): the native step makes no autograd
        # op, and the torch steps (`_feed`, `_draw`) enter it themselves.
        if len(context) < 2:
            raise ValueError("the feature draft needs at least two context tokens")
        feed = self._sync_all_but_last(context)
        draws = uniform_floats(uniforms, k)
        if not draws:
            return Proposal([], torch.empty(0, self.vocab_size))
        native = (native_draw_settings(params, self._step.layout.head_rows)
                  if self._step is not None and feed is not None else None)
        if native is not None:
            return self._propose_native(feed, draws, *native)
        tokens, ids, rows = [], [], []
        for u in draws:
            if feed is not None:
                self._feed(*self._feed_tensors(feed))
            drawn, token_ids, probs = self._draw(self._last_output(), params, [u])
            tokens += drawn
            ids.append(token_ids)
            rows.append(probs)
            feed = (drawn, self._known_feature())
        if ids[0] is None:
            return Proposal(tokens, _joined(rows))
        return Proposal(tokens, support=(_joined(ids), _joined(rows)), vocab_size=self.vocab_size)

    @torch.inference_mode()
    def score(self, context: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        """Draft logits after `context + tokens[:i]`, i = 0..len(tokens) (SSD's glue decode)."""
        self._sync(list(context) + list(tokens))
        m = len(context) - 1
        return self._logits(self._drafted.rows[m - 1:m + len(tokens)])

    @torch.inference_mode()
    def propose_branches(self, context: Sequence[int], speculation: Sequence[int], forks: Sequence[tuple[int, int]],
                         k: int, params: SamplingParams, uniforms: torch.Tensor,
                         shape: ProposalShape | None = None, stop: Callable[[], bool] | None = None) -> list[Proposal]:
        """Every fork's branch in one tree forward per depth (see `ModelDrafter.propose_branches`).

        A fork (d, y) puts token y at position p = len(context) + d; its input feature is the
        target's f_{p-1} where the target has already computed it (a just-in-time draft after a
        verification, exactly what `propose` feeds), else the draft's own f̂ of position p - 1
        (an SSD cache branch: the target is verifying that position right now), and each later
        branch token feeds the f̂ its branch just produced -- the drafting recurrence, per branch.
        Where the synchronous step is native and the draw's support small, each depth is one native
        call (`cpu_kernels.FeatureStep.tree`, the same bits as the torch path below).
        """
        if not hasattr(self.lm, "forward_tree_embeds") or not forks:
            return super().propose_branches(context, speculation, forks, k, params, uniforms, shape, stop)
        if k < 1:
            raise ValueError(f"each branch needs k >= 1 drafted tokens, got {k}")
        glue = list(context) + list(speculation)
        self._sync(glue)
        n, base = len(forks), len(self._entries)  # entry i holds position i + 1
        depth = torch.tensor([d for d, _ in forks])
        if depth.min() < 0 or depth.max() > len(speculation):
            raise ValueError(f"fork depths must be in [0, {len(speculation)}]")
        positions = len(context) + depth  # sequence position of each branch's first token
        feature = torch.cat([self._features.rows[p - 1:p] if p - 1 < self._num_features
                             else self._drafted.rows[p - 2:p - 1] for p in positions.tolist()])
        feed = torch.tensor([int(y) for _, y in forks])
        visible = torch.arange(base)[None, :] < (positions - 1)[:, None]  # entries of positions < p
        own = torch.zeros(n, 0, dtype=torch.bool)
        eye = torch.eye(n, dtype=torch.bool)
        tokens, ids, rows = [], [], []
        native = (native_draw_settings(params, self._step.layout.head_rows)
                  if shape is None and self._step is not None else None)
        for i in range(k):
            if stop is not None and stop():
                break
            own = torch.cat([own, eye], dim=1)
            at, slot, mask = (positions - 1 + i).tolist(), base + i * n, torch.cat([visible, own], dim=1)
            if native is not None:  # fc, the layer, the head and every branch's draw in one native call
                start = time.perf_counter()
                cache, rope, additive = self.lm.native_tree_slots(at, slot, mask)
                feed, support, probs, feature = self._step.tree(feed, feature.contiguous(), cache, rope, slot, additive,
                                                                *native, uniforms[:, i])
                self.lm.book_forward(0, start)  # tree entries sit past the cache's length: none appended
                ids.append(support)
            else:
                feature = self.lm.forward_tree_embeds(self._input(feed, feature), at, slot, mask)
                if shape is None:  # as `propose` draws: sparse rows where the support is small
                    drawn, support, probs = self._draw(feature, params, uniforms[:, i].tolist())
                    feed = torch.tensor(drawn)
                    ids.append(support)
                else:
                    probs = shape(logits_to_probs(self._logits(feature), params), i)
                    feed = sample_from(probs, uniforms[:, i])
            tokens.append(feed)
            rows.append(probs)
        sparse = bool(ids) and ids[0] is not None
        return branch_proposals(tokens, rows, ids if sparse else None, self.vocab_size)

    def _sync(self, context: Sequence[int]) -> torch.Tensor:
        """Bring the draft KV to entries for positions 1..len(context)-1; return f̂ of the last one [1, hidden]."""
        feed = self._sync_all_but_last(context)
        if feed is not None:
            self._feed(*self._feed_tensors(feed))
        return self._last_output()

    def _sync_all_but_last(self, context: Sequence[int]) -> tuple[Sequence[int], int | None] | None:
        """`_sync` but for its last feed, returned for the caller to run with its draw as (tokens, the
        first of their input features' rows in the target's feature rows, or None: f̂ of the last entry);
        None when the cache already holds every entry."""
        m = len(context) - 1
        known = self._num_features
        # Leading entries whose token matches and whose input feature was a real one; usually all of
        # them up to the limit, which one list comparison checks before any element-wise search.
        limit = min(len(self._entries), m - 1, self._real_entries, known)
        keep = limit if self._entries[:limit] == list(context[1:limit + 1]) else 0
        while keep < limit and self._entries[keep] == context[keep + 1]:
            keep += 1
        self.lm.rollback(keep)
        del self._entries[keep:]
        real_end = min(m, known)
        feed = None
        if real_end > keep:  # one batched forward over every entry with a real input feature
            feed = (context[keep + 1:real_end + 1], keep)
        self._real_entries = max(keep, real_end)
        for j in range(self._real_entries + 1, m + 1):  # beyond the target's features: the draft's own f̂
            if feed is not None:
                self._feed(*self._feed_tensors(feed))
            if not self._entries:
                raise ValueError("the feature draft needs the target's features of the context (observe_target)")
            feed = ([context[j]], None)
        return feed

    def _feed_tensors(self, feed: tuple[Sequence[int], int | None]) -> tuple[Sequence[int], torch.Tensor]:
        """A feed as `_sync_all_but_last` gives it, with its input features as a tensor [n, hidden]."""
        tokens, first = feed
        return tokens, self._last_output() if first is None else self._features.rows[first:first + len(tokens)]

    def _propose_native(self, feed: tuple[Sequence[int], int | None], draws: list[float], width: int,
                        temperature: float, top_p: float) -> Proposal:
        """Each draft step (the feed, then a draw from the last f̂) as one native call
        (`cpu_kernels.FeatureStep`, the same bits as `_feed` then `_draw`), the draws' supports written
        into consecutive rows of a block: a round makes no torch call for them."""
        rows = self._supports.take(len(draws), width)
        tokens = []
        for i, uniform in enumerate(draws):
            fed, first = feed
            at = len(self._entries)  # the fed entries' f̂ go into rows [at, at + len(fed))
            self._drafted.hold(at + len(fed), at)
            features = self._drafted.address(at - 1) if first is None else self._features.address(first)
            start = time.perf_counter()
            token = self._step(fed, features, self.lm.native_slots(len(fed)), self._drafted.address(at), width,
                               temperature, top_p, uniform, *rows.addresses(i))
            self.lm.book_forward(len(fed), start)
            self._entries.extend(fed)  # ints: context slices or the token just drawn
            tokens.append(token)
            feed = ([token], self._known_feature())
        return Proposal(tokens, rows=rows, vocab_size=self.vocab_size)

    def _known_feature(self) -> int | None:
        """The input feature of the next entry (the token just drawn): the target's own f of the entry
        before it where the target has computed that (the first draw after a prefill, which ran the
        prompt's last token), else None, the f̂ of the entry it was drawn from."""
        before = len(self._entries)  # entry i holds position i + 1: the next one reads f at row `before`
        return before if before < self._num_features else None

    @torch.inference_mode()
    def _feed(self, tokens: Sequence[int], features: torch.Tensor) -> torch.Tensor:
        """Append draft KV entries for `tokens` with input features [n, hidden]; f̂ of the last [1, hidden].
        Each entry's f̂ goes into its row of `_drafted`."""
        x = self._input(torch.tensor(list(tokens)), features)
        out = self.lm.forward_embeds(x)
        at = len(self._entries)
        self._drafted.hold(at + out.shape[0], at)
        self._drafted.rows[at:at + out.shape[0]] = out
        self._entries.extend(int(t) for t in tokens)
        return self._last_output()

    def _input(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """x_j = fc([emb(t_j); f_{j-1}])."""
        start = time.perf_counter()
        x = self.fc(torch.cat([self.embed[tokens], features], dim=-1))
        self._extra_seconds += time.perf_counter() - start
        return x

    def _sample(self, features: torch.Tensor, params: SamplingParams,
                uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw one token per row: (tokens [n], full-vocabulary probabilities [n, V])."""
        tokens, ids, probs = self._draw(features, params, uniforms.tolist())
        return torch.tensor(tokens), probs if ids is None else dense_probs(ids, probs, self.vocab_size)

    @torch.inference_mode()
    def _draw(self, features: torch.Tensor, params: SamplingParams,
              uniforms: list[float]) -> tuple[list[int], torch.Tensor | None, torch.Tensor]:
        """Draw one token per row of features [n, hidden] with its uniform: (tokens, ids [n, w],
        probs [n, w]) when the distributions have a small support (a reduced head under top-k or
        greedy), else (tokens, None, probs [n, V]).

        With a reduced head the sampling runs over the tokens V' keeps (top-k of them, usually): outside
        V' the logits are -inf, so temperature, top-k and top-p select the same tokens, and drawing over
        them in vocabulary order (`sample_sparse`) picks the same one as the full-vocabulary draw (zeros
        add nothing to the CDF) at a fraction of the work.
        """
        if self.head_ids is None:
            probs = logits_to_probs(self._logits(features), params)
            return sample_from(probs, torch.tensor(uniforms)).tolist(), None, probs
        start = time.perf_counter()
        logits = self.head(features)
        self._extra_seconds += time.perf_counter() - start
        rows = [logits] if logits.shape[0] == 1 else logits  # sample_sparse takes [V'] or [1, V']
        draws = [sample_sparse(row, params, u, self.head_ids) for row, u in zip(rows, uniforms)]
        if draws[0] is None:  # no top-k: any token of V' may be drawn
            kept = sparse_probs(logits, params)[1]
            probs = torch.zeros(kept.shape[0], self.vocab_size).index_copy_(1, self.head_ids, kept)
            return sample_from(probs, torch.tensor(uniforms)).tolist(), None, probs
        if len(draws) == 1:
            return [draws[0][0]], draws[0][1], draws[0][2]
        return [d[0] for d in draws], torch.cat([d[1] for d in draws]), torch.cat([d[2] for d in draws])

    def _logits(self, features: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits [n, V]; a reduced head leaves -inf (zero probability) outside V'."""
        start = time.perf_counter()
        logits = self.head(features)
        if self.head_ids is not None:
            full = torch.full((features.shape[0], self.vocab_size), float("-inf"))
            full[:, self.head_ids] = logits
            logits = full
        self._extra_seconds += time.perf_counter() - start
        return logits

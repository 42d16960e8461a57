"""TAS and Cactus as vLLM V1's `rejection_sample` (vllm/v1/sample/rejection_sampler.py).

vLLM hands the function the flattened drafts of a batch: `draft_token_ids` [N], `num_draft_tokens`
per request, `draft_probs` [N, V] (only with `draft_sample_method="probabilistic"`; None means the
drafts are one-hot, as in vLLM), `target_logits` [N, V] already processed (temperature, top-k,
top-p; greedy rows unscaled) and the bonus tokens [B, 1] its sampler drew from T_{K+1}. It returns
[B, max_spec_len + 1] token ids, -1 in unused slots.

The decision itself is `engine.acceptance.verify_on_support`, the engine's own rule (ALGORITHMS.md
§1–3), on rows grouped by draft length and by each request's rule settings. vLLM's bonus token
enters as T_{K+1} = one-hot(bonus), so the rule's bonus draw returns exactly the token vLLM sampled
from T_{K+1}. Greedy rows (T = 0) use one-hot target and draft rows: every rule then accepts exactly
the argmax matches and recovers the argmax, which is vLLM's greedy verification. A step whose
requests all use `sps` never reaches this module (the plugin keeps vLLM's own kernel for it); in a
mixed step, SpS rows use the engine's SpS.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from engine.acceptance import RandomDraws, verify_on_support
from specplay_vllm.settings import RuleSettings

PLACEHOLDER_TOKEN_ID = -1


def _draws(rows: list[int], k: int, generators: dict[int, torch.Generator]) -> RandomDraws:
    """u_accept [b, k] and u_sample [b], from each request's own generator when it has a seed."""
    u_accept, u_sample = [], []
    for r in rows:
        g = generators.get(r)
        u = torch.rand(k + 1, generator=g, dtype=torch.float64).float()
        u_accept.append(u[:k])
        u_sample.append(u[k])
    return RandomDraws(u_accept=torch.stack(u_accept), u_sample=torch.stack(u_sample))


def rule_rejection_sample(settings: Sequence[RuleSettings], draft_token_ids: torch.Tensor, num_draft_tokens: list[int],
                          max_spec_len: int, draft_probs: torch.Tensor | None, target_logits: torch.Tensor,
                          bonus_token_ids: torch.Tensor, is_greedy: torch.Tensor | None,
                          generators: dict[int, torch.Generator]) -> torch.Tensor:
    """vLLM's `rejection_sample` contract, request r decided by `settings[r]`; `is_greedy` [B] or None (none greedy)."""
    batch = len(num_draft_tokens)
    vocab = target_logits.shape[-1]
    out = torch.full((batch, max_spec_len + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int32,
                     device=target_logits.device)
    starts = [0]
    for n in num_draft_tokens:
        starts.append(starts[-1] + n)
    bonus = bonus_token_ids.view(-1).long()
    greedy = torch.zeros(batch, dtype=torch.bool) if is_greedy is None else is_greedy.cpu().bool()
    drafts = draft_token_ids.long()
    # Target rows: the processed distribution, or one-hot argmax on greedy rows.
    token_greedy = torch.repeat_interleave(greedy, torch.tensor(num_draft_tokens, dtype=torch.long))
    target_probs = target_logits.float().softmax(dim=-1)
    if token_greedy.any():
        onehot = F.one_hot(target_logits.argmax(dim=-1), vocab).float()
        target_probs = torch.where(token_greedy[:, None], onehot, target_probs)
    drafted = F.one_hot(drafts, vocab).float()
    draft_rows = drafted if draft_probs is None else torch.where(token_greedy[:, None], drafted, draft_probs.float())

    groups: dict[tuple[int, RuleSettings], list[int]] = {}
    for r, n in enumerate(num_draft_tokens):
        groups.setdefault((n, settings[r]), []).append(r)
    for (k, rule), rows in groups.items():
        if k == 0:
            out[rows, 0] = bonus[rows].to(torch.int32)
            continue
        index = torch.tensor([starts[r] + j for r in rows for j in range(k)])
        b = len(rows)
        t = torch.cat([target_probs[index].view(b, k, vocab),
                       F.one_hot(bonus[rows], vocab).float().unsqueeze(1)], dim=1)
        d = draft_rows[index].view(b, k, vocab)
        x = drafts[index].view(b, k)
        support = torch.nonzero(t.flatten(0, 1).amax(dim=0) > 0).squeeze(-1)
        result = verify_on_support(rule.rule, t, d, x, support, delta=rule.delta,
                                   posterior_threshold=rule.posterior_threshold,
                                   posterior_alpha=rule.posterior_alpha, draws=_draws(rows, k, generators))
        positions = torch.arange(k + 1)
        accepted = result.num_accepted[:, None]
        tokens = torch.where(positions[None, :k] < accepted, x, PLACEHOLDER_TOKEN_ID)
        row_out = torch.cat([tokens, torch.full((b, 1), PLACEHOLDER_TOKEN_ID, dtype=torch.long)], dim=1)
        row_out[torch.arange(b), result.num_accepted] = result.next_tokens
        out[rows, :k + 1] = row_out.to(torch.int32)
    return out

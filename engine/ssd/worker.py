"""The draft worker: a separate process on its own device that serves speculations and fills the cache.

Protocol (one `multiprocessing` Pipe, "spawn" start method: forking after torch started its thread
pools can deadlock). Only tokens and small arrays cross it, never KV caches:

    main -> worker   StartRequest      new generation: prompts, seed
    main -> worker   RoundRequest      per sequence: committed tokens, the outcome (k, y), target features
    worker -> main   RoundReply        per sequence: the speculation (cache hit or backup) and its D'
    worker -> main   BuildReport       after filling the caches: keys, fan-outs, busy intervals
    main -> worker   None              exit

The worker replies first and fills the caches afterwards, so the fill overlaps the target's
verification of the speculation it just served (the whole point of SSD). The fill is sized to the
time between its reply and the next request, measured online (`fill_budget`), and it stops as
soon as the next request is waiting: a round never waits for the cache, only for a backup.

A feature draft (EAGLE-style) drafts the cache's branches before the target has computed the
feature of the token they fork from (the verification running at that moment computes it), so a
cached first token is drawn from D~, the draft fed its own predicted feature, while a synchronous
draft draws from D, fed the real one. On a hit the worker therefore redrafts the first token from
the real features it has just received and couples the two draws (the speculative-sampling
coupling, draft against draft): keep the cached x~ with probability min(1, D(x~)/D~(x~)), else draw
from norm(max(D - D~, 0)) and serve that one token. The served first token is then an exact draw
from D, as good as a synchronous draft's, at the cost of one draft step instead of K; the later
cached tokens are kept only with the first (they were drawn given it) and carry their own D~.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import numpy as np
import torch

from engine.drafters import Drafter, Proposal
from engine.models.registry import DEFAULT_FAST_WEIGHTS
from engine.sampling import SamplingParams
from engine.ssd.backups import fast_backup, ngram_backup
from engine.ssd.devices import DeviceSpec, pin
from engine.ssd.fill_budget import MARGIN, FillPlan, FillSizer, min_fill_depth
from engine.ssd.saguaro import saguaro_shape
from engine.ssd.speculation_cache import Key, SpeculationCache, couple_first_token, fork_keys
from engine.uniform_stream import UniformStream


# Both ends of the pipe busy-wait this long for the other's next message before blocking: a process
# blocked on the pipe sleeps on an idle (halted) core, and its wake-up on this VM took most of the
# 0.86 ms a round's two messages cost; polling cut it to 0.33 ms (K = 1, default pair, AMD EPYC Zen
# 4). Each end waits on a core that has nothing else to do meanwhile: the worker on the draft's
# device between its fill and the next request, the target's thread while its draft is served.
WORKER_SPIN_SECONDS = 0.05  # longer than a verification (the worker waits out whole ones at K = 1)
REPLY_SPIN_SECONDS = 0.01  # longer than most serves (a hit's one draft step, a miss's K)


def spin_poll(conn: Connection, seconds: float) -> bool:
    """Whether a message is waiting on `conn`, busy-polling for up to `seconds` (see above)."""
    until = time.perf_counter() + seconds
    while not conn.poll():
        if time.perf_counter() > until:
            return False
    return True


@dataclass(frozen=True)
class DrafterSpec:
    """A picklable description the worker rebuilds its drafter from (weights never cross the pipe)."""

    pair: str = "tiny"
    kind: str = "model"
    backend: str = "auto"
    weight_dtype: str = DEFAULT_FAST_WEIGHTS


@dataclass(frozen=True)
class WorkerInfo:
    drafter: str
    backend: str
    device: str
    needs_target_features: bool


@dataclass(frozen=True)
class StartRequest:
    prompts: list[list[int]]
    seed: int
    generation: int  # stamped on every reply, so a reply left over from an abandoned generation is ignored


@dataclass(frozen=True)
class SeqRequest:
    commit: list[int]  # tokens committed since the previous request (the prompt on the first one)
    outcome: Key | None  # (k, y) of the last verification; None on the first round
    hidden_start: int = 0
    hidden: np.ndarray | None = None  # float32 [n, H] target features of committed tokens
    uniform_at: int = 0  # where the draft's draws start in the sequence's stream (seed + i)
    reserved: int = 0  # how many of them the main process leaves to the draft (the rest it cuts)


@dataclass(frozen=True)
class RoundRequest:
    k: int
    params: SamplingParams
    fanouts: tuple[int, ...]
    downweight_c: float
    backup: str  # neural | fast | ngram (adaptive is resolved by the main process)
    vocab_size: int
    items: list[SeqRequest | None]  # None: the sequence finished
    sent_at: float = 0.0  # perf_counter when the main process sent it (one clock for both processes)
    fill_to_verify: bool = True  # size the fill to the measured window (False: the released engine's full fill)
    # Rounds were drafted in the target process since the previous request: the time since the last
    # reply spans them, so it is no measure of one round's window (the estimate keeps its value).
    after_local: bool = False


@dataclass(frozen=True)
class SparseRows:
    """Probability rows [n, V] as their nonzero entries: after top-k / top-p a draft row keeps a few
    dozen tokens, so this crosses the pipe instead of n x 49k floats."""

    ids: np.ndarray  # int32 [n, m], padded with id 0 and probability 0
    values: np.ndarray  # float32 [n, m]
    vocab_size: int

    @staticmethod
    def of(proposal: Proposal) -> "SparseRows":
        """A proposal's rows: its own sparse support as it is (a synchronous or backup draft: no
        [V] row is built or searched on the round's critical path), else the nonzeros of its dense
        rows, largest first (so padding, id 0 with probability 0, comes after every real entry)."""
        if proposal.support is not None:
            ids, values = proposal.support
            return SparseRows(ids.int().cpu().numpy(), values.float().cpu().numpy(), proposal.vocab_size)
        probs = proposal.probs.float()
        width = max(int((probs > 0).sum(-1).max()), 1) if probs.numel() else 1
        values, ids = torch.topk(probs, min(width, probs.shape[-1]), dim=-1)
        return SparseRows(ids.int().cpu().numpy(), values.cpu().numpy(), probs.shape[-1])  # a CUDA draft's rows too

    def proposal(self, tokens: list[int]) -> Proposal:
        """The tokens with these rows as a sparse Proposal (the acceptance rule reads that form directly)."""
        return Proposal(tokens, support=(torch.from_numpy(self.ids).long(), torch.from_numpy(self.values)),
                        vocab_size=self.vocab_size)


@dataclass(frozen=True)
class SeqReply:
    tokens: list[int]
    probs: SparseRows | None  # D' [n, V] the tokens were drawn from; None = point masses
    source: str  # cache | neural | fast | ngram
    cache_keys: tuple[Key, ...]  # the cache the lookup searched
    cache_fanouts: tuple[int, ...]  # the fan-out that cache was actually filled with (sum: the budget used)
    cache_depth: int = 0  # tokens per branch that cache reached (below K when the fill was cut)
    first_kept: bool | None = None  # feature-draft hit: whether the cached first token survived the redraft


@dataclass(frozen=True)
class RoundReply:
    generation: int
    items: list[SeqReply | None]
    serve: tuple[float, float]  # perf_counter interval spent serving (lookups and backups)


@dataclass(frozen=True)
class BuildReport:
    generation: int
    interval: tuple[float, float]  # perf_counter interval of the cache fill (glue + tree decode)
    branches: int
    budget_requested: int = 0  # Σ F_k the round asked for, over the batch
    depth: int = 0  # tokens per branch reached (the smallest over the batch)
    cut: bool = False  # the fill stopped early: the next request was due
    window: float | None = None  # the worker's running estimate of the time it has per round
    note: str = ""  # why there was no fill (FillPlan.note)


@dataclass
class _Sequence:
    drafter: Drafter
    generator: torch.Generator  # the fill's, the coupling's and the fast backup's draws
    uniforms: UniformStream  # the main process's stream for this sequence: the just-in-time draft's draws
    context: list[int] = field(default_factory=list)
    speculation: list[int] = field(default_factory=list)
    reserved: int = 0
    cache: SpeculationCache | None = None


def _build_drafter(spec: DrafterSpec, device: DeviceSpec) -> Drafter:
    from engine.models.registry import load_pair  # heavy: only inside the worker process

    pair = load_pair(spec.pair)
    if device.kind == "cuda":
        from engine.drafters import ModelDrafter
        from engine.models.causal_lm import HFCausalLM

        model = pair.draft_model if spec.kind == "model" else pair.target_model
        if spec.kind not in ("model", "self"):
            raise ValueError(f"a CUDA draft worker needs a neural drafter ('model' or 'self'), got {spec.kind!r}")
        if model is None:  # the default pair's draft is a feature draft: fast CPU backend only
            raise ValueError(f"pair {pair.name!r} has no draft model to put on {device} (its draft is "
                             f"{pair.draft_description}, which runs on CPU cores): use draft=cpu:N, or the 'self' drafter")
        return ModelDrafter(HFCausalLM(model.to(device.torch_device), f"{pair.name}/draft", pair.vocab_size),
                            pair.draft_description)
    return pair.make_drafter(spec.kind, spec.backend, spec.weight_dtype)


def worker_main(spec: DrafterSpec, device: DeviceSpec, conn: Connection) -> None:
    """Process entry point: pin, load, announce, then serve requests until told to exit."""
    try:
        pin(device)
        first = _build_drafter(spec, device)
        lm = getattr(first, "lm", None)
        conn.send(WorkerInfo(first.name, lm.backend_label if lm is not None else spec.kind, device.describe(),
                             first.needs_target_features))
        _serve(spec, device, first, conn)
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        return
    except Exception:  # report, so the main process degrades with the cause instead of a timeout
        conn.send(RuntimeError(traceback.format_exc()))


def _serve(spec: DrafterSpec, device: DeviceSpec, first: Drafter, conn: Connection) -> None:
    from engine.ssd import wire  # it packs this module's messages (imported here: no import cycle)

    drafters = [first]
    seqs: list[_Sequence] = []
    generation = -1
    sizer = FillSizer()  # per worker: the draft device's costs outlive a generation
    replied: float | None = None
    served = 0  # tokens the last reply served: the target verifies them plus one before the next request
    while True:
        spin_poll(conn, WORKER_SPIN_SECONDS)
        msg = wire.loads(conn.recv_bytes())
        if msg is None:
            return
        if isinstance(msg, StartRequest):
            while len(drafters) < len(msg.prompts):
                drafters.append(_build_drafter(spec, device))
            seqs, generation, replied = [], msg.generation, None
            for i, _ in enumerate(msg.prompts):
                drafters[i].start()
                # A just-in-time draft draws from the sequence's own stream where SpS's draft would
                # (SeqRequest.uniform_at), so SSD without a hit writes SpS's text; what only SSD draws
                # (fill, coupling) comes from a generator of its own.
                seqs.append(_Sequence(drafters[i], torch.Generator().manual_seed(msg.seed + 7919 * (i + 1)),
                                      UniformStream(msg.seed + i)))
            continue
        if replied is not None and msg.sent_at > replied and not msg.after_local:
            sizer.observe_window(msg.sent_at - replied, served)
        start = time.perf_counter()
        replies = [None if item is None else _serve_one(seq, item, msg, sizer) for seq, item in zip(seqs, msg.items)]
        conn.send_bytes(wire.pack_reply(RoundReply(generation, replies, (start, time.perf_counter()))))
        replied = start = time.perf_counter()
        served = sum(len(reply.tokens) for reply in replies if reply is not None)
        active = [seq for seq, item in zip(seqs, msg.items) if item is not None]
        if msg.fill_to_verify:
            plan = sizer.plan(msg.fanouts, len(active), min_fill_depth(first.needs_target_features), served)
            deadline = replied + MARGIN * (sizer.window_for(served) or float("inf"))
            stop = _stop(conn, sizer, deadline)
        else:
            plan, stop = FillPlan(tuple(msg.fanouts), msg.k), _never
        built = [_fill(seq, msg, plan, sizer, stop) for seq in active]
        depth = min((d for _, d, _ in built), default=0)
        conn.send(BuildReport(generation, (start, time.perf_counter()), sum(b for b, _, _ in built),
                              sum(msg.fanouts) * len(active), depth, any(c for _, _, c in built), sizer.window,
                              plan.note))


class _StepClock:
    """The tree pass's `stop`, called before every step: the time between two calls is one step."""

    def __init__(self, stop: Callable[[int], bool], sizer: FillSizer, branches: int) -> None:
        self.stop, self.sizer, self.branches = stop, sizer, branches
        self.calls, self.last = 0, time.perf_counter()

    def __call__(self) -> bool:
        now = time.perf_counter()
        if self.calls:
            self.sizer.observe_step(self.branches, now - self.last)
        self.calls, self.last = self.calls + 1, now
        return self.stop(self.branches)


def _stop(conn: Connection, sizer: FillSizer, deadline: float) -> Callable[[int], bool]:
    """The fill's `stop`: the next request is waiting, or the next step would end after it is due."""
    def stop(branches: int) -> bool:
        if conn.poll():
            return True
        step = sizer.step_seconds(branches)
        return step is not None and time.perf_counter() + step > deadline
    return stop


def _never(branches: int) -> bool:
    """The unsized fill (the released engine's): every branch to depth K, however long it takes."""
    return False


def _serve_one(seq: _Sequence, item: SeqRequest, msg: RoundRequest, sizer: FillSizer) -> SeqReply:
    """Cache lookup for the verified outcome (first token redrafted for a feature draft); a backup on a miss."""
    if item.hidden is not None:
        seq.drafter.observe_target(item.hidden_start, torch.from_numpy(item.hidden).float())
    seq.context.extend(item.commit)
    seq.uniforms.skip_to(item.uniform_at)
    seq.reserved = item.reserved
    cache = seq.cache
    hit = cache.lookup(item.outcome, msg.k) if cache is not None and item.outcome is not None else None
    kept = None
    if hit is not None and hit.tokens:
        if seq.drafter.needs_target_features:
            hit, kept = _redraft_first(seq, hit, msg, sizer)
        tokens, served, source = hit.tokens, hit, "cache"
    else:
        tokens, served = _backup(seq, msg, sizer)
        source = msg.backup
    seq.speculation = list(tokens)
    point_mass = served is None or msg.params.greedy
    return SeqReply(list(tokens), None if point_mass else SparseRows.of(served), source,
                    cache.keys() if cache else (), cache.fanouts if cache else (), cache.depth if cache else 0, kept)


def _redraft_first(seq: _Sequence, hit: Proposal, msg: RoundRequest, sizer: FillSizer) -> tuple[Proposal, bool]:
    """Redraw a feature draft's cached first token from the real features (module docstring).
    Sparse rows (the synchronous draft's form under top-k) stay sparse: a dense [V] row per step
    was a fifth of a hit's serve time."""
    fresh = _just_in_time(seq, msg, 1, sizer)
    token, kept = couple_first_token(_first_row(fresh), _first_row(hit), hit.tokens[0],
                                     torch.rand(2, generator=seq.generator))
    tokens = hit.tokens if kept else [token]
    if fresh.support is not None and hit.support is not None and fresh.support[0].shape[-1] == hit.support[0].shape[-1]:
        (f_ids, f_probs), (h_ids, h_probs) = fresh.support, hit.support
        n = len(tokens)
        return Proposal(tokens, support=(torch.cat([f_ids, h_ids[1:n]]), torch.cat([f_probs, h_probs[1:n]])),
                        vocab_size=hit.vocab_size), kept
    return Proposal(tokens, torch.cat([fresh.probs[:1], hit.probs[1:len(tokens)]])), kept


def _first_row(p: Proposal) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Row 0 of a proposal in the form it holds: sparse (ids, probs), else dense."""
    return (p.support[0][0], p.support[1][0]) if p.support is not None else p.probs[0]


def _just_in_time(seq: _Sequence, msg: RoundRequest, k: int, sizer: FillSizer) -> Proposal:
    """A draft from the true prefix: the one-branch tree forking at the last committed token.

    Its steps are one-branch tree steps, so they also keep the sizer's step cost current when no
    fill fits (a fill that never runs would never be measured again)."""
    shared = seq.uniforms.take(min(k, seq.reserved))  # SpS's draft draws; beyond them, tokens the main cuts
    if len(shared) < k:
        shared = torch.cat([shared, torch.rand(k - len(shared), generator=seq.generator)])
    uniforms = shared[None]
    shape = saguaro_shape(msg.fanouts, msg.downweight_c)
    if shape is None:  # the drafter's own synchronous path (a reduced head samples sparsely: cheaper)
        start = time.perf_counter()
        jit = seq.drafter.propose(seq.context, k, msg.params, uniforms[0])
        for _ in range(k):
            sizer.observe_step(1, (time.perf_counter() - start) / k)
        return jit
    clock = _StepClock(_never, sizer, 1)
    jit = seq.drafter.propose_branches(seq.context[:-1], [], [(0, seq.context[-1])], k, msg.params, uniforms,
                                       shape, clock)[0]
    clock()
    return jit


def _backup(seq: _Sequence, msg: RoundRequest, sizer: FillSizer) -> tuple[list[int], Proposal | None]:
    """Tokens after a miss, with the draft that holds their D' (None: point masses)."""
    if msg.backup == "neural":
        jit = _just_in_time(seq, msg, msg.k, sizer)
        return jit.tokens, jit
    if msg.backup == "fast":
        return fast_backup(msg.k, msg.vocab_size, seq.generator), None
    if msg.backup == "ngram":
        return ngram_backup(seq.context, msg.k), None
    raise ValueError(f"unknown backup {msg.backup!r}")


def _fill(seq: _Sequence, msg: RoundRequest, plan: FillPlan, sizer: FillSizer,
          stop: Callable[[int], bool]) -> tuple[int, int, bool]:
    """Glue decode, fork, tree decode (§4.6), sized by `plan` and ended by `stop`: (branches, depth, cut)."""
    seq.cache = None
    if plan.depth == 0:
        return 0, 0, False
    if stop(1):
        return 0, 0, True
    start = time.perf_counter()
    logits = seq.drafter.score(seq.context, seq.speculation)
    sizer.observe_glue(time.perf_counter() - start)
    keys = fork_keys(logits, seq.speculation, plan.fanouts)
    if not keys:
        return 0, 0, False
    uniforms = torch.rand(len(keys), plan.depth, generator=seq.generator)
    clock = _StepClock(stop, sizer, len(keys))
    proposals = seq.drafter.propose_branches(seq.context, seq.speculation, keys, plan.depth, msg.params, uniforms,
                                             saguaro_shape(plan.fanouts, msg.downweight_c), clock)
    if proposals and len(proposals[0].tokens) == clock.calls:  # the last step ran: time it too
        clock()
    seq.cache = SpeculationCache(dict(zip(keys, proposals)), tuple(plan.fanouts)) if proposals else None
    depth = len(proposals[0].tokens) if proposals else 0
    return len(proposals), depth, depth < plan.depth or len(proposals) < len(keys)

"""The draft worker: a separate process on its own device that serves speculations and fills the cache.

Protocol (one `multiprocessing` Pipe, "spawn" start method: forking after torch started its thread
pools can deadlock). Only tokens and small arrays cross it, never KV caches:

    main -> worker   StartRequest      new generation: prompts, seed
    main -> worker   RoundRequest      per sequence: committed tokens, the outcome (k, y), target features
    worker -> main   RoundReply        per sequence: the speculation (cache hit or backup) and its D'
    worker -> main   BuildReport       after filling the caches: keys, fan-outs, busy intervals
    main -> worker   None              exit

The worker replies first and fills the caches afterwards, so the fill overlaps the target's
verification of the speculation it just served (the whole point of SSD).
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import numpy as np
import torch

from engine.drafters import Drafter
from engine.models.registry import DEFAULT_FAST_WEIGHTS
from engine.sampling import SamplingParams
from engine.ssd.backups import fast_backup, ngram_backup
from engine.ssd.devices import DeviceSpec, pin
from engine.ssd.saguaro import saguaro_shape
from engine.ssd.speculation_cache import Key, SpeculationCache, fork_keys


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
    hidden: np.ndarray | None = None  # float16 [n, H] target features of committed tokens


@dataclass(frozen=True)
class RoundRequest:
    k: int
    params: SamplingParams
    fanouts: tuple[int, ...]
    downweight_c: float
    backup: str  # neural | fast | ngram (adaptive is resolved by the main process)
    vocab_size: int
    items: list[SeqRequest | None]  # None: the sequence finished


@dataclass(frozen=True)
class SeqReply:
    tokens: list[int]
    probs: np.ndarray | None  # float32 [n, V] D' the tokens were drawn from; None = point masses
    source: str  # cache | neural | fast | ngram
    cache_keys: tuple[Key, ...]  # the cache the lookup searched
    cache_fanouts: tuple[int, ...]


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


@dataclass
class _Sequence:
    drafter: Drafter
    generator: torch.Generator
    context: list[int] = field(default_factory=list)
    speculation: list[int] = field(default_factory=list)
    cache: SpeculationCache | None = None


def _build_drafter(spec: DrafterSpec, device: DeviceSpec) -> Drafter:
    from engine.models.registry import load_pair  # heavy: only inside the worker process

    pair = load_pair(spec.pair)
    if device.kind == "cuda":
        from engine.drafters import ModelDrafter
        from engine.models.causal_lm import HFCausalLM

        model = pair.draft_model if spec.kind == "model" else pair.target_model
        if spec.kind not in ("model", "self") or model is None:
            raise ValueError(f"a CUDA draft worker needs a neural drafter, got {spec.kind!r}")
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
    drafters = [first]
    seqs: list[_Sequence] = []
    generation = -1
    while True:
        msg = conn.recv()
        if msg is None:
            return
        if isinstance(msg, StartRequest):
            while len(drafters) < len(msg.prompts):
                drafters.append(_build_drafter(spec, device))
            seqs, generation = [], msg.generation
            for i, _ in enumerate(msg.prompts):
                drafters[i].start()
                seqs.append(_Sequence(drafters[i], torch.Generator().manual_seed(msg.seed + 7919 * i)))
            continue
        start = time.perf_counter()
        replies = [None if item is None else _serve_one(seq, item, msg) for seq, item in zip(seqs, msg.items)]
        conn.send(RoundReply(generation, replies, (start, time.perf_counter())))
        start = time.perf_counter()
        branches = sum(_fill(seq, msg) for seq, item in zip(seqs, msg.items) if item is not None)
        conn.send(BuildReport(generation, (start, time.perf_counter()), branches))


def _serve_one(seq: _Sequence, item: SeqRequest, msg: RoundRequest) -> SeqReply:
    """Cache lookup for the verified outcome; a backup speculation on a miss."""
    if item.hidden is not None:
        seq.drafter.observe_target(item.hidden_start, torch.from_numpy(item.hidden).float())
    seq.context.extend(item.commit)
    cache = seq.cache
    hit = cache.lookup(item.outcome, msg.k) if cache is not None and item.outcome is not None else None
    if hit is not None:
        tokens, probs, source = hit.tokens, hit.probs, "cache"
    else:
        tokens, probs = _backup(seq, msg)
        source = msg.backup
    seq.speculation = list(tokens)
    point_mass = probs is None or msg.params.greedy
    return SeqReply(list(tokens), None if point_mass else probs.float().numpy(), source,
                    cache.keys() if cache else (), cache.fanouts if cache else ())


def _backup(seq: _Sequence, msg: RoundRequest) -> tuple[list[int], torch.Tensor | None]:
    """Tokens and their D' (None: point masses) after a miss."""
    if msg.backup == "neural":
        # A just-in-time draft is the one-branch tree forking at the last committed token.
        uniforms = torch.rand(1, msg.k, generator=seq.generator)
        jit = seq.drafter.propose_branches(seq.context[:-1], [], [(0, seq.context[-1])], msg.k, msg.params,
                                           uniforms, saguaro_shape(msg.fanouts, msg.downweight_c))[0]
        return jit.tokens, jit.probs
    if msg.backup == "fast":
        return fast_backup(msg.k, msg.vocab_size, seq.generator), None
    if msg.backup == "ngram":
        return ngram_backup(seq.context, msg.k), None
    raise ValueError(f"unknown backup {msg.backup!r}")


def _fill(seq: _Sequence, msg: RoundRequest) -> int:
    """Glue decode, fork, tree decode (§4.6): the next speculation for every cached outcome."""
    logits = seq.drafter.score(seq.context, seq.speculation)
    keys = fork_keys(logits, seq.speculation, msg.fanouts)
    uniforms = torch.rand(len(keys), msg.k, generator=seq.generator)
    shape = saguaro_shape(msg.fanouts, msg.downweight_c)
    proposals = seq.drafter.propose_branches(seq.context, seq.speculation, keys, msg.k, msg.params, uniforms, shape)
    seq.cache = SpeculationCache(dict(zip(keys, proposals)), tuple(msg.fanouts))
    return len(keys)

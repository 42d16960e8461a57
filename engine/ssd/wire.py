"""The two per-round messages of the draft worker's pipe, packed as flat bytes instead of pickled.

Why: they sit on SSD's critical path, the request between the target's verification and the
worker's serve, the reply between the serve and the next verification. Right after a target
forward has streamed the weights through the caches, pickling a `RoundRequest` (nested dataclasses,
the sampling settings, a numpy array) and writing it took 92-96 us; the same content packed with
`struct` and numpy took 18-20 us (AMD EPYC Zen 5, `ForkingPickler` against `send_bytes`). Every
other message (start, build report, exit) stays pickled: `loads` tells them apart by the first
byte, which a pickle (protocol >= 2) never starts with 'Q' or 'P'.

The round's settings (K, sampling, fan-outs, C, backup, vocabulary, fill policy) change only when a
user moves a knob, so they travel as one pickled blob that the packer keeps while they stay equal.
"""

from __future__ import annotations

import pickle
import struct
from multiprocessing.reduction import ForkingPickler

import numpy as np

from engine.ssd.worker import RoundReply, RoundRequest, SeqReply, SeqRequest, SparseRows

_REQUEST, _REPLY = b"Q", b"P"
_REQUEST_HEAD = struct.Struct("<dqqq")  # sent_at, after_local, items, settings bytes
_SEQ_REQUEST = struct.Struct("<10q")  # present, commit, has outcome, k, y, hidden start, rows, cols, uniform_at, reserved
_REPLY_HEAD = struct.Struct("<qqdd")  # generation, items, serve start, serve end
_SEQ_REPLY = struct.Struct("<11q")  # present, tokens, has rows, rows, width, vocab, source bytes, keys, fanouts, depth, kept
_KEPT = {None: -1, False: 0, True: 1}


class RequestPacker:
    """Packs `RoundRequest`s, keeping the pickled settings while they stay the same."""

    def __init__(self) -> None:
        self._settings: tuple | None = None
        self._blob = b""

    def pack(self, req: RoundRequest) -> bytes:
        settings = (req.k, req.params, tuple(req.fanouts), req.downweight_c, req.backup, req.vocab_size,
                    req.fill_to_verify)
        if settings != self._settings:
            self._settings, self._blob = settings, pickle.dumps(settings)
        parts = [_REQUEST, _REQUEST_HEAD.pack(req.sent_at, req.after_local, len(req.items), len(self._blob)),
                 self._blob]
        for item in req.items:
            parts += _seq_request(item)
        return b"".join(parts)


def _seq_request(item: SeqRequest | None) -> list[bytes]:
    if item is None:
        return [_SEQ_REQUEST.pack(0, 0, 0, 0, 0, 0, 0, 0, 0, 0)]
    k, y = item.outcome if item.outcome is not None else (0, 0)
    rows, cols = item.hidden.shape if item.hidden is not None else (0, 0)
    head = _SEQ_REQUEST.pack(1, len(item.commit), item.outcome is not None, k, y, item.hidden_start, rows, cols,
                             item.uniform_at, item.reserved)
    hidden = np.ascontiguousarray(item.hidden, dtype=np.float32).tobytes() if rows else b""
    return [head, np.asarray(item.commit, dtype=np.int64).tobytes(), hidden]


def pack_reply(reply: RoundReply) -> bytes:
    parts = [_REPLY, _REPLY_HEAD.pack(reply.generation, len(reply.items), *reply.serve)]
    for item in reply.items:
        parts += _seq_reply(item)
    return b"".join(parts)


def _seq_reply(item: SeqReply | None) -> list[bytes]:
    if item is None:
        return [_SEQ_REPLY.pack(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, -1)]
    rows, width, vocab = (*item.probs.ids.shape, item.probs.vocab_size) if item.probs is not None else (0, 0, 0)
    source = item.source.encode()
    head = _SEQ_REPLY.pack(1, len(item.tokens), item.probs is not None, rows, width, vocab, len(source),
                           len(item.cache_keys), len(item.cache_fanouts), item.cache_depth, _KEPT[item.first_kept])
    parts = [head, np.asarray(item.tokens, dtype=np.int64).tobytes()]
    if item.probs is not None:
        parts += [np.ascontiguousarray(item.probs.ids, dtype=np.int32).tobytes(),
                  np.ascontiguousarray(item.probs.values, dtype=np.float32).tobytes()]
    keys = np.asarray(item.cache_keys, dtype=np.int64).reshape(-1)
    return parts + [source, keys.tobytes(), np.asarray(item.cache_fanouts, dtype=np.int64).tobytes()]


class _Reader:
    """Sequential reads from one message's bytes."""

    def __init__(self, data: bytes) -> None:
        self.data, self.at = memoryview(data), 1  # past the tag

    def unpack(self, layout: struct.Struct) -> tuple:
        values = layout.unpack_from(self.data, self.at)
        self.at += layout.size
        return values

    def take(self, n: int) -> bytes:
        chunk = self.data[self.at:self.at + n]
        self.at += n
        return bytes(chunk)

    def array(self, dtype: type, count: int) -> np.ndarray:
        out = np.frombuffer(self.data, dtype=dtype, count=count, offset=self.at).copy()
        self.at += out.nbytes
        return out


def _unpack_request(r: _Reader) -> RoundRequest:
    sent_at, after_local, n, blob = r.unpack(_REQUEST_HEAD)
    k, params, fanouts, downweight_c, backup, vocab_size, fill_to_verify = pickle.loads(r.take(blob))
    items: list[SeqRequest | None] = []
    for _ in range(n):
        present, commit, has_outcome, ok, oy, hidden_start, rows, cols, uniform_at, reserved = r.unpack(_SEQ_REQUEST)
        if not present:
            items.append(None)
            continue
        tokens = r.array(np.int64, commit).tolist()
        hidden = r.array(np.float32, rows * cols).reshape(rows, cols) if rows else None
        items.append(SeqRequest(tokens, (ok, oy) if has_outcome else None, hidden_start, hidden, uniform_at, reserved))
    return RoundRequest(k, params, fanouts, downweight_c, backup, vocab_size, items, sent_at, fill_to_verify,
                        bool(after_local))


def _unpack_reply(r: _Reader) -> RoundReply:
    generation, n, start, end = r.unpack(_REPLY_HEAD)
    items: list[SeqReply | None] = []
    for _ in range(n):
        present, tokens, has_rows, rows, width, vocab, source, keys, fanouts, depth, kept = r.unpack(_SEQ_REPLY)
        if not present:
            items.append(None)
            continue
        token_ids = r.array(np.int64, tokens).tolist()
        probs = None
        if has_rows:
            ids = r.array(np.int32, rows * width).reshape(rows, width)
            probs = SparseRows(ids, r.array(np.float32, rows * width).reshape(rows, width), vocab)
        source_text = r.take(source).decode()
        key_pairs = tuple(map(tuple, r.array(np.int64, 2 * keys).reshape(keys, 2).tolist()))
        items.append(SeqReply(token_ids, probs, source_text, key_pairs, tuple(r.array(np.int64, fanouts).tolist()),
                              depth, None if kept < 0 else bool(kept)))
    return RoundReply(generation, items, (start, end))


def loads(data: bytes) -> object:
    """One message off the pipe: a packed request or reply, else a pickled message."""
    tag = data[:1]
    if tag == _REQUEST:
        return _unpack_request(_Reader(data))
    if tag == _REPLY:
        return _unpack_reply(_Reader(data))
    return ForkingPickler.loads(data)

"""The worker pipe's packed messages (engine/ssd/wire.py) read back as the dataclasses they came from."""

from __future__ import annotations

from multiprocessing.reduction import ForkingPickler

import numpy as np

from engine.sampling import SamplingParams
from engine.ssd import wire
from engine.ssd.worker import BuildReport, RoundReply, RoundRequest, SeqReply, SeqRequest, SparseRows


def _same(a: object, b: object) -> bool:
    """Dataclass / container equality that compares numpy arrays by value, dtype and shape."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if hasattr(a, "__dataclass_fields__"):
        return type(a) is type(b) and all(_same(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def test_a_round_request_reads_back_whole_and_its_settings_are_pickled_once_while_unchanged():
    hidden = np.arange(2 * 5, dtype=np.float32).reshape(2, 5) / 7
    items = [SeqRequest([5, 6, 7], (2, 41234), 10, hidden, 33, 2), None, SeqRequest([9], None, 0, None, 0, 0)]
    request = RoundRequest(3, SamplingParams(0.6, 20, 0.95), (4, 3, 2, 1), 0.5, "neural", 49152, items, 12.5,
                           True, True)
    packer = wire.RequestPacker()
    first = packer.pack(request)
    assert _same(wire.loads(first), request)
    blob = packer._blob
    again = RoundRequest(3, SamplingParams(0.6, 20, 0.95), (4, 3, 2, 1), 0.5, "neural", 49152, items[:1], 13.0)
    assert _same(wire.loads(packer.pack(again)), again) and packer._blob is blob
    changed = RoundRequest(2, SamplingParams(0.0), (1, 1, 1), 0.0, "fast", 100, [None], 14.0)
    assert _same(wire.loads(packer.pack(changed)), changed) and packer._blob is not blob


def test_a_round_reply_reads_back_whole():
    rows = SparseRows(np.array([[3, 9, 0], [7, 1, 2]], dtype=np.int32), np.array([[.5, .5, 0], [.2, .3, .5]],
                      dtype=np.float32), 49152)
    items = [SeqReply([3, 1], rows, "cache", ((0, 3), (1, 8), (2, 11)), (3, 2, 1), 2, True), None,
             SeqReply([4], None, "ngram", (), (), 0, None), SeqReply([5], None, "neural", ((0, 1),), (1,), 1, False)]
    reply = RoundReply(7, items, (1.25, 1.5))
    assert _same(wire.loads(wire.pack_reply(reply)), reply)


def test_other_messages_stay_pickled():
    report = BuildReport(3, (1.0, 2.0), 12, 16, 2, True, 0.004, "note")
    assert _same(wire.loads(bytes(ForkingPickler.dumps(report))), report)
    assert wire.loads(bytes(ForkingPickler.dumps(None))) is None

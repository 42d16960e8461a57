"""Incremental detokenisation: turn a growing token list into text pieces, one per token.

Byte-level BPE can split a character across tokens, so decoding a token alone may give a
replacement character. We decode a short window and emit only text that is complete (the
prefix/read-offset scheme of vLLM and TGI); a token whose bytes are incomplete gets "".

Pieces are decoded on demand: the decoding loop only appends ids (`extend`), and a token event
decodes its piece when a consumer reads its text (`piece`), in order, so a run nobody reads the
text of (the benchmark) never pays two tokenizer calls per token.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from transformers import PreTrainedTokenizerBase


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._pieces: list[str] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self._lock = threading.Lock()  # the UI may read pieces from another thread than the loop's

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def extend(self, token_ids: Iterable[int]) -> None:
        """Append generated ids; their pieces are decoded when first asked for."""
        self.ids.extend(token_ids)

    def piece(self, index: int) -> str:
        """The text piece of token `index` (decoding every earlier piece not decoded yet)."""
        with self._lock:
            while len(self._pieces) <= index:
                self._pieces.append(self._next_piece())
            return self._pieces[index]

    def push(self, token_id: int) -> str:
        """Append one id and return its piece at once."""
        self.ids.append(token_id)
        return self.piece(len(self.ids) - 1)

    def _next_piece(self) -> str:
        end = len(self._pieces) + 1
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.ids[self.prefix_offset:end])
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, end
            return text[len(prefix):]
        return ""

    def text(self) -> str:
        return self._decode(self.ids)

"""Incremental detokenization: a request's text grows with each token at a cost that does not grow with its length.

Decoding every output token again at each step costs O(n) per token (O(n^2) per request) and, at batch 20, a few
milliseconds of every step. Instead each sequence keeps two offsets into its output tokens (the scheme of vLLM's
incremental detokenizer, written here over plain ``decode``)::

    output ids:  t0 t1 ... t[prefix] ... t[read] ... t[n-1]
                           '-- context --'-- new ---'

``decode(ids[prefix:read])`` is text already emitted; ``decode(ids[prefix:])`` minus it is the new text. The
context tokens are decoded again because a token's text can depend on its left neighbour (SentencePiece drops the
space of a leading "▁"; byte-level BPE splits a character's UTF-8 bytes over tokens). A window whose text ends in
U+FFFD, an unfinished character, emits nothing until the next token completes it.

Invariant: ``text == decode(output ids)`` once a sequence finishes -- ``finish`` sets it from one full decode, so
a window that ever disagreed cannot survive into the result (tests compare the two on the bundled tokenizer).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """The text of one sequence's output tokens, extended token by token."""

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self.text = ""
        self._prefix = 0  # first context token of the window
        self._read = 0  # tokens before this are in ``text``

    def append(self, ids: Sequence[int]) -> str:
        """``ids`` = all output tokens so far (this call's new ones at the end); returns the text they added."""
        prefix_text = self._decode(ids[self._prefix : self._read]) if self._read > self._prefix else ""
        window = self._decode(ids[self._prefix :])
        if len(window) <= len(prefix_text) or window.endswith(REPLACEMENT):
            return ""  # nothing printable yet (a special token, or a character still missing bytes)
        delta = window[len(prefix_text) :]
        self.text += delta
        self._prefix, self._read = self._read, len(ids)
        return delta

    def finish(self, ids: Sequence[int]) -> str:
        """The final text: one decode of every token (what the increments add up to on every tested input)."""
        self.text = self._decode(ids)
        return self.text

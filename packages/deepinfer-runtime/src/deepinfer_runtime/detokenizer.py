"""Incremental (streaming) detokenization and stop-string search.

Uses the prefix-offset / read-offset technique: each step decodes a small window of ids twice (up to the read offset
and up to the end) and emits the difference, holding text back while the window decodes to an incomplete UTF-8
sequence (a trailing U+FFFD). Because text is only emitted at points where the byte-level decoder is at a character
boundary, the concatenation of all chunks plus `finish()` equals `tokenizer.decode(all_output_ids)`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 5  # prompt ids used as the initial decode window


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


def find_stop(text: str, stops: Iterable[str], already_checked: int) -> int | None:
    """Index in `text` where the first stop string starts, or None.

    `already_checked` is how many leading characters of `text` were searched before (without a match); only the new
    tail plus `max(len(stop)) - 1` characters of overlap are searched again. The caller cuts `text[:index]`, which
    excludes the stop string.
    """
    stops = [s for s in stops if s]
    if not stops:
        return None
    start = max(0, min(already_checked, len(text)) - (max(len(s) for s in stops) - 1))
    best: int | None = None
    for stop in stops:
        idx = text.find(stop, start)
        if idx != -1 and (best is None or idx < best):
            best = idx
    return best


class IncrementalDetokenizer:
    """Turns a stream of output token ids into stable text chunks."""

    find_stop = staticmethod(find_stop)

    def __init__(self, tokenizer: _Decoder, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_ids[-_PROMPT_CONTEXT:]) if prompt_ids else []
        # Only use the prompt tail as context when it decodes cleanly; otherwise an incomplete UTF-8 sequence at the
        # end of the prompt would merge with the first output bytes.
        if context and tokenizer.decode(context, skip_special_tokens=skip_special_tokens).endswith(_REPLACEMENT):
            context = []
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._chunks: list[str] = []
        self.output_ids: list[int] = []

    @property
    def text(self) -> str:
        """All output text emitted so far."""
        return "".join(self._chunks)

    def push(self, new_ids: Iterable[int]) -> str:
        """Add output ids; return the newly stable text (possibly empty)."""
        new_ids = list(new_ids)
        if not new_ids:
            return ""
        self._ids.extend(new_ids)
        self.output_ids.extend(new_ids)
        return self._advance(final=False)

    def finish(self) -> str:
        """Emit whatever is held back (an incomplete UTF-8 tail decodes to U+FFFD), e.g. when generation stops."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read_offset >= len(self._ids):
            return ""
        skip = self.skip_special_tokens
        prefix_text = self.tokenizer.decode(
            self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=skip
        )
        full_text = self.tokenizer.decode(self._ids[self._prefix_offset :], skip_special_tokens=skip)
        if not final and full_text.endswith(_REPLACEMENT):
            return ""  # incomplete multi-byte character: wait for more bytes
        if not full_text.startswith(prefix_text):  # defensive; cannot happen at a clean boundary
            delta = self.tokenizer.decode(self.output_ids, skip_special_tokens=skip)[len(self.text) :]
        else:
            delta = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        # Drop ids no decode window will read again.
        if self._prefix_offset > 4096:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        if delta:
            self._chunks.append(delta)
        return delta

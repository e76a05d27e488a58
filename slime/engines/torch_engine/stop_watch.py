"""Stop strings, watched a token at a time at a cost that does not grow with the output.

Decoding a sequence's whole output at every token to look for its stop strings costs the square
of its length (8.4 ms per decode step at batch 256 and 512 tokens, on the host). A StopWatch
decodes each new token with the few before it instead: the text from the last complete
character on, whose difference from the same text without the new token is what the token added
(the incremental detokenization of SGLang's detokenizer and vLLM; tokens that end inside a
character add nothing until it completes). It keeps the last characters of the output and says
whether a stop string may have just ended there; the caller confirms a hit in the whole text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

INCOMPLETE = "\ufffd"
"""What a decoder gives for bytes that do not (yet) form a character."""

MAX_CHARACTER_TOKENS = 4
"""The most tokens one character takes (UTF-8's 4 bytes, each a token in a byte-level
vocabulary): text still incomplete after that many is invalid bytes, shown as they decode."""


class StopWatch:
    """Whether one of `stops` may have ended at the latest token of one sequence's output.

    Args:
        decode: token ids -> text, as the whole output is decoded (special tokens skipped or not).
        stops: the stop strings (at least one, none empty).
        clean_up: when the tokenizer's decode also cleans up spaces (" ." -> "."), that cleanup:
            the tail is checked with and without it, since it joins text across tokens.
    """

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        stops: Sequence[str],
        clean_up: Callable[[str], str] | None = None,
    ):
        self._decode = decode
        self._stops = tuple(stops)
        self._clean_up = clean_up
        # A stop string that ends in the new text starts at most its length before; the cleanup
        # may remove one space per character of it, and the tail's first character may be cut.
        self._keep = 2 * max(len(s) for s in self._stops) + 8
        self._tail = ""
        self._ids: list[int] = []
        """The ids from the last complete character's context on: [0, _read) decoded already
        (context only), [_read, end) not yet shown (the new token, or an incomplete character)."""
        self._read = 0

    def push(self, token: int) -> bool:
        """Take the next output token; True when a stop string may end with it."""
        ids = self._ids
        ids.append(token)
        text = self._decode(ids)
        shown = self._decode(ids[: self._read]) if self._read else ""
        if text == shown:
            if self._read and len(ids) - self._read == 1:
                ids.pop()  # a token that shows nothing (a special one skipped) is left out
            return False
        # The context's own text may change at its end (a character shown incomplete, now
        # completed): the tail's end is rewritten from where the two texts part.
        same = len(shown)
        if not text.startswith(shown):
            same = next((i for i, (a, b) in enumerate(zip(shown, text)) if a != b), len(text))
        tail = self._tail[: max(0, len(self._tail) - (len(shown) - same))]
        new = text[same:]
        if new.endswith(INCOMPLETE) and len(ids) - self._read < MAX_CHARACTER_TOKENS:
            # A character still incomplete: it shows with the token that ends it; what comes
            # before it is complete and checked now.
            return self._holds_a_stop(tail + new.rstrip(INCOMPLETE))
        window = tail + new
        self._tail = window[-self._keep :]
        del ids[: self._read]
        self._read = len(ids)
        return self._holds_a_stop(window)

    def _holds_a_stop(self, text: str) -> bool:
        if any(s in text for s in self._stops):
            return True
        return self._clean_up is not None and any(s in self._clean_up(text) for s in self._stops)

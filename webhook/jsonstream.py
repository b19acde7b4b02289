"""One JSON document parsed in pieces, as its bytes arrive.

Why: a request body of several MiB parsed in one call holds the event loop for tens of
milliseconds (tokens of a few bytes each: over a hundred), and every ordinary review waiting at
that moment waits that long. Fed in pieces, the same document costs the loop what one piece
costs at a time; the server sizes the pieces and decides how often one may run
(``webhook.server``).

Ordinary bodies keep the one-call parser (pydantic's, which is several times faster); this one
must accept and refuse the same documents, which ``tests/test_webhook_jsonstream.py`` checks
case by case. Where the two differ, this one refuses documents the other accepts: integers
outside (-2**63, 2**63), ``NaN``, floats that overflow, and any escaped UTF-16 surrogate
(``\\ud800``-``\\udfff``, even a valid pair), which yajl would turn into a ``?``, a wrong
character or an exception. kube-apiserver writes none of these: Go's encoder emits no ``NaN``,
writes characters outside the BMP as UTF-8 rather than as escaped pairs, and the fields of
Kubernetes objects are at most 64-bit.

The tokens come from yajl (ijson's C backend), the objects are built here: yajl keeps no
nesting limit, and a document nested deeper than pydantic's parser allows (``MAX_DEPTH``)
must be refused by both, not reach code that walks it recursively.
"""

from __future__ import annotations

import gc
import re
from typing import Any

import ijson

# The deepest nesting pydantic's JSON parser accepts (tests check both refuse one more).
MAX_DEPTH = 201

# The C backend: the pure-Python one is about fifty times slower per token.
_yajl = ijson.get_backend("yajl2_c")
# An escaped surrogate: ``\\u`` and D8-DF after an odd run of backslashes (an even run is
# escaped backslashes followed by the text "u...").
_SURROGATE_ESCAPE = re.compile(rb"(?:^|[^\\])(?:\\\\)*\\u[dD][89a-fA-F]")


class JSONError(ValueError):
    """Not one well-formed JSON document, or nested deeper than ``MAX_DEPTH``."""


class JSONStream:
    """Feed the document's bytes with ``feed`` (any split), then ``close`` for the value."""

    def __init__(self, max_depth: int = MAX_DEPTH) -> None:
        self._events: list[tuple[str, Any]] = ijson.sendable_list()
        self._parser = _yajl.basic_parse_coro(self._events, use_float=True)
        self._max_depth = max_depth
        self._open: list[dict[str, Any] | list[Any]] = []  # the containers being filled
        self._keys: list[str | None] = []  # the pending key of each open object
        self._root: Any = None
        self._done = False
        self._carry = b""  # what the next piece's escapes may start in (see _no_surrogates)

    def feed(self, piece: bytes) -> None:
        """Parse ``piece``: about 0.25 microseconds per token, 3 ms for 16 KiB of one-digit
        numbers, 0.1 ms for 16 KiB of ordinary pod JSON.

        Without the cyclic collector: JSON makes no cycles, and the parser emits one tuple per
        token (8,000 in a piece of one-digit numbers), each of which counts towards the next
        collection, so a dense body would otherwise set off collections of every generation,
        full ones included (tens of milliseconds each), for objects that die a moment later.
        """
        collecting = gc.isenabled()
        gc.disable()
        try:
            self._no_surrogates(piece)
            try:
                self._parser.send(piece)
            except (ijson.JSONError, ValueError) as exc:  # ValueError: undecodable strings
                raise JSONError(_first_line(exc)) from None
            self._build()
        finally:
            if collecting:
                gc.enable()

    def close(self) -> Any:
        """The document's value, once all of it has been fed."""
        try:
            self._parser.close()
        except (ijson.JSONError, ValueError) as exc:
            raise JSONError(_first_line(exc)) from None
        self._build()
        if not self._done:
            raise JSONError("incomplete JSON document")
        return self._root

    def _no_surrogates(self, piece: bytes) -> None:
        """Refuses escaped surrogates, also where a piece ends inside one. The carry is what
        the previous pieces end with, shortened without changing a match: the last three bytes
        (a partial ``\\uD``), after the parity of the backslash run before them."""
        window = self._carry + piece
        if b"\\u" in window and _SURROGATE_ESCAPE.search(window):
            raise JSONError("escaped UTF-16 surrogates (\\ud800-\\udfff) are not accepted")
        head, tail = window[:-3], window[-3:]
        run = len(head) - len(head.rstrip(b"\\"))
        self._carry = b" " + b"\\" * (run % 2) + tail

    def _build(self) -> None:
        open_, keys = self._open, self._keys
        for event, token in self._events:
            if event == "map_key":
                keys[-1] = token
                continue
            if event in _ENDS:
                open_.pop()
                keys.pop()
                self._done = not open_
                continue
            container = event in _STARTS
            if container and len(open_) >= self._max_depth:
                raise JSONError(f"nested deeper than {self._max_depth} levels")
            value: Any = ({} if event == "start_map" else []) if container else token
            if not open_:
                self._root = value
                self._done = not container
            elif isinstance(top := open_[-1], dict):
                key = keys[-1]
                assert key is not None  # yajl sends a key before each member
                top[key] = value
            else:
                top.append(value)
            if container:
                open_.append(value)
                keys.append(None)
        self._events.clear()


_STARTS = frozenset({"start_map", "start_array"})
_ENDS = frozenset({"end_map", "end_array"})


def _first_line(exc: Exception) -> str:
    """yajl's message without the excerpt of the document it appends."""
    text = exc.args[0] if exc.args else exc
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    return str(text).strip().splitlines()[0] if str(text).strip() else "invalid JSON"

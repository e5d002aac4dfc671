"""JSON payloads: canonical encoding, hashing, the size and depth limits. JSON only, never pickle.

Every value onceflow stores (a stage's input, a result, an error, an op and its
result, a sub-doc's state) goes through :func:`canonical_json`, which refuses
what JSON or jsonb cannot hold — NaN and ±Infinity (also ``1e400``, which
Python reads as infinity), NUL characters, lone surrogates — and, given a
``max_depth``, values nested deeper than that many arrays/objects
(:class:`~onceflow.errors.PayloadTooDeep`). :func:`check_json` runs the same
checks on a value that may still hold non-JSON objects (a stage's input before
its pydantic model converts it).

Reading never fails on what is stored: :func:`load_stored_json` (the jsonb
loader of every engine :func:`onceflow.db.make_engine` builds) serves a stored
value nested deeper than :data:`READ_MAX_DEPTH` — only rows written before the
depth limit existed can be — as an :class:`Unreadable` placeholder object.
"""

from __future__ import annotations

import hashlib
import json
import re
import traceback
from itertools import accumulate
from typing import Any

from onceflow.errors import InvalidRequest, PayloadTooDeep, PayloadTooLarge

JSON = Any  # a JSON-able value: dict, list, str, int, float, bool or None

#: Stored values nested deeper than this are served as an :class:`Unreadable` placeholder:
#: past it pydantic's serializer (255 levels with the answer's own) and Python's json
#: (about 1000) fail. ``ONCEFLOW_MAX_PAYLOAD_DEPTH`` is capped well below it.
READ_MAX_DEPTH = 200
#: The key that marks a placeholder (over HTTP, where the type is gone).
UNREADABLE_KEY = "onceflow_unreadable"

# An escape inside a JSON string; every byte that is not a bracket.
_ESCAPE = re.compile(rb"\\.", re.S)
_NOT_BRACKETS = bytes(range(256)).translate(None, b"[]{}")
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def strip_json_strings(data: bytes) -> bytes:
    """JSON ``data`` with every string replaced by ``""`` (what is left is structure).

    Tokenizes as a JSON parser does: an escape (``\\x``) is dropped first, then a string
    runs from a quote to the next one. Text that is not JSON may come out differently from
    its strings, but never so that brackets a parser would nest into are lost.
    """
    if b"\\" in data:
        data = _ESCAPE.sub(b"", data)
    return b'""'.join(data.split(b'"')[0::2])


def bracket_depth(bare: bytes) -> int:
    """The nesting depth of JSON text whose strings are stripped (:func:`strip_json_strings`)."""
    brackets = bare.translate(None, _NOT_BRACKETS)
    return max(0, max(accumulate(map(_STEP.__getitem__, brackets)), default=0))


def _as_bytes(text: str | bytes) -> bytes:
    if isinstance(text, str):
        return text.encode("utf-8", "surrogatepass")
    return bytes(text)


def json_depth(text: str | bytes) -> int:
    """How deeply the arrays/objects of JSON ``text`` nest (0 for a scalar), without parsing.

    Brackets inside strings do not count. Linear and non-recursive (a regular expression
    and C-level iteration), so it is safe on any input, however deep; on text that is not
    valid JSON (an unterminated string) it may over-count, never under-count.
    """
    return bracket_depth(strip_json_strings(_as_bytes(text)))


def deeper_than(text: str | bytes, limit: int) -> int | None:
    """The nesting depth of JSON ``text`` if it is over ``limit``, else None (cheaply)."""
    data = _as_bytes(text)
    if data.count(b"[") + data.count(b"{") <= limit:  # too few openings to nest deeper
        return None
    depth = json_depth(data)
    return depth if depth > limit else None


def _as_leaf(_: object) -> None:
    # check_json: an object only the stage's model can convert counts as a leaf here.
    return None


# The two encodings, built once (json.dumps with arguments builds an encoder per call):
# canonical (sorted keys), and check_json's, where a non-JSON object is a leaf.
_CANONICAL = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
)
_LENIENT = json.JSONEncoder(
    separators=(",", ":"), ensure_ascii=False, allow_nan=False, default=_as_leaf
)


def _dumps(value: JSON, what: str, max_depth: int | None, *, foreign_ok: bool) -> str:
    try:
        return (_LENIENT if foreign_ok else _CANONICAL).encode(value)
    except RecursionError:
        # Deeper than Python's own stack allows: far over any depth limit.
        raise PayloadTooDeep(what, max_depth) from None
    except ValueError as exc:
        if "Out of range float" in str(exc):
            raise InvalidRequest(
                f"{what} is not JSON: it holds NaN or Infinity (or a number too large for "
                "a float, such as 1e400)"
            ) from None
        raise InvalidRequest(f"{what} is not JSON: {exc}") from None
    except TypeError as exc:
        raise InvalidRequest(f"{what} is not JSON: {exc}") from None


def _check_text(text: str, what: str, max_depth: int | None) -> None:
    if "\\u0000" in text:
        # Postgres jsonb cannot store NUL in strings; refuse it here rather than as a driver error.
        raise InvalidRequest(f"{what} contains a NUL character (\\u0000), which jsonb cannot store")
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequest(f"{what} contains a lone surrogate: not valid UTF-8") from None
    if max_depth is not None and deeper_than(text, max_depth) is not None:
        raise PayloadTooDeep(what, max_depth)


def canonical_json(value: JSON, *, what: str = "input", max_depth: int | None = None) -> str:
    """Encode ``value`` canonically (sorted keys, no spaces), rejecting what jsonb cannot hold.

    Refused (:class:`InvalidRequest`, nothing written): NaN and ±Infinity, NUL, lone
    surrogates, non-JSON types, and — given ``max_depth`` — nesting deeper than that
    many arrays/objects (:class:`PayloadTooDeep`).
    """
    text = _dumps(value, what, max_depth, foreign_ok=False)
    _check_text(text, what, max_depth)
    return text


def check_json(value: Any, *, what: str = "input", max_depth: int | None = None) -> None:
    """The checks of :func:`canonical_json` on a value that may hold non-JSON objects.

    For a stage's input *before* its pydantic model converts it (which would turn NaN
    into ``null``): NaN/Infinity, NUL, lone surrogates and depth are refused; an object
    that is not JSON (a datetime, a model) counts as a leaf, for the model to judge.
    """
    _check_text(_dumps(value, what, max_depth, foreign_ok=True), what, max_depth)


def _encoded(value: JSON, limit: int, what: str, max_depth: int | None) -> tuple[str, bytes]:
    """:func:`canonical_json`'s text and its UTF-8 bytes, encoded once for all the checks
    (surrogates, depth, size): a payload near the limit is a quarter of a megabyte."""
    text = _dumps(value, what, max_depth, foreign_ok=False)
    if "\\u0000" in text:
        _check_text(text, what, max_depth)  # raises: the one message for NUL
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(f"{what} contains a lone surrogate: not valid UTF-8") from None
    if max_depth is not None and deeper_than(data, max_depth) is not None:
        raise PayloadTooDeep(what, max_depth)
    if len(data) > limit:
        raise PayloadTooLarge(what, len(data), limit)
    return text, data


def encode_json(
    value: JSON, limit: int, *, what: str = "result", max_depth: int | None = None
) -> str:
    """Canonical JSON text, or an error when over ``limit`` bytes or too deep: for what is
    stored and never compared (a result, an error), with no digest to compute."""
    return _encoded(value, limit, what, max_depth)[0]


def encode_payload(
    value: JSON, limit: int, *, what: str = "input", max_depth: int | None = None
) -> tuple[str, str]:
    """Canonical JSON text and its sha256, or an error when over ``limit`` bytes or too deep."""
    text, data = _encoded(value, limit, what, max_depth)
    return text, hashlib.sha256(data).hexdigest()


# ----------------------------------------------------------------------- reading


class Unreadable(dict[str, Any]):
    """The placeholder served for a stored JSON value onceflow cannot serve (too deep).

    A plain JSON object on the wire (``{"onceflow_unreadable": true, "reason": …,
    "depth": …}``); in Python its type tells it from any user value. The stored value
    itself is left as it is.
    """

    def __init__(self, depth: int) -> None:
        super().__init__(
            {
                UNREADABLE_KEY: True,
                "reason": f"the stored JSON value nests {depth} levels deep, over the "
                f"{READ_MAX_DEPTH} levels onceflow can serve; it is kept unchanged in the database",
                "depth": depth,
            }
        )

    @property
    def depth(self) -> int:
        """How deeply the stored value nests."""
        return int(self["depth"])


def is_unreadable(value: Any) -> bool:
    """True for the placeholder of an unreadable stored value (also as JSON from the API)."""
    return isinstance(value, dict) and value.get(UNREADABLE_KEY) is True and "reason" in value


def load_stored_json(data: str | bytes) -> Any:
    """The jsonb loader of onceflow's engines: ``json.loads``, never failing on depth.

    A value nested deeper than :data:`READ_MAX_DEPTH` (written before the depth limit
    existed) comes back as an :class:`Unreadable` placeholder instead of raising
    ``RecursionError`` here or failing the answer's serialization later.
    """
    if isinstance(data, memoryview):
        data = bytes(data)
    if len(data) > 2 * READ_MAX_DEPTH:  # each level costs at least two bytes
        depth = deeper_than(data, READ_MAX_DEPTH)
        if depth is not None:
            return Unreadable(depth)
    try:
        return json.loads(data)
    except RecursionError:  # pragma: no cover - the scan above rules it out
        return Unreadable(json_depth(data))


# ------------------------------------------------------------------ a failure's error

#: The traceback lines kept of a failed stage's error (the last ones).
TRACEBACK_LINES = 30
#: The most characters kept of an error's message, and of each of its traceback lines.
MESSAGE_CHARS = 2000
TRACEBACK_LINE_CHARS = 500


def error_payload(exc: BaseException) -> dict[str, Any]:
    """A JSON description of an exception, kept on the row (never raises).

    Always storable: NUL characters and lone surrogates (bytes from a provider, a bad
    decode) are written out as escapes, and the message and every traceback line are
    capped (the last line repeats the message). Before, such an error was refused by the
    store, nothing was recorded, and the request ran again once its lease lapsed.
    """
    name = storable_text(type(exc).__name__, 200)
    try:
        message = storable_text(str(exc), MESSAGE_CHARS)
    except Exception:  # an exception whose __str__ raises must still be recorded
        message = f"<{name}: str() failed>"
    try:
        lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
        tail = [
            storable_text(line, TRACEBACK_LINE_CHARS)
            for line in "".join(lines).splitlines()[-TRACEBACK_LINES:]
        ]
    except Exception:
        tail = []
    return {"type": name, "message": message, "traceback": tail}


def storable_text(text: str, limit: int) -> str:
    """``text`` as a JSON string jsonb can store: at most ``limit`` characters, NUL written
    as ``\\x00`` and a lone surrogate as its ``\\udcff`` escape."""
    text = text[:limit].replace("\x00", "\\x00")
    return text.encode("utf-8", "backslashreplace").decode("utf-8")

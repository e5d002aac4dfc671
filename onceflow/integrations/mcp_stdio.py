"""The stdio transport of ``onceflow mcp``: every request gets an answer.

The SDK's stdio reader validates each line as a JSON-RPC message and, when that
fails, hands the session an exception that carries no request id: the session
drops it, and the client waits forever. A lone-surrogate escape (``"\\ud800"``)
anywhere in a line, JSON nested deeper than the SDK's parser reads, a line that
is not JSON, or one that is JSON but not a JSON-RPC object all went unanswered.

:class:`GuardedStdin` sits in front of the SDK's reader (``stdio_server(stdin=…)``):
it reads stdin line by line, up to :data:`MAX_LINE_BYTES` a line, passes on every
line the SDK's own validation accepts, and answers the others itself:

* not JSON: ``-32700`` parse error, id null;
* over the line limit: ``-32600``, with the request's ``id`` when it is a member of
  the top-level object within the line's first :data:`MAX_LINE_BYTES` (read by
  :func:`leading_id`, without parsing the rest), else id null;
* JSON but not one JSON-RPC request object (an array, a number; a bad ``id`` or
  ``method``): ``-32600`` invalid request;
* a ``tools/call`` whose arguments cannot be read (a lone surrogate, too deep):
  a tool error (``isError``) naming the problem — the tool never runs, nothing
  is written;
* any other request whose params cannot be read: ``-32602`` invalid params.

A notification (no ``id``) that cannot be read gets no answer (JSON-RPC answers
no notification); it is logged on stderr, and the server reads the next line.
Answers go out through the session's write stream, so they never interleave
with the SDK's own output.
"""

from __future__ import annotations

import importlib
import json
import logging
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO

import anyio
import anyio.to_thread

log = logging.getLogger("onceflow.mcp")

MAX_LINE_BYTES = 4 * 1024 * 1024
PARSE_ERROR = -32700
INVALID_REQUEST = -32600
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
_MISSING = object()
BAD_ID = "Invalid request: id must be a string or an integer"


# ---------------------------------------------------------------- the verdicts


def _has_lone_surrogate(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _depth(value: Any) -> int:
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, level)
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, level + 1) for child in children)
    return deepest


def _usable_id(value: Any) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)) or _clean_str(value)


def _has_unusable_id(line: str) -> bool:
    """An ``id`` that is there but neither an integer nor a string (true, 1.5, null, {…})."""
    if '"id"' not in line:
        return False
    try:
        message = json.loads(line)
    except (ValueError, RecursionError):
        return False
    return isinstance(message, dict) and "id" in message and not _usable_id(message["id"])


def _clean_str(value: Any) -> bool:
    return isinstance(value, str) and not _has_lone_surrogate(value)


def _problem(value: Any, sdk_error: str) -> str:
    """What makes ``value`` unreadable, on one line."""
    if _has_lone_surrogate(value):
        return "a string holds a lone surrogate (\\ud800-\\udfff), which is not valid Unicode"
    depth = _depth(value)
    if "recursion limit" in sdk_error:
        return f"JSON nested {depth} levels deep, deeper than the server reads"
    return sdk_error or "not a valid message"


# The tokens that matter to find a top-level member of a JSON object: strings (escapes
# included) and brackets; numbers, literals, commas and spaces are skipped by the engine.
# A string cut by the end of the head is one token to the end (never scanned again from
# each quote inside it: that would be quadratic).
_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*(?:"|\\?\Z)|[{}\[\]]', re.DOTALL)
_COLON = re.compile(rb"[ \t\r\n]*:[ \t\r\n]*")
_SCALAR = re.compile(rb'"(?:[^"\\]|\\.)*"|-?[0-9][0-9.eE+-]*')


def leading_id(head: bytes) -> str | int | None:
    """The ``id`` member of the JSON object ``head`` starts (the first bytes of a line too
    long to read), or None if it is not there or not a usable id.

    One pass over ``head`` with a regular expression for strings and brackets (no value is
    built but the id's): the first top-level ``"id"`` key's value, if it is an integer or
    a string and comes before ``head`` ends. A top-level member after the cut cannot be
    seen: its id is None.
    """
    start = len(head) - len(head.lstrip())
    if head[start : start + 1] != b"{":
        return None
    depth = 0
    for token in _TOKENS.finditer(head, start):
        text = token.group()
        if text in (b"{", b"["):
            depth += 1
        elif text in (b"}", b"]"):
            depth -= 1
            if depth <= 0:
                return None  # the object ended without an id (or the brackets do not match)
        elif not text.endswith(b'"') or text == b'"':
            return None  # a string cut by the end of the head: nothing after it to read
        elif depth == 1 and (colon := _COLON.match(head, token.end())) is not None:
            try:
                key = json.loads(text)
            except ValueError:
                return None
            if key != "id":
                continue
            value = _SCALAR.match(head, colon.end())
            if value is None:
                return None  # an object, an array, a literal: not an id
            try:
                request_id = json.loads(value.group())
            except ValueError:
                return None
            return request_id if _usable_id(request_id) else None
    return None


def _error(request_id: Any, code: int, message: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "error": {"code": code, "message": message}}


def triage(line: str, validate: Callable[[str], object]) -> dict[str, Any] | bool | None:
    """``True``: hand the line to the SDK; ``None``: drop it; a dict: the answer to send.

    ``validate`` is the SDK's own line validation: a line it accepts is passed on
    untouched, so the SDK's behaviour for every well-formed message is unchanged.
    """
    if not line.strip():
        return None
    try:
        validate(line)
    except Exception as exc:  # the SDK's validation error, whatever its class
        sdk_error = " ".join(str(exc).split())
    else:
        if _has_unusable_id(line):  # the SDK takes it for a notification and answers nothing
            return _error(None, INVALID_REQUEST, BAD_ID)
        return True
    try:
        message = json.loads(line)
    except (ValueError, RecursionError):
        return _error(None, PARSE_ERROR, "Parse error: the line is not JSON")
    if not isinstance(message, dict):
        kind = type(message).__name__
        return _error(None, INVALID_REQUEST, f"Invalid request: one JSON object a line, not {kind}")
    request_id = message.get("id", _MISSING)
    if request_id is _MISSING or (request_id is None and "method" not in message):
        log.warning("dropped an unreadable notification: %s", _problem(message, sdk_error))
        return None  # a notification (or a response of the client): nothing to answer
    if "method" not in message:
        log.warning("dropped an unreadable response: %s", _problem(message, sdk_error))
        return None
    if not _usable_id(request_id):
        return _error(None, INVALID_REQUEST, BAD_ID)
    method = message.get("method")
    if message.get("jsonrpc") != "2.0":
        return _error(request_id, INVALID_REQUEST, 'Invalid request: jsonrpc must be "2.0"')
    if not _clean_str(method):
        return _error(request_id, INVALID_REQUEST, "Invalid request: method must be a valid string")
    params = message.get("params")
    if method == "tools/call" and isinstance(params, dict) and "arguments" in params:
        # Readable once the arguments are set aside: the arguments are the problem, so the
        # answer is the tool's error (what a model can read and correct), and the tool never runs.
        without = {**message, "params": {**params, "arguments": {}}}
        if _clean_str(params.get("name")) and _validates(validate, without):
            problem = _problem(params["arguments"], sdk_error)
            text = f"Invalid arguments for tool {params['name']}: {problem}"
            result = {"content": [{"type": "text", "text": text}], "isError": True}
            return {"jsonrpc": "2.0", "id": request_id, "result": result}
    return _error(request_id, INVALID_PARAMS, f"Invalid params: {_problem(params, sdk_error)}")


def _validates(validate: Callable[[str], object], message: dict[str, Any]) -> bool:
    try:
        validate(json.dumps(message))
    except Exception:
        return False
    return True


# ------------------------------------------------------------------ the reader


def sdk_line_validator() -> Callable[[str], object]:
    """The validation the SDK's stdio reader applies to each line (2.x, else 1.x)."""
    types = importlib.import_module("mcp.types")
    adapter = getattr(types, "jsonrpc_message_adapter", None)
    if adapter is not None:
        return lambda line: adapter.validate_json(line, by_name=False)
    validate: Callable[[str], object] = types.JSONRPCMessage.model_validate_json
    return validate


class _Prerendered:
    """An answer the SDK's own types cannot hold, as its JSON text (for the SDK's writer).

    mcp 1.x types an error's id as ``str | int`` (no null) and writes with
    ``exclude_none``; the writer only calls ``model_dump_json`` on what it is given.
    """

    def __init__(self, answer: dict[str, Any]) -> None:
        self._text = json.dumps(answer, ensure_ascii=True, separators=(",", ":"))

    def model_dump_json(self, **_: Any) -> str:
        return self._text


def _sdk_message(answer: dict[str, Any]) -> Any:
    """``answer`` as what the SDK's write stream carries (a SessionMessage in 2.x and late 1.x)."""
    types = importlib.import_module("mcp.types")
    adapter = getattr(types, "jsonrpc_message_adapter", None)
    message: Any
    try:
        if adapter is not None:
            message = adapter.validate_python(answer)
        else:
            message = types.JSONRPCMessage.model_validate(answer)
    except ValueError:  # pydantic's ValidationError: e.g. a null id in 1.x
        message = _Prerendered(answer)
    try:
        session_message = importlib.import_module("mcp.shared.message").SessionMessage
    except (ImportError, AttributeError):
        return message
    return session_message(message)


@dataclass(frozen=True, slots=True)
class _Oversized:
    """A line over the limit, read to its end and thrown away; its request's id if read."""

    request_id: str | int | None


class GuardedStdin:
    """An async iterator of the stdin lines the SDK can read; it answers the others itself.

    Pass it as ``stdio_server(stdin=…)``, then :meth:`attach` the write stream the
    server yields. Lines are read up to ``max_line_bytes``; a longer one is read to
    its end, thrown away and answered with ``-32600`` and the id :func:`leading_id`
    finds in its first ``max_line_bytes``.
    """

    def __init__(
        self,
        stream: BinaryIO | None = None,
        *,
        max_line_bytes: int = MAX_LINE_BYTES,
        validate: Callable[[str], object] | None = None,
    ) -> None:
        self._stream = stream if stream is not None else sys.stdin.buffer
        self.max_line_bytes = max_line_bytes
        self._validate = validate or sdk_line_validator()
        self._write: Any = None
        self._attached = anyio.Event()

    def attach(self, write_stream: Any) -> None:
        """Send answers through ``write_stream`` (the one the session writes to)."""
        self._write = write_stream
        self._attached.set()

    def __aiter__(self) -> GuardedStdin:
        return self

    async def __anext__(self) -> str:
        while True:
            raw = await anyio.to_thread.run_sync(self._read_line)
            if raw is None:
                raise StopAsyncIteration
            if isinstance(raw, _Oversized):
                answer: Any = _error(
                    raw.request_id,
                    INVALID_REQUEST,
                    f"Invalid request: a message is over {self.max_line_bytes} bytes",
                )
            else:
                line = raw.decode("utf-8", errors="replace")  # as the SDK's reader decodes
                try:
                    answer = triage(line, self._validate)
                except Exception:  # a bug here must not stop the server
                    log.exception("could not check a line")
                    answer = _error(None, INTERNAL_ERROR, "Internal error")
                if answer is True:
                    return line
            if isinstance(answer, dict):
                await self._answer(answer)

    def _read_line(self) -> bytes | _Oversized | None:
        """The next line; None at the end of the stream; :class:`_Oversized` for a line
        over the limit (with the id read from its first ``max_line_bytes``)."""
        line = self._stream.readline(self.max_line_bytes + 1)
        if not line:
            return None
        if len(line) <= self.max_line_bytes or line.endswith(b"\n"):
            return line
        try:
            found = _Oversized(leading_id(line[: self.max_line_bytes]))
        except Exception:  # a bug here must not stop the server: answer without the id
            log.exception("could not read the id of an oversized line")
            found = _Oversized(None)
        while line and not line.endswith(b"\n"):  # read the oversized line to its end
            line = self._stream.readline(self.max_line_bytes + 1)
        return found

    async def _answer(self, answer: dict[str, Any]) -> None:
        await self._attached.wait()
        try:
            await self._write.send(_sdk_message(answer))
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            log.warning("the session is closed; an answer was not sent")
        except Exception:  # never let one answer stop the server
            log.exception("could not send an answer")


async def run_stdio(server: Any, *, max_line_bytes: int = MAX_LINE_BYTES) -> None:
    """Serve ``server`` (an ``MCPServer``/``FastMCP``) over stdio behind :class:`GuardedStdin`."""
    from mcp.server.stdio import stdio_server

    # The SDK's servers keep their low-level Server private (``_lowlevel_server`` on
    # MCPServer, ``_mcp_server`` on FastMCP) and their public run_stdio_async reads the
    # process's stdin unguarded: the only way to put GuardedStdin in front is this one.
    lowlevel = getattr(server, "_lowlevel_server", None) or server._mcp_server  # noqa: SLF001
    guard = GuardedStdin(max_line_bytes=max_line_bytes)
    async with stdio_server(stdin=guard) as (read_stream, write_stream):  # type: ignore[arg-type]
        guard.attach(write_stream)
        await lowlevel.run(read_stream, write_stream, lowlevel.create_initialization_options())

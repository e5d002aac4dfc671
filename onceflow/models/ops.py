"""Ops: typed writes to a sub-doc, each a pure function from state to state.

A sub-doc's state is a JSON object. The built-in ops cover a table-like document (the
demo's jobs with their custom columns):

* ``cell.set`` / ``cell.clear`` — custom-column values, in ``state["cells"]``;
* ``node.insert`` / ``node.move`` / ``node.delete`` — an ordered list of node ids in
  ``state["order"]``, placed after an anchor node (``after=None``: first), so that a
  retried ``node.move`` can never corrupt the order;
* ``merge`` — an RFC 7386 JSON merge patch of the whole state.

Users register their own with :func:`register_op`. An op that is well-formed but
cannot apply to the current state (moving a node that is not there, or a ``merge`` made
``cells`` / ``order`` something the built-ins cannot work on) raises :class:`OpRejected`;
the op log records that answer so a retry gets it again.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from onceflow.errors import InvalidRequest, OnceflowError, OpRejected, validation_summary
from onceflow.payloads import check_json

State = dict[str, Any]
ApplyFn = Callable[[State, Any], tuple[State, Any]]

ID = Annotated[str, Field(min_length=1, max_length=200)]

log = logging.getLogger("onceflow.oplog")


class OpModel(BaseModel):
    """Base of every op payload: strict, no unknown fields, a ``type`` discriminator."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    type: str


class CellSet(OpModel):
    """Set a custom column's value."""

    type: Literal["cell.set"] = "cell.set"
    column: ID
    value: Any


class CellClear(OpModel):
    """Remove a custom column's value."""

    type: Literal["cell.clear"] = "cell.clear"
    column: ID


class NodeInsert(OpModel):
    """Insert a node after ``after`` (None: at the start)."""

    type: Literal["node.insert"] = "node.insert"
    node: ID
    after: ID | None = None


class NodeMove(OpModel):
    """Move a node to just after ``after`` (None: to the start)."""

    type: Literal["node.move"] = "node.move"
    node: ID
    after: ID | None = None


class NodeDelete(OpModel):
    """Remove a node from the order."""

    type: Literal["node.delete"] = "node.delete"
    node: ID


class MergePatch(OpModel):
    """An RFC 7386 JSON merge patch of the whole state."""

    type: Literal["merge"] = "merge"
    patch: dict[str, Any]


BuiltinOp = Annotated[
    CellSet | CellClear | NodeInsert | NodeMove | NodeDelete | MergePatch,
    Field(discriminator="type"),
]


@dataclass(frozen=True)
class OpType:
    """A registered op type: its payload model and its pure apply function."""

    name: str
    model: type[OpModel]
    apply: ApplyFn


_REGISTRY: dict[str, OpType] = {}


def register_op(name: str, model: type[OpModel], apply: ApplyFn) -> None:
    """Register an op type; ``apply(state, op) -> (new_state, result)`` must be pure.

    It raises :class:`OpRejected` for an op the state cannot take. A ``TypeError``,
    ``AttributeError``, ``LookupError`` or ``ValueError`` it raises is taken as such a
    rejection too (see :func:`apply`).
    """
    if name in _REGISTRY and _REGISTRY[name].model is not model:
        raise InvalidRequest(f"op type {name!r} is already registered")
    _REGISTRY[name] = OpType(name, model, apply)


def op_types() -> list[str]:
    """The registered op type names, sorted (what an op's ``type`` may be)."""
    return sorted(_REGISTRY)


def parse_op(op: OpModel | dict[str, Any], *, max_depth: int | None = None) -> OpModel:
    """Validate an op (a model or a dict with ``type``); a clear error for anything else.

    Before its model converts it (an ``Any`` field would turn NaN into ``null``), the op
    is checked as every payload is: no NaN/Infinity, NUL or lone surrogate, and nested at
    most ``max_depth`` levels.
    """
    check_json(op.model_dump(mode="python") if isinstance(op, OpModel) else op, what="op",
               max_depth=max_depth)  # fmt: skip
    if isinstance(op, OpModel):
        data: Any = op.model_dump(mode="json")
    else:
        data = op
    if not isinstance(data, dict):
        raise InvalidRequest(f"an op must be an object with a 'type', got {type(data).__name__}")
    name = data.get("type")
    entry = _REGISTRY.get(name) if isinstance(name, str) else None
    if entry is None:
        known = ", ".join(sorted(_REGISTRY))
        raise InvalidRequest(f"unknown op type {name!r}; known: {known}")
    try:
        return entry.model.model_validate(data)
    except ValidationError as exc:
        raise InvalidRequest(f"invalid {name} op: {validation_summary(exc)}") from None


#: What a pure apply function raises when the state is not what it expects: a rejection.
_STATE_ERRORS = (TypeError, AttributeError, LookupError, ValueError)


def apply(state: State, op: OpModel) -> tuple[State, Any]:
    """Apply a parsed op to a copy of ``state``; raises :class:`OpRejected`.

    A registered function's ``TypeError`` / ``AttributeError`` / ``LookupError`` /
    ``ValueError`` (not an :class:`~onceflow.errors.OnceflowError`) becomes
    :class:`OpRejected`: the function is pure, so the same state and op fail the same way
    every time, and the op log records the answer like any rejection — rather than roll
    back with a raw error (an HTTP 500, which a client retries forever as "outcome
    unknown").
    """
    fn, own = _REGISTRY[op.type].apply, copy.deepcopy(state)
    try:
        return fn(own, op)
    except OnceflowError:
        raise
    except _STATE_ERRORS as exc:
        log.warning("op %s failed on the sub-doc's state: rejected", op.type, exc_info=True)
        reason = f"cannot apply to the sub-doc's state ({type(exc).__name__}: {exc})"
        raise OpRejected(op.type, reason) from exc


# ----------------------------------------------------------------------- built-ins


def _cells(state: State, op_type: str, *, create: bool) -> dict[str, Any]:
    """``state["cells"]`` (made empty if absent and ``create``); rejected unless an object."""
    cells = state.setdefault("cells", {}) if create else state.get("cells", {})
    if not isinstance(cells, dict):
        raise OpRejected(op_type, f"the sub-doc's 'cells' is {_kind(cells)}, not an object")
    return cells


def _order(state: State, op_type: str) -> list[str]:
    """``state["order"]`` (made empty if absent); rejected unless a list of node ids."""
    order = state.setdefault("order", [])
    if not isinstance(order, list):
        raise OpRejected(op_type, f"the sub-doc's 'order' is {_kind(order)}, not a list")
    if not all(isinstance(node, str) for node in order):
        raise OpRejected(op_type, "the sub-doc's 'order' holds something other than node ids")
    return order


def _kind(value: Any) -> str:
    return "null" if value is None else f"a {type(value).__name__}"


def _cell_set(state: State, op: CellSet) -> tuple[State, Any]:
    _cells(state, op.type, create=True)[op.column] = op.value
    return state, None


def _cell_clear(state: State, op: CellClear) -> tuple[State, Any]:
    cells = _cells(state, op.type, create=False)
    existed = op.column in cells
    cells.pop(op.column, None)
    return state, {"existed": existed}


def _put_after(order: list[str], node: str, after: str | None, op_type: str) -> dict[str, int]:
    """Insert ``node`` right after ``after`` (first when None); the answer names its index."""
    if after is None:
        index = 0
    else:
        try:
            index = order.index(after) + 1
        except ValueError:
            raise OpRejected(op_type, f"anchor node {after!r} is not in the order") from None
    order.insert(index, node)
    return {"index": index}


def _order_holding(state: State, op: NodeMove | NodeDelete) -> list[str]:
    """The order ``op`` moves or deletes its node in; rejected when the node is not in it."""
    order = _order(state, op.type)
    if op.node not in order:
        raise OpRejected(op.type, f"node {op.node!r} is not in the order")
    return order


def _node_insert(state: State, op: NodeInsert) -> tuple[State, Any]:
    order = _order(state, op.type)
    if op.node in order:
        raise OpRejected(op.type, f"node {op.node!r} is already in the order")
    return state, _put_after(order, op.node, op.after, op.type)


def _node_move(state: State, op: NodeMove) -> tuple[State, Any]:
    order = _order_holding(state, op)
    if op.after == op.node:
        raise OpRejected(op.type, "a node cannot be moved after itself")
    order.remove(op.node)
    return state, _put_after(order, op.node, op.after, op.type)


def _node_delete(state: State, op: NodeDelete) -> tuple[State, Any]:
    _order_holding(state, op).remove(op.node)
    return state, None


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge recursively, ``null`` deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _merge(state: State, op: MergePatch) -> tuple[State, Any]:
    return merge_patch(state, op.patch), None


for _name, _model, _fn in (
    ("cell.set", CellSet, _cell_set),
    ("cell.clear", CellClear, _cell_clear),
    ("node.insert", NodeInsert, _node_insert),
    ("node.move", NodeMove, _node_move),
    ("node.delete", NodeDelete, _node_delete),
    ("merge", MergePatch, _merge),
):
    register_op(_name, _model, _fn)

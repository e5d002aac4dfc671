"""Deterministic request ids: pinned vectors and properties (no services needed)."""

from __future__ import annotations

import hashlib
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from onceflow.errors import InvalidRequest
from onceflow.ids import new_claim_token, random_request_id, request_id_for

# Frozen forever: changing the encoding would stop duplicates collapsing across versions.
VECTORS = [
    (("w1", "j1", "main", "evaluate"),
     "d2205fd72b65342c31f49e1623e5c75f847ebe7161db34cd4bbbf8b102ae7ba9"),
    (("ws-42", "job/7", "a/b/c", "tailor"),
     "ea803f90f349aeccc7ab24df6d6c584ddb9ec8eced741bda677557c8412ebdb1"),
    (("é", "日本", "", "s"),
     "618dbd6cc7493bc6ea5edc120f114db898b6b1d9d4ed6c0fb508c4666e18e25d"),
]  # fmt: skip


@pytest.mark.parametrize(("parts", "expected"), VECTORS)
def test_vectors(parts: tuple[str, str, str, str], expected: str) -> None:
    assert request_id_for(*parts) == expected


def test_encoding_is_the_documented_json_array() -> None:
    canonical = b'["onceflow.request.v1","w1","j1","main","evaluate"]'
    assert request_id_for("w1", "j1", "main", "evaluate") == hashlib.sha256(canonical).hexdigest()


def test_separators_inside_parts_do_not_collide() -> None:
    ids = {
        request_id_for("a", "b,c", "", "s"),
        request_id_for("a,b", "c", "", "s"),
        request_id_for('a","b', "c", "", "s"),
        request_id_for("a", '"b","c', "", "s"),
        request_id_for("a", "b", "c", "s"),
    }
    assert len(ids) == 5


# Printable characters drawn directly (no control, format, surrogate, private-use, unassigned
# or separator character but the space), so nearly no draw is thrown away; the filter stays
# as the definition of the domain.
printable = st.characters(exclude_categories=("C", "Z"), include_characters=" ")
part = st.text(printable, min_size=1, max_size=40).filter(str.isprintable)
path = st.text(printable, max_size=40).filter(str.isprintable)
tuples = st.tuples(part, part, path, part)


@given(tuples, tuples)
def test_distinct_tuples_never_share_an_id(a: tuple[str, ...], b: tuple[str, ...]) -> None:
    assert (request_id_for(*a) == request_id_for(*b)) == (a == b)


@given(tuples)
def test_the_id_is_the_sha256_of_the_documented_json_array(a: tuple[str, ...]) -> None:
    """The encoding is written out by hand (no encoder per call): it must stay byte for byte
    what ``json.dumps`` makes of the array, for any printable text (quotes, backslashes,
    non-ASCII)."""
    canonical = json.dumps(
        ["onceflow.request.v1", *a], ensure_ascii=False, separators=(",", ":")
    ).encode("utf-8")
    assert request_id_for(*a) == hashlib.sha256(canonical).hexdigest()


def test_escapes_in_parts_follow_json() -> None:
    parts = ('q"uote', "back\\slash", "é 日本 🙂", "s/1")
    canonical = json.dumps(
        ["onceflow.request.v1", *parts], ensure_ascii=False, separators=(",", ":")
    )
    assert request_id_for(*parts) == hashlib.sha256(canonical.encode("utf-8")).hexdigest()


@given(tuples)
def test_same_tuple_same_id(a: tuple[str, ...]) -> None:
    assert request_id_for(*a) == request_id_for(*a)
    assert len(request_id_for(*a)) == 64


@pytest.mark.parametrize(
    "parts",
    [
        ("", "j", "", "s"),
        ("w", "", "", "s"),
        ("w", "j", "", ""),
        ("w" * 201, "j", "", "s"),
        ("w", "j\x00", "", "s"),
        ("w", "j", "p" * 501, "s"),
        (1, "j", "", "s"),
    ],
)
def test_bad_parts_are_rejected(parts: tuple[object, ...]) -> None:
    with pytest.raises(InvalidRequest):
        request_id_for(*parts)  # type: ignore[arg-type]


def test_random_ids_and_tokens_are_fresh() -> None:
    assert len({random_request_id() for _ in range(1000)}) == 1000
    tokens = {new_claim_token() for _ in range(1000)}
    assert len(tokens) == 1000
    assert all(len(t) == 32 for t in tokens)  # 128 bits, hex


def test_a_worker_id_is_made_once_per_process_and_again_after_a_fork() -> None:
    """``host:pid``, cached: a forked pool child must not claim under its parent's pid."""
    import os
    import socket

    from onceflow.tasks.flow import worker_id

    mine = worker_id()
    assert mine == f"{socket.gethostname()}:{os.getpid()}"
    assert worker_id() is mine  # made once, not per stage
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its id and leave at once
        try:
            os.write(write, worker_id().encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        child = pipe.read().decode()
    os.waitpid(pid, 0)
    assert child == f"{socket.gethostname()}:{pid}"

"""The chaos harness's rule for a re-paid provider call (bench/chaos_checks.py).

A kill explains the calls of the processes it killed, whenever the stand-in saw them: it
begins answering a call a few ms after the caller sent it, so a call sent just before
``kill -9`` can be seen after the kill's instant (the rare foreign_sweeper failures). A
rule by time counted that call unexplained.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import httpx

from bench.chaos_checks import _lost_to_a_fault
from bench.chaos_run import Call, CountingLLM
from bench.chaos_stages import CALLER

KILLED, ALIVE = 101, 202
KILL_AT = 5.376


def run_with(kills: list[tuple[float, set[int]]], windows: list[tuple[float, float]]) -> Any:
    return SimpleNamespace(kills=kills, explaining=windows)


def test_a_killed_callers_call_seen_after_the_kill_is_explained() -> None:
    run = run_with([(KILL_AT, {KILLED})], [])
    late = Call("cj4/col0", KILL_AT + 0.009, KILL_AT + 0.11, KILLED)  # as in the CI failure
    assert _lost_to_a_fault(run, late, stored=10.5)


def test_a_live_callers_call_is_not_explained_by_a_kill() -> None:
    run = run_with([(KILL_AT, {KILLED})], [])
    assert not _lost_to_a_fault(run, Call("c", KILL_AT - 0.05, KILL_AT + 0.05, ALIVE), 10.5)


def test_a_call_whose_cell_was_stored_before_the_kill_is_not_explained() -> None:
    run = run_with([(KILL_AT, {KILLED})], [])
    assert not _lost_to_a_fault(run, Call("c", 4.0, 4.1, KILLED), stored=4.2)


def test_a_window_explains_calls_started_in_it_before_the_cell_was_stored() -> None:
    run = run_with([], [(3.0, 8.0)])
    assert _lost_to_a_fault(run, Call("c", 7.9, 8.0, ALIVE), stored=9.0)
    assert not _lost_to_a_fault(run, Call("c", 8.1, 8.2, ALIVE), stored=9.0)
    assert not _lost_to_a_fault(run, Call("c", 4.0, 4.1, ALIVE), stored=2.0)


def test_the_stand_in_records_each_calls_cell_and_caller() -> None:
    llm = CountingLLM(latency=0.0, api_key="k").start()
    try:
        prompt = f"cell: cj4/col0 {CALLER}{os.getpid()}\nScore job cj4 on 'col0'."
        response = httpx.post(
            f"{llm.url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": prompt}]},
            headers={"Authorization": "Bearer k"},
            timeout=10,
        )
        assert response.status_code == 200
        [call] = llm.spans()
        assert (call.key, call.pid) == ("cj4/col0", os.getpid())
        assert llm.stats()["per_key"] == {"cj4/col0": 1}
    finally:
        llm.stop()

"""MCP: the SDK's own client drives `onceflow mcp` over stdio, as an agent would."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis as redis_lib
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

from onceflow import Status
from onceflow.keys import queue_name
from tests.acceptance.procs import APP, ROOT, start_worker, wait_for
from tests.conftest import table_snapshot

pytestmark = pytest.mark.slow


def server_params() -> StdioServerParameters:
    """`python -m onceflow.cli mcp` on the test stages; settings only from the environment."""
    return StdioServerParameters(
        command=sys.executable,
        args=["-m", "onceflow.cli", "mcp", "--app", APP],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=str(ROOT),
    )


def is_error(result: Any) -> bool:
    """The tool result's error flag (``is_error`` in SDK 2.x, ``isError`` in 1.x)."""
    return bool(getattr(result, "is_error", getattr(result, "isError", False)))


def payload(result: Any) -> Any:
    """A successful tool result's JSON (its text content)."""
    assert not is_error(result), text(result)
    return json.loads(result.content[0].text)


def text(result: Any) -> str:
    return " ".join(getattr(block, "text", "") for block in result.content)


async def call(session: ClientSession, tool: str, **arguments: Any) -> Any:
    return await session.call_tool(tool, arguments)


def test_agent_lists_tools_enqueues_and_reads_the_request_back(
    runtime: Any, redis_url: str, tmp_path: Path
) -> None:
    async def scenario() -> tuple[dict[str, Any], dict[str, Any]]:
        async with (
            stdio_client(server_params()) as (read, write),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            tools = {tool.name: tool for tool in (await session.list_tools()).tools}
            assert {"enqueue_stage", "get_request", "list_requests", "list_stages"} <= set(tools)

            stages = payload(await call(session, "list_stages"))["stages"]
            noop = next(s for s in stages if s["name"] == "noop")
            assert noop["worker_class"] == "t-default"
            assert "value" in noop["input_schema"]["properties"]

            args = {"workspace_id": "w-mcp", "job_id": "j1", "branch_path": "main",
                    "stage": "noop", "input": {"value": 5}}  # fmt: skip
            first = payload(await call(session, "enqueue_stage", **args))
            assert first["created"] is True and first["status"] == "queued"
            again = payload(await call(session, "enqueue_stage", **args))
            assert (again["request_id"], again["created"]) == (first["request_id"], False)
            # The wake-up went to the worker class's queue, once.
            assert redis_lib.Redis.from_url(redis_url).llen(queue_name("t-default")) == 1

            row = payload(await call(session, "get_request", request_id=first["request_id"]))
            assert (row["stage"], row["input"], row["status"]) == ("noop", {"value": 5}, "queued")
            # With its workspace, the request is found by its key; another's is not found.
            rid = first["request_id"]
            keyed = payload(await call(session, "get_request", request_id=rid,
                                       workspace_id="w-mcp"))  # fmt: skip
            assert keyed == row
            other = await call(session, "get_request", request_id=rid, workspace_id="w-other")
            assert is_error(other) and "NotFound" in text(other), text(other)
            bad = await call(session, "get_request", request_id=rid, workspace_id="")
            assert is_error(bad) and "workspace_id" in text(bad), text(bad)
            listed = payload(await call(session, "list_requests", workspace_id="w-mcp"))
            assert [r["request_id"] for r in listed["requests"]] == [first["request_id"]]
            none = payload(
                await call(session, "list_requests", workspace_id="w-mcp", status=["dead"])
            )
            assert none["requests"] == []

            # A worker runs it; the agent sees it succeed without any browser involved.
            worker = start_worker(tmp_path, "t-default")
            try:

                def succeeded() -> bool:
                    return runtime.flow.queue.get(first["request_id"]).status is Status.SUCCEEDED

                await anyio.to_thread.run_sync(lambda: wait_for(succeeded, what="noop ran"))
            finally:
                worker.stop()
            done = payload(await call(session, "get_request", request_id=first["request_id"]))
            return first, done

    first, done = anyio.run(scenario)
    assert done["status"] == "succeeded"
    assert done["result"]["value"] == 5
    assert runtime.flow.queue.get(first["request_id"]).attempts == 1


def test_bad_input_is_a_tool_error_and_writes_nothing(runtime: Any, redis_url: str) -> None:
    before = table_snapshot(runtime.flow.queue.engine)

    async def scenario() -> list[str]:
        async with (
            stdio_client(server_params()) as (read, write),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            base = {"workspace_id": "w-mcp", "job_id": "j1", "branch_path": "main"}
            errors = []
            for result in [
                await call(session, "enqueue_stage", **base, stage="noop",
                           input={"value": "not a number"}),
                await call(session, "enqueue_stage", **base, stage="no_such_stage", input={}),
                await call(session, "enqueue_stage", workspace_id="", job_id="j1",
                           stage="noop", input={}),
                await call(session, "get_request", request_id="0" * 32),
                await call(session, "list_requests", workspace_id="w-mcp", status=["nope"]),
            ]:  # fmt: skip
                assert is_error(result), text(result)
                errors.append(text(result))
            return errors

    errors = anyio.run(scenario)
    assert "InvalidRequest" in errors[0] and "noop" in errors[0]
    assert "UnknownStage" in errors[1]
    assert "workspace_id" in errors[2]
    assert "NotFound" in errors[3]
    assert "nope" in errors[4]
    assert table_snapshot(runtime.flow.queue.engine) == before == []
    assert redis_lib.Redis.from_url(redis_url).llen(queue_name("t-default")) == 0

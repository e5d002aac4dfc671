"""Attacks on the live-events fan-out and the rate limits, against a real `onceflow api`.

One tenant must not starve the others: 150 event streams of workspace A leave
workspace B's ``/events`` answering ``ready`` and delivering commits (the server
holds ONE Redis pub/sub connection for all of them, counted with ``CLIENT LIST``);
a key past its stream bound, or flooding enqueues, gets 429 while another key is
served (the failed-authentication limit: test_forwarded_and_auth_failures.py). The
hub's own behaviour (refcounted subscriptions, a slow consumer dropped, the per-process
bound, Redis gone) is checked in process on the real Redis.
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import redis as redis_lib
from sqlalchemy import Engine, text

from onceflow.integrations.fastapi import event_hub, hash_key
from onceflow.integrations.fastapi import events as sse
from onceflow.keys import workspace_channel
from onceflow.oplog import new_op_id
from onceflow.settings import Settings
from tests.acceptance.conftest import TEST_ENV, runtime  # noqa: F401 - the fixture
from tests.acceptance.procs import api_server, free_port, wait_for
from tests.acceptance.test_http_api import auth

# An empty table and clean broker queues for every test (the acceptance fixture).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("runtime")]

RUN = secrets.token_hex(3)  # channels are server-wide (not per Redis db): names of this run
WS_A, WS_B, WS_C, WS_D, WS_E = (f"sec-{x}-{RUN}" for x in "abcde")
KEY_A = "of_test_sec_key_a_0123456789abcdef0123"
KEY_B = "of_test_sec_key_b_0123456789abcdef0123"
KEY_C = "of_test_sec_key_c_0123456789abcdef0123"
KEY_D = "of_test_sec_key_d_0123456789abcdef0123"
KEY_E = "of_test_sec_key_e_0123456789abcdef0123"
STREAMS = 150  # more than the 100 connections of redis-py's default pool
RATE = 250  # per key per minute on this server: room for the 150 streams, cheap to flood
AUTH_FAILURES = 5  # per address per minute
OP = {"type": "cell.set", "column": "c", "value": 1}


@pytest.fixture(scope="module")
def api(
    tmp_path_factory: pytest.TempPathFactory, database_url: str, redis_url: str
) -> Iterator[str]:
    """A real `onceflow api` with small bounds; its base URL."""
    env = {
        **TEST_ENV,
        "ONCEFLOW_API_KEYS": json.dumps(
            {
                hash_key(KEY_A): [WS_A],
                hash_key(KEY_B): [WS_B],
                hash_key(KEY_C): [WS_C],
                hash_key(KEY_D): [WS_D],
                hash_key(KEY_E): [WS_E],
            }
        ),
        "ONCEFLOW_API_SSE_KEEPALIVE_SECONDS": "1",
        "ONCEFLOW_API_SSE_MAX_PER_KEY": str(STREAMS),
        "ONCEFLOW_API_SSE_QUEUE_SIZE": "8",
        "ONCEFLOW_API_RATE_LIMIT": f"{RATE}/minute",
        "ONCEFLOW_API_AUTH_FAILURE_LIMIT": f"{AUTH_FAILURES}/minute",
    }
    with api_server(tmp_path_factory.mktemp("sec-api"), env) as (url, proc):
        yield url
    log_text = proc.log()
    for secret in (KEY_A, KEY_B, KEY_C, KEY_D, KEY_E):
        assert secret not in log_text


def subscribed_clients(redis_url: str) -> list[dict[str, Any]]:
    """``CLIENT LIST`` entries SUBSCRIBEd to channels on this run's Redis database (not
    Celery's pattern subscriptions, which a worker of another test may still hold)."""
    r = redis_lib.Redis.from_url(redis_url)
    db = r.connection_pool.connection_kwargs.get("db", 0)
    return [c for c in r.client_list() if int(c.get("db", -1)) == int(db) and int(c.get("sub", 0))]


def numsub(redis_url: str, workspace: str) -> int:
    channel = workspace_channel(workspace)
    return int(dict(redis_lib.Redis.from_url(redis_url).pubsub_numsub(channel))[channel.encode()])


# ----------------------------------------------------------------- SSE streams


class Stream:
    """One open event stream: its events, read by a task."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self.events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.task = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        event = "message"
        try:
            async for line in self.response.aiter_lines():
                if line.startswith("event: "):
                    event = line[len("event: ") :]
                elif line.startswith("data: "):
                    await self.events.put((event, json.loads(line[len("data: ") :])))
        except httpx.HTTPError:
            pass
        await self.events.put(("end", None))

    async def next(self, kind: str, timeout: float = 20) -> Any:
        async with asyncio.timeout(timeout):
            while True:
                got, value = await self.events.get()
                if got == kind:
                    return value
                if got == "end":
                    raise AssertionError(f"the stream ended before a {kind} event")


@asynccontextmanager
async def streams_client(api: str) -> AsyncIterator[httpx.AsyncClient]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    timeout = httpx.Timeout(20, read=30)
    async with httpx.AsyncClient(base_url=api, limits=limits, timeout=timeout) as client:
        yield client


async def open_stream(client: httpx.AsyncClient, ws: str, key: str) -> Stream | httpx.Response:
    """An open stream (200), or the refusal (its body read)."""
    request = client.build_request("GET", f"/v1/workspaces/{ws}/events", headers=auth(key))
    response = await client.send(request, stream=True)
    if response.status_code != 200:
        await response.aread()
        await response.aclose()
        return response
    return Stream(response)


def test_150_streams_of_one_workspace_do_not_silence_another(api: str, redis_url: str) -> None:
    async def scenario() -> None:
        async with streams_client(api) as client:
            opened = await asyncio.gather(
                *(open_stream(client, WS_A, KEY_A) for _ in range(STREAMS))
            )
            refused = [r.status_code for r in opened if isinstance(r, httpx.Response)]
            assert refused == [], f"{len(refused)} of {STREAMS} streams refused: {set(refused)}"
            streams = [s for s in opened if isinstance(s, Stream)]
            await asyncio.gather(*(s.next("ready") for s in streams))

            # Key A is at its bound: its next stream is refused, 429, and nothing else is.
            over = await open_stream(client, WS_A, KEY_A)
            assert isinstance(over, httpx.Response) and over.status_code == 429
            assert over.json()["code"] == "rate_limited"
            assert int(over.headers["retry-after"]) >= 1
            assert over.headers["ratelimit-remaining"] == "0"

            # Workspace B is served: ready, then the commit of an op written after ready.
            b = await open_stream(client, WS_B, KEY_B)
            assert isinstance(b, Stream), b.status_code
            assert (await b.next("ready"))["workspace_id"] == WS_B
            op_id = new_op_id()
            written = await client.post(
                f"/v1/workspaces/{WS_B}/sub-docs/doc/ops",
                json={"op": OP, "op_id": op_id},
                headers=auth(KEY_B),
            )
            assert written.status_code == 201, written.text
            commit = await b.next("commit")
            assert commit["op_id"] == op_id and commit["workspace_id"] == WS_B

            # One Redis pub/sub connection for the 151 streams of two workspaces.
            subscribed = subscribed_clients(redis_url)
            assert len(subscribed) == 1, subscribed
            assert subscribed[0]["name"] == sse.CLIENT_NAME and int(subscribed[0]["sub"]) == 2
            assert numsub(redis_url, WS_A) == 1 and numsub(redis_url, WS_B) == 1

            for stream in [*streams, b]:
                await stream.response.aclose()
                stream.task.cancel()

    asyncio.run(scenario())
    # Every client went away: the hub unsubscribed both channels (the connection stays).
    wait_for(lambda: numsub(redis_url, WS_A) == 0 and numsub(redis_url, WS_B) == 0,
             what="the hub to unsubscribe")  # fmt: skip


def test_redis_dropping_the_hub_ends_streams_and_the_hub_recovers(api: str, redis_url: str) -> None:
    async def scenario() -> None:
        async with streams_client(api) as client:
            first = await open_stream(client, WS_B, KEY_B)
            assert isinstance(first, Stream)
            await first.next("ready")
            [hub] = subscribed_clients(redis_url)
            # What a Redis restart does to the server's connection.
            redis_lib.Redis.from_url(redis_url).client_kill_filter(_id=hub["id"])
            await first.next("end")  # the stream ends: the client resyncs with ops?since=

            again = await open_stream(client, WS_B, KEY_B)
            assert isinstance(again, Stream), again.status_code
            await again.next("ready")
            op_id = new_op_id()
            written = await client.post(
                f"/v1/workspaces/{WS_B}/sub-docs/doc/ops",
                json={"op": OP, "op_id": op_id},
                headers=auth(KEY_B),
            )
            assert written.status_code == 201
            assert (await again.next("commit"))["op_id"] == op_id
            [now] = subscribed_clients(redis_url)
            assert now["id"] != hub["id"]
            await again.response.aclose()
            again.task.cancel()

    asyncio.run(scenario())


def test_a_client_that_stops_reading_is_disconnected_not_buffered(api: str, redis_url: str) -> None:
    url = urlsplit(api)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fill up fast
    sock.settimeout(30)
    sock.connect((url.hostname or "127.0.0.1", url.port or 80))
    try:
        request = (
            f"GET /v1/workspaces/{WS_B}/events HTTP/1.1\r\nHost: {url.netloc}\r\n"
            f"Authorization: Bearer {KEY_B}\r\n\r\n"
        )
        sock.sendall(request.encode())
        head = b""
        while b"event: ready" not in head:
            chunk = sock.recv(4096)
            assert chunk, head
            head += chunk
        assert head.startswith(b"HTTP/1.1 200")
        [hub] = subscribed_clients(redis_url)
        # The client reads no more; commits keep coming on its channel.
        publisher = redis_lib.Redis.from_url(redis_url)
        pad = json.dumps({"kind": "commit", "pad": "x" * 65536})
        channel = workspace_channel(WS_B)
        published = 0
        while numsub(redis_url, WS_B) and published < 2000:  # bounded: 2000 x 64 KiB
            publisher.publish(channel, pad)
            published += 1
        assert numsub(redis_url, WS_B) == 0, f"still subscribed after {published} messages"
        # The server dropped the stream (its queue of 8 was full): Redis did not drop the hub.
        assert hub["id"] in [c["id"] for c in publisher.client_list()]
        print(f"slow client dropped after {published} messages of 64 KiB")
        # ...and closed the connection: what was sent before can be read, then EOF.
        while sock.recv(1 << 20):
            pass
    finally:
        sock.close()


# ----------------------------------------------------------------- rate limits


def test_a_key_flooding_enqueues_gets_429_while_another_key_is_served(
    api: str, engine: Engine
) -> None:
    body = {"stage": "noop", "job_id": "flood", "input": {"value": 1}}
    with httpx.Client(base_url=api, timeout=10) as http:
        statuses = []
        for _ in range(4 * RATE):  # bounded: the limit is RATE per minute
            r = http.post(f"/v1/workspaces/{WS_C}/requests", json=body, headers=auth(KEY_C))
            statuses.append(r.status_code)
            if r.status_code == 429:
                break
        assert statuses[-1] == 429, f"key C was never limited: {sorted(set(statuses))}"
        assert set(statuses[:-1]) <= {200, 201}
        refused = r
        assert refused.json() == {"detail": refused.json()["detail"], "code": "rate_limited"}
        assert 1 <= int(refused.headers["retry-after"]) <= 60
        assert refused.headers["ratelimit-limit"] == str(RATE)
        assert refused.headers["ratelimit-remaining"] == "0"
        assert int(refused.headers["ratelimit-reset"]) >= 1

        # While key C is refused, key D enqueues (and reads) as usual.
        served = http.post(f"/v1/workspaces/{WS_D}/requests", json=body, headers=auth(KEY_D))
        assert served.status_code == 201, served.text
        again = http.post(f"/v1/workspaces/{WS_C}/requests", json=body, headers=auth(KEY_C))
        assert again.status_code == 429
        # A refused call changes nothing: key C's one request, key D's one.
        with engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT workspace_id, count(*) FROM workspace_process_requests "
                    "GROUP BY 1 ORDER BY 1"
                )
            ).all()
        assert [tuple(row) for row in rows] == [(WS_C, 1), (WS_D, 1)]


def test_requests_outside_a_keys_scope_use_its_budget_and_get_429_past_it(
    api: str, engine: Engine
) -> None:
    """A 403 (another workspace) is charged to the key like any request (once
    the scope was checked before the charge, so 403s were never limited and cost nothing)."""
    body = {"stage": "noop", "job_id": "out-of-scope", "input": {"value": 1}}
    with httpx.Client(base_url=api, timeout=10) as http:
        statuses = []
        began = time.monotonic()
        for _ in range(2 * RATE):  # bounded: the limit is RATE per minute
            r = http.get(f"/v1/workspaces/{WS_A}/counts", headers=auth(KEY_E))
            statuses.append(r.status_code)
            if r.status_code == 429:
                break
        # A sliding window: the budget refills by RATE per minute while the loop runs (a
        # slow machine's loop takes seconds), never more.
        refill = math.ceil(RATE * (time.monotonic() - began) / 60)
        assert statuses[-1] == 429, f"out-of-scope requests never limited: {Counter(statuses)}"
        assert set(statuses[:-1]) == {403} and len(statuses) - 1 <= RATE + refill
        assert r.json()["code"] == "rate_limited" and int(r.headers["retry-after"]) >= 1
        # The budget is spent: in scope too, and an out-of-scope body is not read.
        assert http.get(f"/v1/workspaces/{WS_E}/counts", headers=auth(KEY_E)).status_code == 429
        posted = http.post(f"/v1/workspaces/{WS_A}/requests", json=body, headers=auth(KEY_E))
        assert posted.status_code == 429
        # The 403s were the key's, not failed authentications of this address: another
        # key from here is served.
        assert http.get(f"/v1/workspaces/{WS_D}/counts", headers=auth(KEY_D)).status_code == 200
    with engine.connect() as conn:
        count = conn.execute(text("SELECT count(*) FROM workspace_process_requests")).scalar()
    assert count == 0


# ------------------------------------------------------- the hub, in process


def test_hub_refcounts_subscriptions_and_drops_a_slow_consumer(redis_url: str) -> None:
    ws = f"sec-hub-{RUN}"
    channel, other = workspace_channel(ws), workspace_channel(f"{ws}-2")
    publisher = redis_lib.Redis.from_url(redis_url)

    async def scenario() -> None:
        hub = sse.EventHub(redis_url, max_streams=10, max_per_key=3, queue_size=4)
        try:
            fast = await hub.open(channel, "k1")
            slow = await hub.open(channel, "k2")
            assert numsub(redis_url, ws) == 1  # two listeners, one subscription
            with pytest.raises(sse.StreamLimit):
                for _ in range(3):
                    await hub.open(other, "k1")  # k1's third opens, its fourth is refused
            assert hub.streams_of("k1") == 3
            # The slow listener never reads: past its 4 queued messages it is dropped.
            for n in range(6):
                publisher.publish(channel, json.dumps({"kind": "commit", "n": n}))
                assert json.loads(await fast.next(5) or b"{}")["n"] == n
            assert slow.ended == "slow" and slow.dropped.is_set()
            with pytest.raises(EOFError):
                await slow.next(1)
            assert hub.streams_of("k2") == 0  # its slot is free at once
            await hub.close(slow)  # idempotent
            assert hub.open_streams == 3
            publisher.publish(channel, json.dumps({"kind": "commit", "n": 6}))
            assert json.loads(await fast.next(5) or b"{}")["n"] == 6
        finally:
            await hub.aclose()

    asyncio.run(scenario())
    wait_for(lambda: numsub(redis_url, ws) == 0, what="the subscription to go")


def test_a_message_for_many_streams_leaves_the_loop_free_between_slices(redis_url: str) -> None:
    """A commit followed by thousands of streams is handed out a slice per pass of the event
    loop: a request arriving meanwhile is served between slices, not after the whole fan-out
    — and every stream still gets every message, in order."""
    ws = f"sec-fan-{RUN}"
    channel = workspace_channel(ws)
    publisher = redis_lib.Redis.from_url(redis_url)
    streams = 3 * event_hub.FAN_OUT_SLICE + 1

    async def scenario() -> None:
        hub = sse.EventHub(redis_url, max_streams=streams, max_per_key=streams)
        try:
            listeners = [await hub.open(channel, "k1") for _ in range(streams)]
            seen: list[int] = []  # per pass of the loop: the streams holding message 0

            async def other_request() -> None:
                while not seen or seen[-1] < streams:
                    seen.append(sum(1 for s in listeners if s.queue.qsize()))
                    await asyncio.sleep(0)

            watcher = asyncio.create_task(other_request())
            await asyncio.sleep(0)  # it runs before the message comes
            for n in range(3):
                publisher.publish(channel, json.dumps({"kind": "commit", "n": n}))
            await asyncio.wait_for(watcher, 10)
            between = [k for k in seen if 0 < k < streams]
            assert between, f"the fan-out held the loop: {sorted(set(seen))}"
            assert set(between) <= {event_hub.FAN_OUT_SLICE * i for i in range(1, 4)}
            for listener in listeners:
                got = [json.loads(await listener.next(5) or b"{}")["n"] for _ in range(3)]
                assert got == [0, 1, 2]
        finally:
            await hub.aclose()

    asyncio.run(scenario())


def test_a_stream_joining_as_the_last_slow_one_is_dropped_still_gets_commits(
    redis_url: str,
) -> None:
    """The dropped stream's UNSUBSCRIBE runs in a task: a stream that subscribed before it
    ran was `ready` and then silenced."""
    ws = f"sec-race-{RUN}"
    channel = workspace_channel(ws)
    publisher = redis_lib.Redis.from_url(redis_url)

    async def scenario() -> None:
        hub = sse.EventHub(redis_url, queue_size=1)
        try:
            slow = await hub.open(channel, "k1")
            # Two messages reach the reader while the stream reads none: it is dropped, the
            # channel left, and its UNSUBSCRIBE spawned — not yet sent.
            for _ in range(2):
                link = hub._links[""]  # one server: one link
                message = {"type": "message", "channel": channel.encode(), "data": b"{}"}
                await hub._dispatch(link, message)
            assert slow.ended == "slow"
            fresh = await hub.open(channel, "k2")  # subscribed, confirmed: `ready`
            await asyncio.gather(*list(hub._tasks))  # the spawned UNSUBSCRIBE has run
            assert numsub(redis_url, ws) == 1
            publisher.publish(channel, json.dumps({"kind": "commit", "n": 2}))
            assert json.loads(await fresh.next(5) or b"{}")["n"] == 2
        finally:
            await hub.aclose()

    asyncio.run(scenario())


def test_hub_bounds_streams_per_process_and_answers_503_without_redis(redis_url: str) -> None:
    async def scenario() -> None:
        hub = sse.EventHub(redis_url, max_streams=2, max_per_key=10)
        try:
            a = await hub.open(workspace_channel(f"sec-x-{RUN}"), "k1")
            b = await hub.open(workspace_channel(f"sec-y-{RUN}"), "k2")
            with pytest.raises(sse.StreamLimit):
                await hub.open(workspace_channel(f"sec-z-{RUN}"), "k3")  # another key too
            await hub.close(a)
            c = await hub.open(workspace_channel(f"sec-z-{RUN}"), "k3")
            await hub.close(b)
            await hub.close(c)
            assert hub.open_streams == 0
        finally:
            await hub.aclose()
        nowhere = sse.EventHub(f"redis://127.0.0.1:{free_port()}/0")
        with pytest.raises(sse.HubUnavailable):
            await nowhere.open(workspace_channel(f"sec-x-{RUN}"), "k1")
        answer = await sse.event_stream(nowhere, f"sec-x-{RUN}", "k1", 1.0)
        assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
        assert json.loads(bytes(answer.body))["code"] == "unavailable"
        assert nowhere.open_streams == 0 and nowhere.streams_of("k1") == 0
        await nowhere.aclose()

    asyncio.run(scenario())


def test_shared_rate_limit_storage_counts_across_processes(redis_url: str) -> None:
    """Two limiters on one Redis (as two API processes would be) share a key's budget."""
    from starlette.requests import Request

    from onceflow.integrations.fastapi.auth import Principal
    from onceflow.integrations.fastapi.ratelimit import KEY_PREFIX, RateLimited, RateLimits

    key_id = f"shared-{RUN}"
    principal = Principal(key_id=key_id, workspaces=frozenset({"w"}), worker_classes=frozenset())
    request = Request({"type": "http", "client": ("192.0.2.1", 1234), "headers": []})
    r = redis_lib.Redis.from_url(redis_url)

    async def scenario() -> list[bool]:
        one, two = (
            RateLimits.from_settings(
                Settings(api_rate_limit="3/minute", api_rate_limit_storage=redis_url)
            )
            for _ in range(2)
        )
        served = []
        for limiter in (one, two, one, two):
            try:
                await limiter.authorize(request, lambda: principal, lambda _: None)
                served.append(True)
            except RateLimited as exc:
                assert exc.response().status_code == 429
                served.append(False)
        return served

    try:
        assert asyncio.run(scenario()) == [True, True, True, False]
        assert any(key_id.encode() in k for k in r.scan_iter(f"{KEY_PREFIX}*"))
    finally:
        for k in r.scan_iter(f"{KEY_PREFIX}*{key_id}*"):
            r.delete(k)


def test_concurrent_requests_on_a_shared_storage_get_no_more_than_the_limit(
    redis_url: str,
) -> None:
    """50 requests of one key at once, counted in Redis: exactly the limit is served (a
    test-then-hit across round trips once served all 50)."""
    from starlette.requests import Request

    from onceflow.integrations.fastapi.auth import Principal
    from onceflow.integrations.fastapi.ratelimit import KEY_PREFIX, RateLimited, RateLimits

    key_id = f"burst-{RUN}"
    principal = Principal(key_id=key_id, workspaces=frozenset({"w"}), worker_classes=frozenset())
    request = Request({"type": "http", "client": ("192.0.2.2", 1234), "headers": []})
    r = redis_lib.Redis.from_url(redis_url)
    limits = RateLimits.from_settings(
        Settings(api_rate_limit="5/minute", api_rate_limit_storage=redis_url)
    )

    async def one() -> bool:
        try:
            await limits.authorize(request, lambda: principal, lambda _: None)
            return True
        except RateLimited:
            return False

    async def scenario() -> list[bool]:
        return list(await asyncio.gather(*(one() for _ in range(50))))

    try:
        assert sum(asyncio.run(scenario())) == 5
    finally:
        for k in r.scan_iter(f"{KEY_PREFIX}*{key_id}*"):
            r.delete(k)

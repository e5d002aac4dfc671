"""The browser SDK's WorkspaceClient in real headless Chromium against a real `onceflow api`.

Each test runs in a fresh browser context (its own IndexedDB) with pages at the API's origin
importing ``/sdk/index.js``: a reload while an op is in flight replays it under the same id
and it is applied once; ops applied offline stay in the outbox and drain in order once
online; two tabs of one outbox namespace send each op once (one holds the Web Lock), and without
Web Locks both drain it and every op is still applied once; the outbox never reuses a seq and
deletes only the op it was asked to; a connection closed under the client is opened again;
a subscriber sees commits live and, after its stream breaks, catches up on the ones
it missed, each once and in order; every op carries its base clock; bad input is refused.

The subscriber's stream is broken for real: its tab talks to the API through a TCP relay
(:class:`Relay`) that the test cuts and holds down, then lets through again. (Chromium's
offline emulation fails new requests but leaves an open response stream running.)
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
from sqlalchemy import Engine, text

from tests.browser.conftest import SDK_API_KEY, open_tab

pytestmark = pytest.mark.slow

W1, W2 = "sdk-w1", "sdk-w2"
DEADLINE_MS = 10_000


def page_html(workspace: str, client_name: str, web_locks: bool = True) -> str:
    """A page that makes `window.client` (started: it replays its outbox) and logs its events.

    ``web_locks=False`` hides ``navigator.locks`` (as in an insecure context, where IndexedDB
    still exists)."""
    options = json.dumps(
        {"apiKey": SDK_API_KEY, "workspaceId": workspace, "clientName": client_name}
    )
    no_locks = "Object.defineProperty(navigator, 'locks', {value: undefined, configurable: true});"
    hide = "" if web_locks else no_locks
    return f"""<!doctype html><meta charset="utf-8"><title>sdk</title>
<script type="module">
  {hide}
  const sdk = await import("/sdk/index.js");
  window.sdk = sdk;
  window.applied = []; window.refused = []; window.commits = []; window.answers = [];
  window.client = new sdk.WorkspaceClient({options});
  client.on("applied", (d) => applied.push(d));
  client.on("refused", (d) => refused.push({{opId: d.opId, status: d.error.status}}));
  window.streamStates = []; client.on("stream", (d) => streamStates.push(d.connected));
  await client.start();
  window.ready = true;
</script>"""


def new_tab(
    context: Any, base_url: str, workspace: str, client_name: str, name: str, web_locks: bool = True
) -> Any:
    page = open_tab(context, base_url, page_html(workspace, client_name, web_locks), name=name)
    page.wait_for_function("window.ready === true", timeout=DEADLINE_MS)
    return page


@pytest.fixture()
def context(browser: Any) -> Iterator[Any]:
    ctx = browser.new_context()
    try:
        yield ctx
    finally:
        ctx.close()


def op_rows(engine: Engine, workspace: str) -> list[dict[str, Any]]:
    query = text(
        "SELECT sub_doc, op_id, clock, payload, committed_at FROM workspace_sub_doc_ops "
        "WHERE workspace_id = :w ORDER BY committed_at, clock"
    )
    with engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(query, {"w": workspace})]


def doc_clock(engine: Engine, workspace: str, sub_doc: str) -> int:
    query = text("SELECT clock FROM workspace_sub_docs WHERE workspace_id = :w AND sub_doc = :s")
    with engine.connect() as conn:
        return int(conn.execute(query, {"w": workspace, "s": sub_doc}).scalar_one())


def op_bodies(page: Any) -> list[dict[str, Any]]:
    """Collects the JSON body of every op POST the page sends (the list fills as it goes)."""
    bodies: list[dict[str, Any]] = []

    def seen(request: Any) -> None:
        if request.method == "POST" and "/ops" in request.url:
            bodies.append(json.loads(request.post_data))

    page.on("request", seen)
    return bodies


def test_reload_while_an_op_is_in_flight_replays_it_once(
    sdk_api: tuple[str, Any], context: Any, clean_db: Engine
) -> None:
    base_url, _ = sdk_api
    page = new_tab(context, base_url, W1, "reload", "reload")
    bodies = op_bodies(page)
    ops_url = f"{base_url}/v1/workspaces/{W1}/sub-docs/doc/ops"

    reloaded = False

    def reach_server_then_cut(route: Any) -> None:
        if reloaded:
            route.continue_()
            return
        route.fetch()  # the server commits the op...
        route.abort()  # ...and its answer never reaches the tab (retries neither, until reload)

    page.route(ops_url, reach_server_then_cut)
    with page.expect_event("requestfailed", timeout=DEADLINE_MS):
        page.evaluate(
            "() => { client.applyOp('doc', {type: 'cell.set', column: 'c', value: 1})"
            ".catch(() => {}); }"
        )
    first = bodies[0]
    [row] = op_rows(clean_db, W1)
    assert row["op_id"] == first["op_id"] and row["clock"] == 1
    assert page.evaluate("client.pending().then((p) => p.map((e) => e.opId))") == [first["op_id"]]

    page.reload()  # the op is still in the outbox: the new page load replays it
    reloaded = True
    page.wait_for_function("window.ready === true && applied.length === 1", timeout=DEADLINE_MS)
    [answer] = page.evaluate("applied")
    assert answer["opId"] == first["op_id"]
    assert answer["duplicate"] is True and answer["clock"] == 1 and answer["applied"] is True
    assert all(body == first for body in bodies)  # same id, op and base clock every time
    assert [r["op_id"] for r in op_rows(clean_db, W1)] == [first["op_id"]]
    assert doc_clock(clean_db, W1, "doc") == 1  # applied once: the clock did not move
    assert page.evaluate("client.pending().then((p) => p.length)") == 0


def test_offline_ops_stay_in_the_outbox_and_drain_in_order_online(
    sdk_api: tuple[str, Any], context: Any, clean_db: Engine
) -> None:
    base_url, _ = sdk_api
    page = new_tab(context, base_url, W1, "offline", "offline")
    bodies = op_bodies(page)
    page.evaluate("Promise.all([client.read('x'), client.read('y')])")  # clocks known: 0, 0
    context.set_offline(True)
    docs = ["x", "y", "x", "y", "x"]
    page.evaluate(
        """(docs) => docs.forEach((doc, i) => client.applyOp(doc, {type: 'cell.set',
             column: 'c' + i, value: i}).then((a) => answers.push(a), (e) => answers.push(e)))""",
        docs,
    )
    page.wait_for_function(
        "client.pending().then((p) => p.length === 5)", timeout=DEADLINE_MS, polling=100
    )
    pending = page.evaluate("client.pending()")
    assert [e["subDoc"] for e in pending] == docs
    assert [e["op"]["value"] for e in pending] == [0, 1, 2, 3, 4]
    assert op_rows(clean_db, W1) == []  # nothing reached the server

    context.set_offline(False)
    page.wait_for_function("answers.length === 5", timeout=DEADLINE_MS)
    answers = page.evaluate("answers")
    minted = [e["opId"] for e in pending]
    rows = op_rows(clean_db, W1)
    assert [r["op_id"] for r in rows] == minted  # committed in the minted order
    assert [(r["sub_doc"], r["clock"]) for r in rows] == [
        ("x", 1), ("y", 1), ("x", 2), ("y", 2), ("x", 3)
    ]  # fmt: skip
    assert sorted(a["opId"] for a in answers) == sorted(minted)
    assert all(a["applied"] and not a["duplicate"] for a in answers)
    assert page.evaluate("client.pending().then((p) => p.length)") == 0
    # every attempt of an op carried the base clock it was minted with
    assert {b["op_id"]: b["base_clock"] for b in bodies} == {
        e["opId"]: e["baseClock"] for e in pending
    }
    assert all(b["base_clock"] == 0 for b in bodies)


def test_base_clock_is_sent_with_every_op(
    sdk_api: tuple[str, Any], context: Any, clean_db: Engine
) -> None:
    base_url, _ = sdk_api
    page = new_tab(context, base_url, W1, "base", "base")
    bodies = op_bodies(page)
    other = new_tab(context, base_url, W1, "base-other", "base-other")
    script = "(v) => client.applyOp('b', {type: 'cell.set', column: 'c', value: v})"
    page.evaluate("client.read('b')")  # a tab reads (or follows) a sub-doc before editing it
    page.evaluate(script, 1)  # the read's clock: 0
    page.evaluate(script, 2)  # the answer's clock: 1
    other.evaluate(script, 3)  # another client moves the sub-doc to 3
    page.evaluate(script, 4)  # this one still knows 2
    page.evaluate("client.read('b')")
    page.evaluate(script, 5)  # after a read: 4
    page.evaluate("client.applyOp('b', {type: 'cell.set', column: 'c', value: 6}, {baseClock: 1})")
    assert [(b["op"]["value"], b["base_clock"]) for b in bodies] == [
        (1, 0), (2, 1), (4, 2), (5, 4), (6, 1)
    ]  # fmt: skip
    assert doc_clock(clean_db, W1, "b") == 6


def test_bad_input_gets_a_clear_error_and_changes_nothing(
    sdk_api: tuple[str, Any], context: Any, clean_db: Engine
) -> None:
    base_url, _ = sdk_api
    page = new_tab(context, base_url, W1, "bad", "bad")
    errors = page.evaluate(
        """async () => {
          const out = [];
          for (const [doc, op] of [['', {type: 'cell.set', column: 'c', value: 1}],
                                   ['d', 'cell.set'], ['d', null], ['d', [1]], ['d', {}]]) {
            try { await client.applyOp(doc, op); out.push('no error'); }
            catch (e) { out.push(e.name + ': ' + e.message); }
          }
          for (const op of [{type: 'no.such.op'}, {type: 'cell.set', column: 'c', bogus: 1}]) {
            try { await client.applyOp('d', op); out.push('no error'); }
            catch (e) { out.push(e.name + ' ' + e.status); }
          }
          return out;
        }"""
    )
    assert errors[0] == "TypeError: subDoc must be a non-empty string"
    assert all(e.startswith("TypeError: op must be an object") for e in errors[1:5]), errors
    assert [e.split(" ")[0] for e in errors[5:]] == ["HttpError", "HttpError"], errors
    assert all(400 <= int(e.split(" ")[1]) < 500 for e in errors[5:]), errors
    assert page.evaluate("client.pending().then((p) => p.length)") == 0
    assert page.evaluate("refused.length") == 2
    assert op_rows(clean_db, W1) == []


def test_two_tabs_of_one_namespace_send_each_op_once(
    sdk_api: tuple[str, Any], context: Any, clean_db: Engine
) -> None:
    base_url, _ = sdk_api
    first = new_tab(context, base_url, W1, "shared", "shared-1")
    second = new_tab(context, base_url, W1, "shared", "shared-2")
    sent = {"shared-1": op_bodies(first), "shared-2": op_bodies(second)}
    script = """(n) => Promise.all(Array.from({length: n}, (_, i) => client.applyOp('t',
                  {type: 'cell.set', column: 'c' + i, value: i})))"""
    answers = first.evaluate(script, 3) + second.evaluate(script, 3)  # every promise settles
    ids = [a["opId"] for a in answers]
    assert sorted(r["op_id"] for r in op_rows(clean_db, W1)) == sorted(ids)
    assert not any(a["duplicate"] for a in answers)
    # one tab holds the namespace's Web Lock and sends the ops of both, each once
    senders = [name for name, bodies in sent.items() if bodies]
    assert senders == ["shared-1"]
    assert sorted(b["op_id"] for b in sent["shared-1"]) == sorted(ids)


def test_without_web_locks_two_tabs_of_one_namespace_settle_every_op_once(
    sdk_api: tuple[str, Any], context: Any, clean_db: Engine
) -> None:
    base_url, _ = sdk_api
    tabs = [new_tab(context, base_url, W1, "nolock", f"nl-{i}", web_locks=False) for i in (1, 2)]
    assert tabs[0].evaluate("navigator.locks === undefined")
    script = """(n) => { window.done = Promise.all(Array.from({length: n}, (_, i) =>
                  client.applyOp('t', {type: 'cell.set', column: 'c' + i, value: i}))); }"""
    # both tabs drain the shared outbox at once: an op may be sent by both (the second send is
    # answered as a replay), and every promise settles
    for tab in tabs:
        tab.evaluate(script, 4)
    answers = [a for tab in tabs for a in tab.evaluate("done")]
    ids = [a["opId"] for a in answers]
    assert len(set(ids)) == 8
    assert sorted(r["op_id"] for r in op_rows(clean_db, W1)) == sorted(ids)  # each applied once
    assert doc_clock(clean_db, W1, "t") == 8
    for tab in tabs:
        tab.wait_for_function("client.pending().then((p) => p.length === 0)", timeout=DEADLINE_MS)


def test_outbox_seq_is_never_reused_and_a_late_delete_spares_a_newer_op(
    sdk_api: tuple[str, Any], context: Any
) -> None:
    base_url, _ = sdk_api
    first = new_tab(context, base_url, W1, "seq", "seq-1")
    second = new_tab(context, base_url, W1, "seq", "seq-2")
    ns = "probe@nowhere"  # no client drains it: the test drives two tabs' outboxes by hand
    setup = "() => { window.box = new sdk.IndexedDbOutbox(); }"
    first.evaluate(setup)
    second.evaluate(setup)
    add = "([ns, opId]) => box.add(ns, {opId, subDoc: 'd', op: {type: 'x'}, baseClock: null})"
    delete = "([ns, seq, opId]) => box.delete(ns, seq, opId)"
    a = first.evaluate(add, [ns, "op_a"])
    first.evaluate(delete, [ns, a["seq"], "op_a"])  # answered: the namespace is empty now
    b = second.evaluate(add, [ns, "op_b"])
    assert b["seq"] > a["seq"]  # not reused after the namespace emptied
    assert first.evaluate("(ns) => box.list(ns)", ns) == [b]  # op_a was deleted
    # a tab that also sent op_a (no Web Lock) deletes it late: the newer op stays
    assert first.evaluate(delete, [ns, a["seq"], "op_a"]) is False
    assert first.evaluate(delete, [ns, b["seq"], "op_other"]) is False
    assert second.evaluate("(ns) => box.list(ns)", ns) == [b]


def test_an_outbox_connection_closed_under_the_client_is_opened_again(
    sdk_api: tuple[str, Any], context: Any, clean_db: Engine
) -> None:
    base_url, _ = sdk_api
    page = new_tab(context, base_url, W1, "closed", "closed")
    answer = page.evaluate(
        """async () => {
          (await client.outbox.open()).close();  // the browser closed the connection
          return client.applyOp('z', {type: 'cell.set', column: 'c', value: 1});
        }"""
    )
    assert answer["applied"] is True
    assert [r["op_id"] for r in op_rows(clean_db, W1)] == [answer["opId"]]
    assert page.evaluate("client.pending().then((p) => p.length)") == 0


class Relay:
    """A TCP relay to ``upstream`` on a free local port; :meth:`cut` breaks every connection
    and refuses new ones until :meth:`restore` (a network outage between a tab and the API)."""

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self.target = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.down = False
        self.sockets: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            if self.down:
                client.close()
                continue
            upstream = socket.create_connection(self.target)
            with self.lock:
                self.sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        self.down = True
        with self.lock:
            sockets, self.sockets = self.sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def restore(self) -> None:
        self.down = False

    def close(self) -> None:
        self.cut()
        self.server.close()


def test_a_subscriber_sees_commits_live_and_catches_up_after_its_stream_breaks(
    sdk_api: tuple[str, Any], context: Any, clean_db: Engine
) -> None:
    base_url, _ = sdk_api
    writer = new_tab(context, base_url, W2, "writer", "writer")
    relay = Relay(base_url)
    try:
        reader = new_tab(context, relay.url, W2, "reader", "reader")
        reader.evaluate(
            "() => { window.unsubscribe = client.subscribe('live', (c) => commits.push(c), "
            "{since: 0}); }"
        )
        reader.wait_for_function("streamStates.length === 1", timeout=DEADLINE_MS)
        write = "(v) => client.applyOp('live', {type: 'cell.set', column: 'c', value: v})"
        writer.evaluate(write, 1)
        writer.evaluate(write, 2)
        reader.wait_for_function("commits.length === 2", timeout=DEADLINE_MS)

        relay.cut()  # the reader's stream breaks, and it cannot reconnect
        reader.wait_for_function("streamStates.length === 2", timeout=DEADLINE_MS)
        for value in (3, 4, 5):
            writer.evaluate(write, value)  # committed while the reader is cut off
        assert reader.evaluate("commits.length") == 2
        relay.restore()
        reader.evaluate("client.retryNow()")  # a reconnect now, rather than after its backoff
        reader.wait_for_function("commits.length >= 5", timeout=DEADLINE_MS)
        writer.evaluate(write, 6)  # and live again after the reconnect
        reader.wait_for_function("commits.length >= 6", timeout=DEADLINE_MS)
        commits = reader.evaluate("commits")
        assert [c["clock"] for c in commits] == [1, 2, 3, 4, 5, 6]  # each once, in order
        assert [c["payload"]["value"] for c in commits] == [1, 2, 3, 4, 5, 6]
        assert reader.evaluate("streamStates") == [True, False, True]
        ids = [r["op_id"] for r in op_rows(clean_db, W2)]
        assert [c["opId"] for c in commits] == ids
        reader.evaluate("unsubscribe()")
    finally:
        relay.close()

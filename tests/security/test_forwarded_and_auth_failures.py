"""The failed-authentication limit slows key guessing, and locks no valid key out.

Against real `onceflow api` processes, from several loopback source addresses
(127.0.0.x: a client bound to its own address, as separate hosts would be). Before:
``onceflow api`` trusted ``X-Forwarded-For`` from 127.0.0.1 whatever the operator set,
so a local client escaped the limit by naming a new address with each guess, and locked
any address out by naming it; and past the limit every request from an address was
refused, valid keys included — behind a proxy the server did not trust, every tenant
shares the proxy's address, so one client without a key locked every tenant out.

Now the limit counts and refuses unknown keys only (a valid key is limited by its own
per-key budget), and forwarded headers are read only from the proxies the operator names
(``--forwarded-allow-ips`` / ``$FORWARDED_ALLOW_IPS``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from onceflow.integrations.fastapi import hash_key
from tests.acceptance.conftest import TEST_ENV
from tests.acceptance.procs import api_server
from tests.acceptance.test_http_api import auth

pytestmark = pytest.mark.slow

KEY = "of_test_fwd_key_0123456789abcdef0123"
WS = "w-fwd"
LIMIT = 5  # failed authentications per address per minute
URL = f"/v1/workspaces/{WS}/counts"


def _server(tmp: pytest.TempPathFactory, name: str, **extra: str) -> Iterator[str]:
    env = {
        **TEST_ENV,
        "ONCEFLOW_API_KEYS": json.dumps({hash_key(KEY): [WS]}),
        "ONCEFLOW_API_AUTH_FAILURE_LIMIT": f"{LIMIT}/minute",
        "ONCEFLOW_API_RATE_LIMIT": "",
        **extra,
    }
    with api_server(tmp.mktemp(name), env) as (url, _):
        yield url


@pytest.fixture(scope="module")
def direct(
    tmp_path_factory: pytest.TempPathFactory, database_url: str, redis_url: str
) -> Iterator[str]:
    """`onceflow api` as it starts by default: no proxy named."""
    yield from _server(tmp_path_factory, "direct")


@pytest.fixture(scope="module")
def proxied(
    tmp_path_factory: pytest.TempPathFactory, database_url: str, redis_url: str
) -> Iterator[str]:
    """`onceflow api` behind a proxy the operator named (this test's client is the proxy)."""
    yield from _server(tmp_path_factory, "proxied", FORWARDED_ALLOW_IPS="127.0.0.1")


def client(base_url: str, source: str = "127.0.0.1") -> httpx.Client:
    """A client connecting from ``source`` (any 127.0.0.x is this host's loopback)."""
    transport = httpx.HTTPTransport(local_address=source)
    return httpx.Client(base_url=base_url, timeout=10, transport=transport)


def guess(http: httpx.Client, n: int, **headers: str) -> int:
    return http.get(URL, headers={"Authorization": f"Bearer of_guess_{n}", **headers}).status_code


def test_a_forwarded_address_from_loopback_does_not_escape_the_limit(direct: str) -> None:
    with client(direct) as http:  # from 127.0.0.1: trusted by uvicorn's own default
        # A new X-Forwarded-For with each guess: before, 60 guesses and not one 429.
        statuses = [guess(http, n, **{"X-Forwarded-For": f"203.0.113.{n}"}) for n in range(60)]
    # All counted as 127.0.0.1's (another test of this module may have spent some of it).
    first = statuses.index(429)
    assert first <= LIMIT and set(statuses[:first]) <= {401}, statuses
    assert set(statuses[first:]) == {429}, statuses


def test_naming_an_address_does_not_lock_it_out(direct: str) -> None:
    victim = "127.0.0.22"
    with client(direct) as attacker:  # from 127.0.0.1: trusted by uvicorn's own default
        for n in range(2 * LIMIT):
            guess(attacker, n, **{"X-Forwarded-For": victim})
    with client(direct, victim) as http:
        # Before: 429 for both, the attacker's guesses counted as the victim's.
        assert guess(http, 99) == 401
        assert http.get(URL, headers=auth(KEY)).status_code == 200


def test_a_valid_key_is_served_from_an_address_past_the_limit(direct: str) -> None:
    with client(direct, "127.0.0.23") as http:
        statuses = [guess(http, n) for n in range(LIMIT + 3)]
        assert statuses[-1] == 429 and statuses.count(401) == LIMIT, statuses
        answer = http.get(URL, headers={"Authorization": "Bearer of_guess_x"})
        assert answer.json()["code"] == "rate_limited"
        assert int(answer.headers["retry-after"]) >= 1
        # Before: 429 — the valid key refused along with the guesses.
        assert http.get(URL, headers=auth(KEY)).status_code == 200
        assert guess(http, 100) == 429  # and guessing stays limited
    with client(direct, "127.0.0.24") as other:  # another address: its own budget
        assert guess(other, 101) == 401
        assert other.get(URL, headers=auth(KEY)).status_code == 200


def test_behind_a_named_proxy_each_client_has_its_own_budget(proxied: str) -> None:
    guesser = {"X-Forwarded-For": "203.0.113.7"}
    tenant = {"X-Forwarded-For": "198.51.100.9"}
    with client(proxied) as proxy:
        statuses = [guess(proxy, n, **guesser) for n in range(LIMIT + 2)]
        assert statuses[-1] == 429 and statuses.count(401) == LIMIT, statuses
        # The guesser's valid key is still served; so is every other client, and another
        # client's wrong key is a 401, not a 429: the budget is the guesser's alone.
        assert proxy.get(URL, headers={**auth(KEY), **guesser}).status_code == 200
        assert proxy.get(URL, headers={**auth(KEY), **tenant}).status_code == 200
        assert guess(proxy, 99, **tenant) == 401

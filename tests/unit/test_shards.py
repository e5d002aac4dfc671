"""The shard map: pinned bucket vectors, splits, overrides, the digest, bad input (no services)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from onceflow.errors import InvalidDatabaseUrl, InvalidRequest, InvalidShardMap
from onceflow.settings import Settings
from onceflow.shards import BUCKETS, BucketRange, ShardMap, bucket_of, configured_map

# Frozen forever: changing the bucket function would send workspaces to other databases.
VECTORS = [
    ("w1", 658),
    ("ws-42", 836),
    ("é", 851),
    ("日本", 715),
    ("acme", 160),
    ("ws-big", 644),
    ("0", 824),
    ("a" * 200, 391),
]

SECRET = "s3cret"
A = f"postgresql+psycopg://app:{SECRET}@db0:5432/onceflow"
B = f"postgresql+psycopg://app:{SECRET}@db1:5432/onceflow"
C = "postgresql://app@db2:5432/onceflow"


@pytest.mark.parametrize(("workspace", "expected"), VECTORS)
def test_bucket_vectors(workspace: str, expected: int) -> None:
    assert bucket_of(workspace) == expected


def test_bucket_is_the_documented_function() -> None:
    for workspace, _ in VECTORS:
        head = hashlib.sha256(workspace.encode("utf-8")).digest()[:8]
        assert bucket_of(workspace) == int.from_bytes(head, "big") % 1024
    assert BUCKETS == 1024


@pytest.mark.parametrize("bad", ["", "x" * 201, "a\x00b", "\ud800", 7, None])
def test_bucket_of_refuses_what_onceflow_refuses_as_a_workspace(bad: Any) -> None:
    with pytest.raises(InvalidRequest):
        bucket_of(bad)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_equal_split_covers_every_bucket_once_contiguously(n: int) -> None:
    urls = [f"postgresql://app@db{k}:5432/onceflow" for k in range(n)]
    shard_map = ShardMap.from_urls(urls)
    assert len(shard_map) == n
    assert [r.shard for r in shard_map.ranges] == list(range(n))  # one range each, in order
    assert shard_map.ranges[0].first == 0
    assert shard_map.ranges[-1].last == BUCKETS - 1
    for before, after in zip(shard_map.ranges, shard_map.ranges[1:], strict=False):
        assert after.first == before.last + 1
    sizes = [r.last - r.first + 1 for r in shard_map.ranges]
    assert sum(sizes) == BUCKETS
    # The first 1024 % n shards get one bucket more than the others.
    assert sizes == [BUCKETS // n + (1 if k < BUCKETS % n else 0) for k in range(n)]
    owners = [shard_map._table[b] for b in range(BUCKETS)]
    assert owners == sorted(owners)
    for workspace, bucket in VECTORS:
        assert shard_map.shard_of(workspace) == owners[bucket]
        assert shard_map.url_of(workspace) == urls[owners[bucket]]


def test_single_holds_every_workspace() -> None:
    shard_map = ShardMap.single(A)
    assert len(shard_map) == 1
    assert shard_map.ranges == (BucketRange(0, 1023, 0),)
    assert {shard_map.url_of(ws) for ws, _ in VECTORS} == {A}
    assert shard_map == ShardMap.from_urls([A])


def test_overrides_come_before_the_ranges() -> None:
    plain = ShardMap.from_urls([A, B])
    assert plain.shard_of("ws-big") == 1  # bucket 644
    moved = ShardMap.from_urls([A, B])
    moved = dataclasses.replace(moved, overrides={"ws-big": 0})
    assert moved.shard_of("ws-big") == 0
    assert moved.url_of("ws-big") == A
    assert moved.shard_of("w1") == plain.shard_of("w1")
    with pytest.raises(TypeError):
        moved.overrides["w1"] = 0  # type: ignore[index]
    with pytest.raises(InvalidRequest):
        moved.shard_of(["ws-big"])  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        moved.urls = (A,)  # type: ignore[misc]


def test_a_shard_may_hold_only_overridden_workspaces() -> None:
    shard_map = ShardMap((A, B, C), ((0, 1023, 0),), {"ws-big": 2})  # type: ignore[arg-type]
    assert shard_map.shard_of("ws-big") == 2
    assert shard_map.shard_of("w1") == 0
    assert "shard 1: postgresql+psycopg://app@db1:5432/onceflow: buckets none (0)" in (
        shard_map.describe()
    )


def test_from_json_with_and_without_ranges() -> None:
    text = json.dumps(
        {"shards": [A, B], "ranges": [[512, 1023, 1], [0, 511, 0]], "overrides": {"w1": 1}}
    )
    shard_map = ShardMap.from_json(text)
    assert shard_map.ranges == (BucketRange(0, 511, 0), BucketRange(512, 1023, 1))
    assert shard_map.shard_of("w1") == 1
    assert ShardMap.from_json(text.encode()) == shard_map
    assert ShardMap.from_json(json.loads(text)) == shard_map
    equal = ShardMap.from_json({"shards": [A, B, C]})
    assert equal == ShardMap.from_urls([A, B, C])


def test_adjacent_ranges_of_one_shard_are_merged() -> None:
    split = ShardMap((A, B), ((0, 99, 0), (100, 511, 0), (512, 1023, 1)))  # type: ignore[arg-type]
    assert split.ranges == ShardMap.from_urls([A, B]).ranges
    assert split == ShardMap.from_urls([A, B])
    assert hash(split) == hash(ShardMap.from_urls([A, B]))


def test_digest_is_the_routing_alone() -> None:
    shard_map = ShardMap.from_json(
        {"shards": [A, B], "ranges": [[0, 511, 0], [512, 1023, 1]], "overrides": {"ws-big": 0}}
    )
    canonical = (
        '{"buckets":1024,"overrides":{"ws-big":0},"ranges":[[0,511,0],[512,1023,1]],'
        '"shards":2,"v":"onceflow.shardmap.v1"}'
    )
    # Frozen: shards store it, so processes of different versions must compute the same.
    assert shard_map.digest == hashlib.sha256(canonical.encode()).hexdigest()
    assert shard_map.digest == "5cedd576c4a2496916d53512a43d27cf49066da72df4525d76965c6bbea88b3a"


def test_digest_ignores_how_the_shards_are_reached() -> None:
    ours = ShardMap.from_urls([A, B])
    theirs = ShardMap.from_urls(
        [
            "postgres://other:different@10.0.0.1/onceflow",
            "postgresql://app@db1.internal:6432/onceflow?sslmode=require",
        ]
    )
    assert ours.digest == theirs.digest
    assert ours != theirs  # the maps differ; their routing does not


def test_digest_changes_with_the_routing() -> None:
    base = ShardMap.from_urls([A, B])
    digests = {
        base.digest,
        ShardMap.from_urls([A, B, C]).digest,
        ShardMap((A, B), ((0, 510, 0), (511, 1023, 1))).digest,  # type: ignore[arg-type]
        ShardMap((A, B), ((0, 511, 1), (512, 1023, 0))).digest,  # type: ignore[arg-type]
        dataclasses.replace(base, overrides={"w1": 0}).digest,
        dataclasses.replace(base, overrides={"w1": 1}).digest,
        dataclasses.replace(base, overrides={"w2": 1}).digest,
    }
    assert len(digests) == 7
    assert base.digest == ShardMap.from_urls([A, B]).digest


def test_nothing_shows_a_password() -> None:
    shard_map = ShardMap.from_json({"shards": [A, B], "overrides": {"ws-big": 0}})
    for text in (shard_map.describe(), repr(shard_map), str(shard_map)):
        assert SECRET not in text
        assert "db0:5432" in text
    assert shard_map.urls == (A, B)  # the URLs themselves keep their password, to connect


def _map(**changes: Any) -> dict[str, Any]:
    return {"shards": [A, B], "ranges": [[0, 511, 0], [512, 1023, 1]], **changes}


BAD_MAPS: list[tuple[str, Any, str]] = [
    ("no shards", {"shards": []}, "0 shards"),
    ("no shards key", {"ranges": [[0, 1023, 0]]}, 'no "shards"'),
    ("shards not a list", {"shards": A}, '"shards" must be a list'),
    ("url not a string", {"shards": [A, 5]}, "shard 1's URL must be a string"),
    ("not postgres", {"shards": [A, f"mysql://app:{SECRET}@db/x"]}, "not 'mysql'"),
    ("bad port", {"shards": [f"postgresql://app:{SECRET}@db:99999/x"]}, "port 99999"),
    ("password, no host", {"shards": [f"postgresql://app:{SECRET}/x"]}, "cannot be parsed"),
    ("not a url", {"shards": [f"app:{SECRET}@db"]}, "not a URL"),
    ("duplicate", {"shards": [A, A]}, "shards 0 and 1 are the same database"),
    (
        "duplicate spelled apart",
        {"shards": [A, "postgres://app:other@db0:5432/onceflow"]},
        "same database",
    ),
    ("gap", _map(ranges=[[0, 500, 0], [512, 1023, 1]]), "buckets 501-511 are in no range"),
    ("gap at the end", _map(ranges=[[0, 511, 0], [512, 1000, 1]]), "buckets 1001-1023"),
    ("gap at the start", _map(ranges=[[1, 1023, 0]]), "bucket 0 is in no range"),
    ("no ranges", _map(ranges=[]), "buckets 0-1023 are in no range"),
    ("overlap", _map(ranges=[[0, 600, 0], [512, 1023, 1]]), "buckets 512-600 are in two"),
    ("past the last bucket", _map(ranges=[[0, 1024, 0]]), "buckets run from 0 to 1023"),
    ("negative bucket", _map(ranges=[[-1, 1023, 0]]), "buckets run from 0 to 1023"),
    ("reversed", _map(ranges=[[511, 0, 0], [512, 1023, 1]]), "first <= last"),
    ("no such shard", _map(ranges=[[0, 511, 0], [512, 1023, 2]]), "names shard 2"),
    ("negative shard", _map(ranges=[[0, 511, -1], [512, 1023, 1]]), "names shard -1"),
    ("range not three", _map(ranges=[[0, 1023]]), "range 0 must be"),
    ("range of strings", _map(ranges=[[0, 1023, A]]), "range 0 must be"),
    ("range of bools", _map(ranges=[[0, 1023, False]]), "range 0 must be"),
    ("range of floats", _map(ranges=[[0.0, 1023, 0]]), "range 0 must be"),
    ("ranges not a list", _map(ranges={"0": 1}), '"ranges" must be a list'),
    ("override to nowhere", _map(overrides={"ws-big": 2}), "names shard 2"),
    ("override not an int", _map(overrides={"ws-big": "1"}), "must be an integer"),
    ("override a bool", _map(overrides={"ws-big": True}), "must be an integer"),
    ("override empty ws", _map(overrides={"": 0}), "must not be empty"),
    ("override control char", _map(overrides={"a\nb": 0}), "control characters"),
    ("overrides not an object", _map(overrides=[["ws", 0]]), '"overrides" must be an object'),
    ("unknown key", _map(replicas=[A]), "unknown key(s) 'replicas'"),
    ("unknown url key", _map(**{A: 1}), "unknown key(s)"),
    ("not an object", [A, B], "must be a JSON object"),
]


@pytest.mark.parametrize(("what", "data", "fragment"), BAD_MAPS, ids=[b[0] for b in BAD_MAPS])
def test_bad_maps_are_refused_without_a_password(what: str, data: Any, fragment: str) -> None:
    for given in (data, json.dumps(data)):
        with pytest.raises(InvalidShardMap) as caught:
            ShardMap.from_json(given)
        message = str(caught.value)
        assert fragment in message, message
        assert SECRET not in message
        assert message.startswith("cannot use the shard map")


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('{"shards": ["' + A + '"', "not JSON"),
        (b'{"shards": ["\xff"]}', "not UTF-8"),
        ("", "not JSON"),
        ('{"shards": ["' + A + '"], "shards": ["' + B + '"]}', "'shards' appears twice"),
        ('{"shards": ["' + A + '"], "overrides": {"w": 0, "w": 0}}', "'w' appears twice"),
        ("[1, 2]", "must be a JSON object"),
    ],
)
def test_bad_json_is_refused_without_a_password(text: str | bytes, fragment: str) -> None:
    with pytest.raises(InvalidShardMap) as caught:
        ShardMap.from_json(text)
    assert fragment in str(caught.value)
    assert SECRET not in str(caught.value)


def test_bad_constructor_input() -> None:
    with pytest.raises(InvalidShardMap, match="not one string"):
        ShardMap.from_urls(A)
    with pytest.raises(InvalidShardMap, match="0 shards"):
        ShardMap.from_urls([])
    with pytest.raises(InvalidShardMap, match="1025 shards"):
        ShardMap.from_urls([f"postgresql://h/db{k}" for k in range(1025)])
    with pytest.raises(InvalidShardMap, match="workspace_id must be a string"):
        ShardMap((A,), ((0, 1023, 0),), {7: 0})  # type: ignore[arg-type, dict-item]
    with pytest.raises(InvalidShardMap, match="must be a mapping"):
        ShardMap((A,), ((0, 1023, 0),), [("w", 0)])  # type: ignore[arg-type]
    with pytest.raises(InvalidShardMap, match="ranges must be a list"):
        ShardMap((A,), "0-1023")  # type: ignore[arg-type]
    assert len(ShardMap.from_urls([f"postgresql://h/db{k}" for k in range(1024)])) == 1024


def test_the_error_travels_like_the_others() -> None:
    # Celery serializes exceptions: __reduce__ rebuilds the same error from its fields.
    err = InvalidShardMap("buckets 0-1 are in no range", "ONCEFLOW_SHARD_MAP=/x.json")
    rebuilt_type, args = err.__reduce__()
    again = rebuilt_type(*args)
    assert str(again) == str(err)
    assert (again.problem, again.source) == (err.problem, err.source)
    assert isinstance(err, ValueError)


# configured_map: the environment, read by a fresh Settings().


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("ONCEFLOW_DATABASE_URLS", "ONCEFLOW_SHARD_MAP"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ONCEFLOW_DATABASE_URL", C)
    return monkeypatch


def test_configured_map_defaults_to_database_url(env: pytest.MonkeyPatch) -> None:
    assert configured_map(Settings()) == ShardMap.single(C)


def test_configured_map_refuses_a_bad_database_url_as_before(env: pytest.MonkeyPatch) -> None:
    env.setenv("ONCEFLOW_DATABASE_URL", f"mysql://app:{SECRET}@db/x")
    with pytest.raises(InvalidDatabaseUrl) as caught:
        configured_map(Settings())
    assert SECRET not in str(caught.value)


def test_configured_map_from_database_urls(env: pytest.MonkeyPatch) -> None:
    env.setenv("ONCEFLOW_DATABASE_URLS", f" {A} ,{B},  {C}  ")
    shard_map = configured_map(Settings())
    assert shard_map == ShardMap.from_urls([A, B, C])
    assert shard_map.urls == (A, B, C)


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("", "set but empty"),
        ("  ", "set but empty"),
        (f"{A},", "item 1 is empty"),
        (f"{A},,{B}", "item 1 is empty"),
        (f"{A},{A}", "same database"),
        (f"{A},mysql://app:{SECRET}@db/x", "shard 1's URL"),
        # A comma in a password splits the URL: no piece of it is shown.
        (f"postgresql://app:{SECRET[:3]},{SECRET[3:]}@db/x", "must be written %2C"),
        (f"postgresql://app:a,b{SECRET}@db/x", "item 1 is not a URL"),
    ],
)
def test_configured_map_refuses_bad_database_urls(
    env: pytest.MonkeyPatch, value: str, fragment: str
) -> None:
    env.setenv("ONCEFLOW_DATABASE_URLS", value)
    with pytest.raises(InvalidShardMap) as caught:
        configured_map(Settings())
    message = str(caught.value)
    assert fragment in message, message
    assert "(ONCEFLOW_DATABASE_URLS)" in message
    for piece in (SECRET, SECRET[:3], SECRET[3:]):
        assert piece not in message


def test_a_comma_written_as_pct2c_is_kept(env: pytest.MonkeyPatch) -> None:
    url = "postgresql://app:a%2Cb@db0/x"
    env.setenv("ONCEFLOW_DATABASE_URLS", f"{url},{C}")
    assert configured_map(Settings()).urls == (url, C)


def test_configured_map_from_a_file(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "shards.json"
    path.write_text(json.dumps(_map(overrides={"w1": 0})), encoding="utf-8")
    env.setenv("ONCEFLOW_SHARD_MAP", str(path))
    shard_map = configured_map(Settings())
    assert shard_map == ShardMap.from_json(_map(overrides={"w1": 0}))
    assert shard_map.shard_of("w1") == 0


def test_configured_map_file_errors_name_the_file(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "shards.json"
    env.setenv("ONCEFLOW_SHARD_MAP", str(path))
    with pytest.raises(InvalidShardMap, match="cannot read the file: No such file"):
        configured_map(Settings())
    path.write_text(json.dumps(_map(ranges=[[0, 511, 0]])), encoding="utf-8")
    with pytest.raises(InvalidShardMap) as caught:
        configured_map(Settings())
    assert f"(ONCEFLOW_SHARD_MAP={path})" in str(caught.value)
    assert "buckets 512-1023 are in no range" in str(caught.value)
    env.setenv("ONCEFLOW_SHARD_MAP", "")
    with pytest.raises(InvalidShardMap, match="the path is empty"):
        configured_map(Settings())


def test_configured_map_refuses_both(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "shards.json"
    path.write_text(json.dumps(_map()), encoding="utf-8")
    env.setenv("ONCEFLOW_SHARD_MAP", str(path))
    env.setenv("ONCEFLOW_DATABASE_URLS", f"{A},{B}")
    with pytest.raises(InvalidShardMap, match="both set"):
        configured_map(Settings())


def test_overrides_is_a_read_only_mapping() -> None:
    shard_map = ShardMap.from_json(_map(overrides={"w1": 1}))
    assert isinstance(shard_map.overrides, Mapping)
    assert dict(shard_map.overrides) == {"w1": 1}

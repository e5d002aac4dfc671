"""The shard map: which Postgres database holds a workspace (docs/sharding.md, 5.4).

Pure and offline: nothing here connects. A workspace is hashed into one of
:data:`BUCKETS` (1024) buckets, ``bucket_of(ws)`` = the first 8 bytes of
``sha256(ws as UTF-8)``, big-endian unsigned, mod 1024; ranges of buckets name a
shard, and per-workspace overrides move single (large) workspaces. The bucket
function is frozen: changing it would send every workspace to another database, so
the tests pin vectors. Never Python's ``hash()`` (salted per process), never
"mod N" without buckets (changing N would move nearly every workspace).

Where the map comes from (:func:`configured_map`):

- ``ONCEFLOW_SHARD_MAP`` — the path of a JSON file (below);
- ``ONCEFLOW_DATABASE_URLS`` — comma-separated URLs, shard k the k-th, the buckets split
  into equal ranges (a comma inside a URL, e.g. in a password, is written ``%2C``);
- neither: one shard, ``ONCEFLOW_DATABASE_URL`` (today's behaviour). Both: an error.

The file::

    {
      "shards": ["postgresql+psycopg://app@db0:5432/onceflow",
                 "postgresql+psycopg://app@db1:5432/onceflow"],
      "ranges": [[0, 511, 0], [512, 1023, 1]],
      "overrides": {"ws-big": 1}
    }

``shards`` (required): PostgreSQL URLs, shard k is the k-th; no URL twice. ``ranges``
(optional; absent = equal split): ``[first, last, shard]`` with both bucket ends
included, in any order, covering buckets 0-1023 exactly once; a shard may have no
range (e.g. one that only holds overridden workspaces). ``overrides`` (optional):
workspace id → shard, applied before the ranges. No other key. A password may be
left out of the URLs (libpq reads ``PGPASSWORD`` or ``~/.pgpass``); none is ever
shown in an error or in :meth:`ShardMap.describe`.

Growing by one shard with the equal split (N → N+1 URLs) moves about half the
buckets whatever N is (shard k's range start moves from k/N to k/(N+1) of the
way), while 1/(N+1) is the least any map can move. To grow with less movement,
write a map file that gives the new shard a slice of each existing shard's
ranges. Moving the rows themselves is out of scope (docs/sharding.md, 5.4).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple, TypeVar

from onceflow.db import check_database_url, redact_url
from onceflow.errors import InvalidDatabaseUrl, InvalidRequest, InvalidShardMap, OnceflowError
from onceflow.ids import check_id
from onceflow.settings import Settings, get_settings

#: Buckets workspaces hash into; fixed forever (a map's ranges are written in them).
BUCKETS = 1024
_DIGEST_TAG = "onceflow.shardmap.v1"
_FILE_KEYS = frozenset({"shards", "ranges", "overrides"})

_S = TypeVar("_S")
_R = TypeVar("_R")


def bucket_of(workspace_id: str) -> int:
    """The bucket of ``workspace_id``: first 8 bytes of its sha256, big-endian, mod 1024.

    A workspace id onceflow would refuse (not a string, empty, too long, control
    characters, a lone surrogate) raises :class:`InvalidRequest`.
    """
    check_id("workspace_id", workspace_id)
    digest = hashlib.sha256(workspace_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % BUCKETS


class BucketRange(NamedTuple):
    """Buckets ``first`` to ``last`` (both included) live on shard ``shard``."""

    first: int
    last: int
    shard: int


@dataclass(frozen=True, repr=False)
class ShardMap:
    """Shard URLs, bucket ranges → shard index, and per-workspace overrides; immutable.

    Built checked: every bucket in exactly one range, every index naming a shard, no
    URL twice; else :class:`InvalidShardMap`. ``ranges`` is kept sorted, adjacent
    ranges of one shard merged, so two spellings of one routing compare equal.
    """

    urls: tuple[str, ...]
    ranges: tuple[BucketRange, ...]
    overrides: Mapping[str, int] = field(default_factory=dict)
    _table: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _digest: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        urls = _check_urls(self.urls)
        ranges = _check_ranges(self.ranges, len(urls))
        overrides = _check_overrides(self.overrides, len(urls))
        table = [0] * BUCKETS
        for first, last, shard in ranges:
            table[first : last + 1] = [shard] * (last - first + 1)
        routing = {
            "v": _DIGEST_TAG,
            "buckets": BUCKETS,
            "shards": len(urls),
            "ranges": [list(r) for r in ranges],
            "overrides": overrides,
        }
        canonical = json.dumps(routing, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        object.__setattr__(self, "urls", urls)
        object.__setattr__(self, "ranges", ranges)
        object.__setattr__(self, "overrides", MappingProxyType(overrides))
        object.__setattr__(self, "_table", tuple(table))
        object.__setattr__(self, "_digest", hashlib.sha256(canonical.encode("utf-8")).hexdigest())

    def __hash__(self) -> int:
        return hash((self.urls, self.ranges, tuple(sorted(self.overrides.items()))))

    def __repr__(self) -> str:
        # Not the dataclass's: that one would show the URLs' passwords.
        urls = tuple(redact_url(url) for url in self.urls)
        ranges = [tuple(r) for r in self.ranges]
        return f"ShardMap(urls={urls!r}, ranges={ranges!r}, overrides={dict(self.overrides)!r})"

    def __len__(self) -> int:
        """The number of shards."""
        return len(self.urls)

    @classmethod
    def from_urls(cls, urls: Iterable[str]) -> ShardMap:
        """Shard k is ``urls[k]``; the buckets split into equal contiguous ranges.

        With N shards each gets 1024 // N buckets, and the first 1024 % N shards one more.
        """
        urls = _as_url_tuple(urls)
        count = len(urls)
        if not 0 < count <= BUCKETS:
            # Checked here too: the split below needs 1..1024 shards (the constructor's
            # own message for an empty list is the same).
            raise InvalidShardMap(f"{count} shards: a map has 1 to {BUCKETS}")
        base, extra = divmod(BUCKETS, count)
        ranges, first = [], 0
        for shard in range(count):
            size = base + (1 if shard < extra else 0)
            ranges.append(BucketRange(first, first + size - 1, shard))
            first += size
        return cls(urls, tuple(ranges))

    @classmethod
    def single(cls, url: str) -> ShardMap:
        """One shard holding every workspace."""
        return cls((url,), (BucketRange(0, BUCKETS - 1, 0),))

    @classmethod
    def from_json(cls, data: str | bytes | Mapping[str, Any]) -> ShardMap:
        """A map from its JSON file's text, or from the object it decodes to (module doc)."""
        if isinstance(data, str | bytes):
            try:
                data = json.loads(data, object_pairs_hook=_no_duplicate_keys)
            except json.JSONDecodeError as exc:
                # The decoder's message gives the position only, never the document's text.
                raise InvalidShardMap(f"not JSON: {exc.msg} at line {exc.lineno}") from None
            except UnicodeDecodeError:
                raise InvalidShardMap("not JSON: the bytes are not UTF-8") from None
        if not isinstance(data, Mapping):
            raise InvalidShardMap(f"the map must be a JSON object, got {_kind(data)}")
        unknown = sorted(_shown(key) for key in data if key not in _FILE_KEYS)
        if unknown:
            raise InvalidShardMap(
                f"unknown key(s) {', '.join(unknown)}; the keys are shards, ranges, overrides"
            )
        if "shards" not in data:
            raise InvalidShardMap('the map has no "shards" (the list of shard URLs)')
        urls = data["shards"]
        if not isinstance(urls, list):
            raise InvalidShardMap(f'"shards" must be a list of URLs, got {_kind(urls)}')
        overrides = data.get("overrides", {})
        if not isinstance(overrides, Mapping):
            raise InvalidShardMap(f'"overrides" must be an object, got {_kind(overrides)}')
        if "ranges" not in data:
            split = cls.from_urls(urls)
            return cls(split.urls, split.ranges, overrides)
        ranges = data["ranges"]
        if not isinstance(ranges, list):
            raise InvalidShardMap(f'"ranges" must be a list, got {_kind(ranges)}')
        return cls(tuple(urls), tuple(ranges), overrides)

    @property
    def digest(self) -> str:
        """sha256 hex of the routing: shard count, ranges and overrides, canonical JSON.

        The URLs are left out on purpose: two processes may reach one shard under
        different host names, users or passwords, and must still agree. Whether the
        database reached is the shard the map names is checked apart (each shard
        stores its identity; docs/sharding.md, 5.4).
        """
        return self._digest

    def shard_of(self, workspace_id: str) -> int:
        """The index of the shard holding ``workspace_id``: its override, else its bucket's."""
        bucket = bucket_of(workspace_id)  # first: a bad workspace id is refused on either path
        shard = self.overrides.get(workspace_id)
        return shard if shard is not None else self._table[bucket]

    def url_of(self, workspace_id: str) -> str:
        """The URL of the shard holding ``workspace_id``."""
        return self.urls[self.shard_of(workspace_id)]

    def describe(self) -> str:
        """The map for people: one line per shard, its URL without password, its buckets."""
        plural = "" if len(self) == 1 else "s"
        lines = [f"{len(self)} shard{plural} over {BUCKETS} buckets, map digest {self.digest}"]
        for shard, url in enumerate(self.urls):
            mine = [r for r in self.ranges if r.shard == shard]
            spans = ", ".join(f"{r.first}-{r.last}" for r in mine) or "none"
            count = sum(r.last - r.first + 1 for r in mine)
            moved = sum(1 for s in self.overrides.values() if s == shard)
            lines.append(
                f"  shard {shard}: {redact_url(url)}: buckets {spans} ({count}), "
                f"{moved} override{'' if moved == 1 else 's'}"
            )
        return "\n".join(lines)


def configured_map(settings: Settings | None = None) -> ShardMap:
    """The process's map: ``shard_map``'s file, else ``database_urls``, else ``database_url``.

    Setting both ``shard_map`` and ``database_urls`` raises :class:`InvalidShardMap`. With
    neither, a bad ``database_url`` raises :class:`InvalidDatabaseUrl`, as it always has.
    """
    settings = settings or get_settings()
    if settings.shard_map is not None and settings.database_urls is not None:
        raise InvalidShardMap(
            "ONCEFLOW_SHARD_MAP and ONCEFLOW_DATABASE_URLS are both set: set one "
            "(the map file lists the shard URLs itself)"
        )
    if settings.shard_map is not None:
        return _map_file(settings.shard_map)
    if settings.database_urls is not None:
        source = "ONCEFLOW_DATABASE_URLS"
        try:
            return ShardMap.from_urls(_split_urls(settings.database_urls))
        except InvalidShardMap as exc:
            raise InvalidShardMap(exc.problem, source) from None
    check_database_url(settings.database_url)
    return ShardMap.single(settings.database_url)


def _map_file(path: str) -> ShardMap:
    source = f"ONCEFLOW_SHARD_MAP={path}"
    if not path.strip():
        raise InvalidShardMap("the path is empty", "ONCEFLOW_SHARD_MAP")
    try:
        text = Path(path).read_bytes()
    except OSError as exc:
        raise InvalidShardMap(f"cannot read the file: {exc.strerror}", source) from None
    try:
        return ShardMap.from_json(text)
    except InvalidShardMap as exc:
        raise InvalidShardMap(exc.problem, source) from None


def _split_urls(text: str) -> list[str]:
    items = [item.strip() for item in text.split(",")]
    if len(items) == 1 and not items[0]:
        raise InvalidShardMap("it is set but empty (unset it for one shard)")
    for k, item in enumerate(items):
        if not item:
            raise InvalidShardMap(f"item {k} is empty (a stray comma?)")
        if "://" not in item:
            # Most likely a comma inside a URL (a password): show none of the items, since
            # the pieces of a split URL would be redacted wrongly.
            raise InvalidShardMap(
                f"item {k} is not a URL; a comma inside a URL (e.g. in a password) must be "
                "written %2C"
            )
    return items


def _as_url_tuple(urls: object) -> tuple[str, ...]:
    if isinstance(urls, str | bytes):
        raise InvalidShardMap("the shard URLs must be a list, not one string")
    if not isinstance(urls, Iterable):
        raise InvalidShardMap(f"the shard URLs must be a list, got {_kind(urls)}")
    return tuple(urls)


def _check_urls(urls: object) -> tuple[str, ...]:
    checked = _as_url_tuple(urls)
    if not checked:
        raise InvalidShardMap(f"0 shards: a map has 1 to {BUCKETS}")
    if len(checked) > BUCKETS:
        raise InvalidShardMap(f"{len(checked)} shards: a map has 1 to {BUCKETS}")
    seen: dict[str, int] = {}
    for k, url in enumerate(checked):
        if not isinstance(url, str):
            raise InvalidShardMap(f"shard {k}'s URL must be a string, got {_kind(url)}")
        try:
            parsed = check_database_url(url)
        except InvalidDatabaseUrl as exc:
            raise InvalidShardMap(f"shard {k}'s URL {_url_problem(url, exc)}") from None
        # One database under two spellings (postgres:// and postgresql+psycopg://, another
        # password) is still one database: compare without the password.
        same = redact_url(parsed)
        if same in seen:
            raise InvalidShardMap(f"shards {seen[same]} and {k} are the same database {same!r}")
        seen[same] = k
    return checked


def _url_problem(url: str, exc: InvalidDatabaseUrl) -> str:
    """What is wrong with ``url``, for a message; never a password."""
    scheme, sep, rest = url.partition("://")
    authority = rest.split("/", 1)[0].split("?", 1)[0]
    if sep and "@" not in authority and not authority.rpartition(":")[2].isdigit():
        # `user:secret/db` (no @host) parses as host `user`, port `secret`: redact_url and
        # the port message would both show the password. Show the scheme only.
        return (
            f"{scheme}://…: cannot be parsed (a port that is not a number, or a password "
            "with no @host after it)"
        )
    return f"{exc.url!r}: {exc.problem}"


def _check_ranges(ranges: object, shards: int) -> tuple[BucketRange, ...]:
    if not isinstance(ranges, Iterable) or isinstance(ranges, str | bytes):
        raise InvalidShardMap(f"the ranges must be a list, got {_kind(ranges)}")
    checked: list[BucketRange] = []
    for k, entry in enumerate(ranges):
        if (
            not isinstance(entry, list | tuple)
            or len(entry) != 3
            or not all(isinstance(n, int) and not isinstance(n, bool) for n in entry)
        ):
            raise InvalidShardMap(
                f"range {k} must be [first bucket, last bucket, shard], three integers"
            )
        checked.append(BucketRange(*entry))
    checked.sort()
    for r in checked:
        if not 0 <= r.first <= r.last < BUCKETS:
            raise InvalidShardMap(
                f"range {list(r)}: buckets run from 0 to {BUCKETS - 1}, first <= last"
            )
        if not 0 <= r.shard < shards:
            raise InvalidShardMap(
                f"range {list(r)} names shard {r.shard}; the map has shards 0 to {shards - 1}"
            )
    merged: list[BucketRange] = []
    expected = 0  # the first bucket not yet covered
    for r in checked:
        if r.first > expected:
            raise InvalidShardMap(f"{_span(expected, r.first - 1)} in no range")
        if r.first < expected:
            raise InvalidShardMap(
                f"{_span(r.first, min(r.last, expected - 1))} in two ranges "
                f"({list(merged[-1])} and {list(r)})"
            )
        if merged and merged[-1].shard == r.shard:
            merged[-1] = merged[-1]._replace(last=r.last)
        else:
            merged.append(r)
        expected = r.last + 1
    if expected < BUCKETS:
        raise InvalidShardMap(f"{_span(expected, BUCKETS - 1)} in no range")
    return tuple(merged)


def _span(first: int, last: int) -> str:
    return f"bucket {first} is" if first == last else f"buckets {first}-{last} are"


def _check_overrides(overrides: object, shards: int) -> dict[str, int]:
    if not isinstance(overrides, Mapping):
        raise InvalidShardMap(f"the overrides must be a mapping, got {_kind(overrides)}")
    checked: dict[str, int] = {}
    for workspace, shard in sorted(overrides.items(), key=lambda item: str(item[0])):
        try:
            check_id("workspace_id", workspace)
        except InvalidRequest as exc:
            raise InvalidShardMap(f"override of {_shown(workspace)}: {exc}") from None
        if not isinstance(shard, int) or isinstance(shard, bool):
            raise InvalidShardMap(
                f"override of {_shown(workspace)}: the shard must be an integer, got {_kind(shard)}"
            )
        if not 0 <= shard < shards:
            raise InvalidShardMap(
                f"override of {_shown(workspace)} names shard {shard}; the map has shards 0 to "
                f"{shards - 1}"
            )
        checked[workspace] = shard
    return checked


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise InvalidShardMap(f"the key {_shown(key)} appears twice in one object")
        result[key] = value
    return result


def _shown(value: object) -> str:
    """A key or workspace id for a message: quoted, cut short, a URL without its password."""
    if not isinstance(value, str):
        return type(value).__name__
    text = redact_url(value) if "://" in value else value
    return repr(text[:40] + ("…" if len(text) > 40 else ""))


def _kind(value: object) -> str:
    return {dict: "an object", list: "a list", str: "a string", type(None): "null"}.get(
        type(value), type(value).__name__
    )


#: The identity row of a shard's database (migration 0009): which shard it is, of which map.
IDENTITY_SQL = "SELECT shard_index, shard_count, map_digest FROM onceflow_shard"

#: Written by ``onceflow migrate`` on each shard (never moving a database to another index).
REGISTER_SQL = """
INSERT INTO onceflow_shard (one, shard_index, shard_count, map_digest)
VALUES (true, %(index)s, %(count)s, %(digest)s)
ON CONFLICT (one) DO UPDATE
SET shard_count = EXCLUDED.shard_count, map_digest = EXCLUDED.map_digest, updated_at = now()
WHERE onceflow_shard.shard_index = EXCLUDED.shard_index
RETURNING shard_index
"""


def identity_problem(row: Mapping[str, Any] | None, index: int, shard_map: ShardMap) -> str | None:
    """Why a database whose identity row is ``row`` is not shard ``index`` of ``shard_map``;
    None when it is. (What the router checks at its first statement on each shard.)"""
    if row is None:
        return (
            f"is not registered as shard {index}: run `onceflow migrate` with this shard map "
            "(it registers every shard)"
        )
    if row["shard_index"] != index:
        return (
            f"is shard {row['shard_index']} of {row['shard_count']}, but this map names it "
            f"shard {index} of {len(shard_map)} (are the URLs in another order?)"
        )
    if row["shard_count"] != len(shard_map) or row["map_digest"] != shard_map.digest:
        return (
            f"was registered under another map ({row['shard_count']} shards, digest "
            f"{str(row['map_digest'])[:12]}; this process: {len(shard_map)} shards, digest "
            f"{shard_map.digest[:12]}): run `onceflow migrate` with the map every process uses"
        )
    return None


def each_shard(
    shards: Sequence[_S],
    run: Callable[[_S], _R],
    skipped: Callable[[int, OnceflowError], object],
) -> tuple[list[_R], list[int]]:
    """``run(shard)`` on each shard in turn: the answers of the shards that answered, and
    the indexes of those that did not. Of several shards, one that fails (an onceflow error)
    is reported to ``skipped`` and passed over while another answers; its error is raised
    when none did, and at once when there is one shard."""
    answers: list[_R] = []
    down: list[int] = []
    failed: OnceflowError | None = None
    for index, shard in enumerate(shards):
        try:
            answers.append(run(shard))
        except OnceflowError as exc:
            if len(shards) == 1:
                raise
            failed = exc
            down.append(index)
            skipped(index, exc)
    if not answers and failed is not None:
        raise failed
    return answers, down

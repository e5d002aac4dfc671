"""A line of long-poll claimers per worker class: a claimable row wakes one waiter, not all.

An API process may hold thousands of long-poll claims of one worker class (browser tabs,
agents). If each of them waited on the work notifications by itself, every notify would
wake every waiter, and each would send a claim (and a fresh ``NEXT_WORK``) to the
database: for one row, thousands of statements queued on a pool of ten connections, the
row's claim among them. Here the waiters of one worker class on one event loop stand in
one FIFO line (:class:`ClaimLine`), and one task per line looks at the database for them:

1. a notify of the class (or a listener's reconnection, or a due time passing) *kicks*
   the line; kicks that arrive while it looks are folded into one more look;
2. the look (a *round*) reads ``NEXT_WORK`` and, when something is due now, how many rows
   are claimable per workspace (``CLAIMABLE``, bounded);
3. the round wakes as many sleeping waiters, from the head of the line, as rows are
   claimable and not already owed to a waiter still *in flight* (woken, or claiming on its
   own); a waiter scoped to some workspaces is woken only for a row it may claim;
4. a woken waiter sends the claim (the SQL claim decides, as ever); one that finds nothing
   goes back to the head of the line.

A new waiter first claims by itself, unless the line knows nothing is claimable (its last
round found nothing due now, no notify came since that round began, and the next due time
has not passed) or a round is under way or asked for: then it goes straight to sleep, and
its sleep asks for a round, which wakes it if a row is there. A storm of (re)connecting
clients thus costs the database a few rounds, not a claim each.

No lost wake-up: a waiter is in flight from before its first claim (after the listener
LISTENs) until it sleeps or leaves. A flight that ends while the line saw a notify or ran a
round since it began kicks the line again (a row it was counted against may still be
there), and so does a woken waiter that leaves without claiming (its client went away).
A waiter going to sleep kicks the line unless a round began since its flight did, so the
line learns of rows that become due later without a notify (a delayed enqueue, a lease
that lapses) as a waiter's own ``NEXT_WORK`` did. Without a LISTENing connection the line
looks every ``_READY_WAIT`` seconds while it has sleepers.

The line only decides whom to wake; the database stays the only source of truth.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from onceflow.connector import Steps, all_rows, arun, on_every_shard, retrying
from onceflow.models import Claim, WorkspaceScope
from onceflow.models.scopes import allows
from onceflow.queue import sql
from onceflow.queue.notify import WorkWatch, next_work_by_shard

if TYPE_CHECKING:
    from onceflow.queue.store import AsyncQueue

log = logging.getLogger("onceflow.queue.claim_line")

#: The most rows of each kind (due, lapsed) a round counts per shard: it wakes at most as
#: many waiters; a successful claim that spanned a round looks again for the rest.
COUNT_LIMIT = 1000
#: How often a line with sleepers looks by itself when it cannot count on notifies (no
#: LISTENing connection), or while rows it counted wait for a waiter that may claim them.
LOOK_AGAIN_SECONDS = 1.0


class _Place:
    """One long poll's place: asleep in the line, or in flight (woken or claiming)."""

    __slots__ = ("events", "rounds", "scope", "woken")

    def __init__(self, scope: WorkspaceScope | None) -> None:
        self.scope = scope
        self.woken: asyncio.Future[None] | None = None
        self.events = 0  # the line's counters when this flight began
        self.rounds = 0


class ClaimLine:
    """The long-poll claimers of one worker class on one event loop (see the module)."""

    def __init__(self, queue: AsyncQueue, worker_class: str, watch: WorkWatch) -> None:
        self.queue = queue
        self.worker_class = worker_class
        self._watch = watch
        self.sleeping: deque[_Place] = deque()
        self.flying: set[_Place] = set()
        self.events = 0  # notifies of the class and listener (re)connections seen
        self.rounds = 0  # rounds begun
        self._kicked = asyncio.Event()
        self._due_at: float | None = None  # loop time of the next known due event
        # A round saw work due now: once its flights have landed, look again (what is due
        # next, or what is left).
        self._follow_up = False
        self._looking = False
        # The notify count at the start of the last round that found nothing claimable
        # (None: it found some, or failed): see known_empty.
        self._empty: int | None = None
        # The flights that claimed while a count was under way (None: no count under way).
        self._landed: list[_Place] | None = None
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"onceflow-claim-line-{worker_class}"
        )

    # ------------------------------------------------------------------ waiters

    async def claim(
        self,
        claim_now: Callable[[], Awaitable[list[Claim]]],
        wait: float,
        scope: WorkspaceScope | None,
        gone: asyncio.Future[None],
    ) -> list[Claim]:
        """Claim now, else wait in the line (up to ``wait`` s) and claim when woken; []
        on timeout or once ``gone`` is done (the client left)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        place = _Place(scope)
        self._take_off(place)
        attempted = False
        claims: list[Claim] = []
        try:
            while True:
                attempted = False
                # A new waiter need not claim when the line knows nothing is claimable, or
                # is about to look: it sleeps, and the look wakes it if a row is there.
                fresh = place.woken is None
                skip = fresh and self._watch.listening and (self.known_empty() or self.busy)
                claims = [] if skip else await claim_now()
                attempted = True
                left = deadline - loop.time()
                if claims or left <= 0 or gone.done():
                    return claims
                woken_before = place.woken is not None
                self._land(place, attempted=True)
                attempted = False  # a flight begins again when it is woken
                self._sleep(place, head=woken_before)
                woken = place.woken
                assert woken is not None  # noqa: S101 - set by _sleep
                await asyncio.wait({woken, gone}, timeout=left, return_when="FIRST_COMPLETED")
                if not woken.done() or woken.cancelled():  # timed out, left, line closed
                    return []
                if gone.done():
                    return []  # woken, but nobody to claim for: _leave kicks the line
        finally:
            self._leave(place, attempted=attempted, claimed=bool(claims))

    def _take_off(self, place: _Place) -> None:
        place.events, place.rounds = self.events, self.rounds
        self.flying.add(place)

    def _land(self, place: _Place, *, attempted: bool, claimed: bool = False) -> None:
        """End a flight; kick the line when it may have been counted against a row."""
        self.flying.discard(place)
        if claimed and self._landed is not None:
            self._landed.append(place)  # its row may be in the count under way
            self._kicked.set()  # if it was not, look again for the row not woken for
        if not attempted or place.events != self.events or place.rounds != self.rounds:
            self._kicked.set()
        if self._follow_up and not self.flying:
            self._follow_up = False
            self._kicked.set()

    def _sleep(self, place: _Place, *, head: bool) -> None:
        place.woken = asyncio.get_running_loop().create_future()
        (self.sleeping.appendleft if head else self.sleeping.append)(place)
        if place.rounds == self.rounds or not self._watch.listening:
            self._kicked.set()  # learn of work due later (no notify for it)

    def _leave(self, place: _Place, *, attempted: bool, claimed: bool) -> None:
        if place in self.flying:
            self._land(place, attempted=attempted, claimed=claimed)
        elif place.woken is not None and not place.woken.done():
            with contextlib.suppress(ValueError):
                self.sleeping.remove(place)
            place.woken.cancel()

    # ------------------------------------------------------------------ the line

    def notified(self, worker_class: str | None) -> None:
        """A notify of ``worker_class`` (None: a listener connected or was lost)."""
        if worker_class is None or worker_class == self.worker_class:
            self.events += 1
            self._kicked.set()

    def known_empty(self) -> bool:
        """Nothing of the class is claimable now, as far as the line knows: its last round
        found nothing due, no notify or reconnection came since that round began, the
        next known due time has not passed, and the listener is LISTENing."""
        if self._empty is None or self._empty != self.events or not self._watch.listening:
            return False
        due = self._due_at
        return due is None or asyncio.get_running_loop().time() < due

    @property
    def busy(self) -> bool:
        """Kicked, or looking at the database now."""
        return self._kicked.is_set() or self._looking

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            timeout = None
            if self.sleeping:
                if self._due_at is not None:
                    timeout = max(0.0, self._due_at - loop.time())
                if not self._watch.listening:
                    timeout = min(
                        timeout if timeout is not None else LOOK_AGAIN_SECONDS, LOOK_AGAIN_SECONDS
                    )
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._kicked.wait()
            self._kicked.clear()
            if not self.sleeping:
                continue  # nobody to wake: the next waiter claims by itself
            self.rounds += 1
            self._looking = True
            try:
                await self._round(loop, self.events)
            except Exception as exc:  # the database: sleepers stay; look again shortly
                log.warning("claim line %s: could not look for work: %s", self.worker_class, exc)
                self._empty = None
                self._due_at = loop.time() + LOOK_AGAIN_SECONDS
            finally:
                self._looking = False

    async def _round(self, loop: asyncio.AbstractEventLoop, events: int) -> None:
        """``events``: the line's count of notifies when the round began."""
        answers = await arun(self.queue.aconnector, next_work_by_shard([self.worker_class]))
        known = [a for a in answers if isinstance(a, float)]
        next_in = min(known) if known else None
        self._due_at = None
        if next_in is None or next_in > 0:
            if next_in is not None:
                self._due_at = loop.time() + next_in
            if not any(isinstance(a, Exception) for a in answers):
                self._empty = events  # nothing claimable until a notify or the due time
            else:
                self._empty = None
            return
        self._empty = None
        self._landed = []
        try:
            counts = await self._claimable()
            left = self._wake(counts, self._landed)
        finally:
            self._landed = None
        if self.flying:
            self._follow_up = True
        elif left:  # rows no sleeper may claim (scoped waiters): look again in a while
            self._due_at = loop.time() + LOOK_AGAIN_SECONDS

    async def _claimable(self) -> Counter[str]:
        params = {"worker_class": self.worker_class, "limit": COUNT_LIMIT}

        def count() -> Steps[list[Any]]:
            return retrying(lambda: all_rows(sql.CLAIMABLE, params))

        per_shard = await arun(self.queue.aconnector, on_every_shard(count))
        counts: Counter[str] = Counter()
        for rows in per_shard:
            for row in rows:
                counts[row["workspace_id"]] += int(row["n"])
        return counts

    def _wake(self, counts: Counter[str], landed: list[_Place]) -> int:
        """Wake, from the head, one sleeper per claimable row not owed to a flight; the
        number of rows left that no sleeper may claim.

        A flight that claimed while the count ran may have taken a row the count saw: it
        takes one too (at worst one sleeper too few is woken; that flight's landing kicks
        the line, which looks again)."""
        for place in [*self.flying, *landed]:  # each takes one row it may claim
            _take(counts, place.scope)
        left = sum(counts.values())
        kept: deque[_Place] = deque()
        while self.sleeping and left > 0:
            place = self.sleeping.popleft()
            if _take(counts, place.scope):
                left -= 1
                self._take_off(place)
                assert place.woken is not None  # noqa: S101 - a sleeper's
                place.woken.set_result(None)
            else:
                kept.append(place)
        if kept:
            kept.extend(self.sleeping)
            self.sleeping = kept
        return left

    async def aclose(self) -> None:
        """Stop the line's task; its sleepers are cancelled."""
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        for place in self.sleeping:
            if place.woken is not None and not place.woken.done():
                place.woken.cancel()
        self.sleeping.clear()


def _take(counts: Counter[str], scope: WorkspaceScope | None) -> bool:
    """Take one row ``scope`` may claim out of ``counts``; False when there is none."""
    for workspace_id, n in counts.items():
        if n > 0 and allows(scope, workspace_id):
            if n == 1:
                del counts[workspace_id]
            else:
                counts[workspace_id] = n - 1
            return True
    return False


class ClaimLines:
    """The lines of one event loop, one per worker class, fed by the queue's listeners."""

    def __init__(self, queue: AsyncQueue) -> None:
        self.queue = queue
        self._lines: dict[str, ClaimLine] = {}
        self._making = asyncio.Lock()
        self._watch: WorkWatch | None = None

    async def line(self, worker_class: str) -> ClaimLine:
        """The line of ``worker_class`` (made, with its watch on the listeners, on first use)."""
        made = self._lines.get(worker_class)
        if made is not None:
            return made
        async with self._making:
            made = self._lines.get(worker_class)
            if made is not None:
                return made
            if self._watch is None:
                self._watch = await self.queue.watch_work(self._notified)
            line = self._lines[worker_class] = ClaimLine(self.queue, worker_class, self._watch)
            return line

    def _notified(self, worker_class: str | None) -> None:
        lines = self._lines.values() if worker_class is None else [self._lines.get(worker_class)]
        for line in lines:
            if line is not None:
                line.notified(worker_class)

    async def aclose(self) -> None:
        """Stop the lines (their sleepers are cancelled) and the watch."""
        lines, self._lines = list(self._lines.values()), {}
        for line in lines:
            await line.aclose()
        if self._watch is not None:
            self._watch.close()
            self._watch = None

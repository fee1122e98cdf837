"""Async access to the shared ledger from an actor's event loop.

Hundreds of requests per actor reserve and settle at once; one Ray call each
would cost more CPU than the HTTP request. Ops queued while a call is in flight
go out together in the next one, so the number of Ray calls per actor tracks
the ledger's round-trip time, not the request rate.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from pipeline.generate.ledger import Decision, Ledger, Op, Outcome


class LedgerClient(Protocol):
    excluded: tuple[str, ...]
    halted: str | None

    async def reserve(self, dataset: str, tokens: int, usd: float = 0.0) -> Decision: ...

    async def settle(self, dataset: str, reserved: int, billed: int, cost: float | None, provider: str,
                     outcome: Outcome, drift: int | None, reserved_usd: float = 0.0) -> None: ...

    async def release(self, dataset: str, reserved: int, provider: str, outcome: Outcome,
                      reserved_usd: float = 0.0) -> None: ...

    async def halt(self, reason: str) -> None: ...


class _OpsClient:
    """The op vocabulary on top of a ``_submit`` that runs one op and returns its result."""

    excluded: tuple[str, ...] = ()
    halted: str | None = None  # why the source stopped sending, as the ledger last said

    async def _submit(self, op: Op) -> Any:
        raise NotImplementedError

    async def reserve(self, dataset: str, tokens: int, usd: float = 0.0) -> Decision:
        return await self._submit(("reserve", dataset, tokens, usd))

    async def settle(self, dataset: str, reserved: int, billed: int, cost: float | None, provider: str,
                     outcome: Outcome, drift: int | None, reserved_usd: float = 0.0) -> None:
        await self._submit(("settle", dataset, reserved, billed, cost, provider, outcome, drift, reserved_usd))

    async def release(self, dataset: str, reserved: int, provider: str, outcome: Outcome,
                      reserved_usd: float = 0.0) -> None:
        await self._submit(("release", dataset, reserved, provider, outcome, reserved_usd))

    async def halt(self, reason: str) -> None:
        await self._submit(("halt", reason))


class LocalLedgerClient(_OpsClient):
    """An in-process ledger (single process, tests, benchmarks): direct calls, no op batching."""

    def __init__(self, ledger: Ledger, holder: str = "") -> None:
        self.ledger = ledger
        self.holder = holder

    async def _submit(self, op: Op) -> Any:
        results, self.excluded, self.halted = self.ledger.apply([op], self.holder)
        return results[0]

    async def reserve(self, dataset: str, tokens: int, usd: float = 0.0) -> Decision:
        decision = self.ledger.reserve(dataset, tokens, usd, holder=self.holder)
        self.halted = self.ledger.halted
        return decision

    async def settle(self, dataset: str, reserved: int, billed: int, cost: float | None, provider: str,
                     outcome: Outcome, drift: int | None, reserved_usd: float = 0.0) -> None:
        self.ledger.settle(dataset, reserved, billed, cost, provider, outcome, drift, reserved_usd,
                           holder=self.holder)
        self.excluded = self.ledger.health.excluded

    async def release(self, dataset: str, reserved: int, provider: str, outcome: Outcome,
                      reserved_usd: float = 0.0) -> None:
        self.ledger.release(dataset, reserved, provider, outcome, reserved_usd, holder=self.holder)
        self.excluded = self.ledger.health.excluded


class RayLedgerClient(_OpsClient):
    """The ledger Ray actor, with ops coalesced into batched ``apply`` calls (one in flight at a time).

    Every call renews this holder's lease on its reservations; while requests are in flight and no op is due,
    an empty call every ``beat_s`` keeps it alive, so only a dead (or frozen) actor's reservations lapse."""

    def __init__(self, handle: Any, max_batch: int = 4096, holder: str = "", beat_s: float = 10.0) -> None:
        self.handle = handle
        self.max_batch = max_batch
        self.holder = holder
        self.beat_s = beat_s
        self._pending: list[tuple[Op, asyncio.Future]] = []
        self._flusher: asyncio.Task | None = None
        self._beater: asyncio.Task | None = None
        self._last_call = 0.0
        self.calls = 0

    async def _submit(self, op: Op) -> Any:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._pending.append((op, fut))
        if self._flusher is None or self._flusher.done():
            self._flusher = loop.create_task(self._flush())
        if self.holder and (self._beater is None or self._beater.done()):
            self._beater = loop.create_task(self._beat())
        return await fut

    async def _beat(self) -> None:
        """Renew the lease while nothing else calls the ledger (long generations); ends with the event loop."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.beat_s)
            if loop.time() - self._last_call >= self.beat_s and (self._flusher is None or self._flusher.done()):
                try:
                    _, self.excluded, self.halted = await self.handle.apply.remote([], self.holder)
                except Exception:  # noqa: BLE001 - a missed beat only risks a lapse; the next op renews it
                    pass
                self._last_call = loop.time()

    async def _flush(self) -> None:
        while self._pending:
            await asyncio.sleep(0)  # let ops issued in this loop tick join the batch
            batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch:]
            self.calls += 1
            self._last_call = asyncio.get_running_loop().time()
            try:
                results, excluded, halted = await self.handle.apply.remote([op for op, _ in batch], self.holder)
            except BaseException as e:  # noqa: BLE001 - every waiter must hear about it
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(e if isinstance(e, Exception) else RuntimeError(repr(e)))
                if not isinstance(e, Exception):
                    raise
                continue
            self.excluded, self.halted = tuple(excluded), halted
            for (_, fut), res in zip(batch, results, strict=True):
                if not fut.done():
                    fut.set_result(res)


def ledger_client(ledger: Any, holder: str = "", lease_s: float = 60.0) -> LedgerClient:
    """A client for a ``Ledger`` object (in process) or a Ray actor handle of one; ``holder`` names whose
    reservations these are (one engine in one actor), for their lease, renewed four times per ``lease_s``."""
    if isinstance(ledger, Ledger):
        return LocalLedgerClient(ledger, holder)
    return RayLedgerClient(ledger, holder=holder, beat_s=lease_s / 4)

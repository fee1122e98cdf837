"""Async access to the shared ledger from an actor's event loop.

Hundreds of requests per actor reserve and settle at once; one Ray call each
would cost more CPU than the HTTP request. Ops queued while a call is in flight
go out together in the next one, so the number of Ray calls per actor tracks
the ledger's round-trip time, not the request rate.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from pipeline.ledger import Decision, Ledger, Op, Outcome


class LedgerClient(Protocol):
    excluded: tuple[str, ...]
    halted: str | None

    async def reserve(self, dataset: str, tokens: int) -> Decision: ...

    async def settle(self, dataset: str, reserved: int, billed: int, cost: float, provider: str,
                     outcome: Outcome, drift: int | None) -> None: ...

    async def release(self, dataset: str, reserved: int, provider: str, outcome: Outcome) -> None: ...

    async def halt(self, reason: str) -> None: ...


class _OpsClient:
    """The op vocabulary on top of a ``_submit`` that runs one op and returns its result."""

    excluded: tuple[str, ...] = ()
    halted: str | None = None  # why the source stopped sending, as the ledger last said

    async def _submit(self, op: Op) -> Any:
        raise NotImplementedError

    async def reserve(self, dataset: str, tokens: int) -> Decision:
        return await self._submit(("reserve", dataset, tokens))

    async def settle(self, dataset: str, reserved: int, billed: int, cost: float, provider: str,
                     outcome: Outcome, drift: int | None) -> None:
        await self._submit(("settle", dataset, reserved, billed, cost, provider, outcome, drift))

    async def release(self, dataset: str, reserved: int, provider: str, outcome: Outcome) -> None:
        await self._submit(("release", dataset, reserved, provider, outcome))

    async def halt(self, reason: str) -> None:
        await self._submit(("halt", reason))


class LocalLedgerClient(_OpsClient):
    """An in-process ledger (single process, tests, benchmarks): direct calls, no op batching."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    async def _submit(self, op: Op) -> Any:
        results, self.excluded, self.halted = self.ledger.apply([op])
        return results[0]

    async def reserve(self, dataset: str, tokens: int) -> Decision:
        decision = self.ledger.reserve(dataset, tokens)
        self.halted = self.ledger.halted
        return decision

    async def settle(self, dataset: str, reserved: int, billed: int, cost: float, provider: str,
                     outcome: Outcome, drift: int | None) -> None:
        self.ledger.settle(dataset, reserved, billed, cost, provider, outcome, drift)
        self.excluded = self.ledger.health.excluded

    async def release(self, dataset: str, reserved: int, provider: str, outcome: Outcome) -> None:
        self.ledger.release(dataset, reserved, provider, outcome)
        self.excluded = self.ledger.health.excluded


class RayLedgerClient(_OpsClient):
    """The ledger Ray actor, with ops coalesced into batched ``apply`` calls (one in flight at a time)."""

    def __init__(self, handle: Any, max_batch: int = 4096) -> None:
        self.handle = handle
        self.max_batch = max_batch
        self._pending: list[tuple[Op, asyncio.Future]] = []
        self._flusher: asyncio.Task | None = None
        self.calls = 0

    async def _submit(self, op: Op) -> Any:
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((op, fut))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush())
        return await fut

    async def _flush(self) -> None:
        while self._pending:
            await asyncio.sleep(0)  # let ops issued in this loop tick join the batch
            batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch:]
            self.calls += 1
            try:
                results, excluded, halted = await self.handle.apply.remote([op for op, _ in batch])
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


def ledger_client(ledger: Any) -> LedgerClient:
    """A client for a ``Ledger`` object (in process) or a Ray actor handle of one."""
    if isinstance(ledger, Ledger):
        return LocalLedgerClient(ledger)
    return RayLedgerClient(ledger)

"""A circuit breaker for one HTTP source actor: stop hammering an API that is down, probe before resuming.

Closed: requests go out. After ``threshold`` transient failures in a row the
circuit opens: requests wait (without spending attempts or budget) for a
cool-down, then exactly one probe goes out. A probe that succeeds closes the
circuit; one that fails re-opens it with twice the cool-down (up to
``max_cooldown_s``). When the circuit has stayed open for ``give_up_s`` the
source is taken as down for this run: waiting rows are left to do, so a re-run
(once the API is back) picks them up. Pure: the caller passes the clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Admit = Literal["go", "wait", "give_up"]


@dataclass
class Circuit:
    threshold: int = 20
    cooldown_s: float = 5.0
    max_cooldown_s: float = 120.0
    give_up_s: float = 600.0
    consecutive: int = 0
    opened_at: float | None = None
    open_until: float = 0.0
    cooldown: float = 0.0
    probing: bool = False
    last_error: str = ""

    @property
    def is_open(self) -> bool:
        return self.opened_at is not None

    def admit(self, now: float) -> Admit:
        """Whether a request may go out now; ``wait`` means ask again shortly (see ``wait_s``)."""
        if self.opened_at is None:
            return "go"
        if now - self.opened_at >= self.give_up_s:
            return "give_up"
        if now >= self.open_until and not self.probing:
            self.probing = True
            return "go"
        return "wait"

    def unsent(self) -> None:
        """The request ``admit`` let go never went out (its budget was held): a probe is still owed."""
        self.probing = False

    def wait_s(self, now: float) -> float:
        """How long until asking again is worth it (at most a second, so a give-up is noticed on time)."""
        return max(0.05, min(1.0, self.open_until - now)) if self.is_open else 0.0

    def record(self, ok: bool, now: float, error: str = "") -> None:
        """An answer came back: ``ok`` when the API is up (any non-transient answer), else a transient failure."""
        if ok:
            self.consecutive, self.opened_at, self.probing, self.cooldown = 0, None, False, 0.0
            return
        self.consecutive += 1
        self.last_error = error or self.last_error
        if self.probing:  # the probe failed: stay open, longer
            self.probing = False
            self.cooldown = min(self.max_cooldown_s, self.cooldown * 2)
            self.open_until = now + self.cooldown
        elif self.opened_at is None and self.consecutive >= self.threshold:
            self.opened_at, self.cooldown = now, self.cooldown_s
            self.open_until = now + self.cooldown

    def describe(self, now: float) -> str:
        since = f" for {now - self.opened_at:.0f}s" if self.opened_at is not None else ""
        return f"API unreachable{since} after {self.consecutive} failures in a row (last: {self.last_error})"

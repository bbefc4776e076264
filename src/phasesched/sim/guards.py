"""What keeps a simulation honest: it ends, or it raises :class:`SimulationError`.

Two ways a discrete-event loop can go wrong without a crash, and the check against each:

* **The clock runs out of resolution.** Simulated time is float64 seconds. Far from ``t = 0`` an
  instant and the next representable one are far apart (about 16,000 s apart at ``1e20`` s), so
  a step's duration added to the clock rounds away and latencies read as 0. Below
  :data:`MAX_CLOCK_S` (``2**32`` s, about 136 years) the clock resolves 1 µs or better, which
  keeps every millisecond metric exact to about a part in a thousand; past it the simulation
  refuses to go on (:func:`check_clock`).
* **Events that move nothing.** A handler that keeps queueing events at the current instant
  without anything changing (no arrival, step, transfer or finish) would spin for ever.
  :class:`Watchdog` counts such events and raises after :data:`STALL_EVENTS`.
"""

from __future__ import annotations

import attrs

from phasesched.errors import PhaseschedError

__all__ = ["MAX_CLOCK_S", "STALL_EVENTS", "SimulationError", "Watchdog", "check_clock"]

MAX_CLOCK_S = float(2**32)
"""Seconds simulated time may reach; below it float64 seconds resolve 1 µs (``2**-20`` s) or better."""

STALL_EVENTS = 10_000
"""Events in a row at one instant that change nothing, after which a simulation is stuck."""


class SimulationError(PhaseschedError, RuntimeError):
    """A simulation cannot go on: it stalled, or its clock lost the resolution its metrics need."""


def check_clock(now: float) -> None:
    """Raise :class:`SimulationError` if simulated time ``now`` is past :data:`MAX_CLOCK_S`.

    >>> check_clock(1e9)                      # about 32 years: resolved to 0.1 µs
    >>> check_clock(1e20)
    Traceback (most recent call last):
    ...
    phasesched.sim.guards.SimulationError: simulated time reached 1e+20 s, past 2**32 s ...
    """
    if now > MAX_CLOCK_S:
        msg = (
            f"simulated time reached {now:.6g} s, past 2**32 s (about 136 years), where float64 "
            "seconds no longer resolve 1 µs; start the workload's arrival times near 0"
        )
        raise SimulationError(msg)


@attrs.define
class Watchdog:
    """Counts consecutive events that change nothing; too many is a :class:`SimulationError`.

    Call :meth:`event` after handling each event, with its time and a counter that grows
    whenever the simulation changes state (an arrival, a step, a transfer landing).

    >>> dog = Watchdog(limit=2)
    >>> dog.event(1.0, progress=5); dog.event(1.0, progress=6); dog.event(2.0, progress=6)
    >>> dog.event(2.0, progress=6); dog.event(2.0, progress=6)
    Traceback (most recent call last):
    ...
    phasesched.sim.guards.SimulationError: the simulation made no progress in 2 events at t = 2 s ...
    """

    limit: int = STALL_EVENTS
    _last: tuple[float, int] | None = None
    _idle: int = 0

    def event(self, now: float, progress: int) -> None:
        """Record one event at ``now``; raise if the last ``limit`` events changed nothing."""
        mark = (now, progress)
        self._idle = self._idle + 1 if mark == self._last else 0
        self._last = mark
        if self._idle >= self.limit:
            msg = (
                f"the simulation made no progress in {self.limit} events at t = {now:.6g} s "
                "(events keep arriving at one instant and change nothing)"
            )
            raise SimulationError(msg)

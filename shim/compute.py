"""A training step's compute time, measured by every rank and agreed over the job's ranks (job policy
``measured_intensity``: the agents order jobs by compute seconds per all-reduced byte, Crux's GPU intensity).

The step's *compute* is the time from one synchronized backward's end (its last bucket's launch) to the next, less
the time the training thread waited for the shim's all-reduces in between: in hook mode DDP's wait for the last
step's pieces (launch of its last bucket to the last completion the shim saw), in overlap mode the waits in the
forward pre-hooks. What remains is forward, backward, the optimizer, data loading: the time the job does not need
the network, whatever contention its all-reduces met. Host clock: on a CUDA device the times are those the host
sees (kernel launches and completed futures), an estimate of the device's.

Agents on different hosts must order two jobs alike, so every rank must report the same number: the clock keeps a
window of samples (1, 2, 4, ... then 64 steps; the first two steps, with DDP's bucket rebuild and the shim's start,
are left out), and at its end each rank contributes its window's median in microseconds to one integer all-reduce
(sum) on the shim's own group, launched at the same step on every rank (``window_due``). The mean over ranks, read
when the all-reduce has completed, becomes ``compute_s`` if it differs from the value in force by more than 10 %
(less would only churn the agents' order): the same integer inputs and the same rule on every rank give the same
value. No torch here: the collective is the caller's (``ShimState``).

``StepWindow`` keeps the wall-clock ends of the last few steps, which job policy ``slowdown`` ranks jobs by.

Usage::

    clock = ComputeClock()
    clock.step_end(now, hook_waited=True)          # at each synchronized backward's last launch
    if clock.window_due(): work = launch(clock.take_window())   # int microseconds, all-reduced (sum)
    ... clock.agreed(total_us, world)              # when it completed: True if compute_s changed
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tensorlane.policies.jobs import SLOWDOWN_WINDOW

FIRST_WINDOW = 1  # samples in the first window: agreed at the third step's end, read at a later step's end
LAST_WINDOW = 64  # windows double up to this many steps
CHANGE = 0.10  # a new agreed value replaces the one in force only if it differs by more than this fraction


@dataclass
class ComputeClock:
    """Per-step compute samples of one rank and the value agreed over the ranks (``compute_s``; 0: none yet).

    Not thread-safe by itself: the shim calls it under its state's lock (completions arrive on gloo's thread).
    """

    compute_s: float = 0.0  # agreed over the job's ranks; reported to the agent
    agreements: int = 0  # all-reduces completed
    steps: int = 0  # synchronized steps ended (last bucket launched)
    window: int = FIRST_WINDOW
    samples: list = field(default_factory=list)  # this window's compute seconds, this rank
    _last_end: float | None = None  # host time of the last step's end
    _hook_waited: bool = False  # DDP waited for the last step's pieces (hook mode, probing)
    _done: float = 0.0  # latest completion of the last step's pieces seen after its end
    _waited_s: float = 0.0  # overlap mode: seconds waited in forward pre-hooks since the last step's end

    def completed(self, step: int, now: float) -> None:
        """Pieces launched in step ``step`` were seen complete at ``now``."""
        if step == self.steps - 1:
            self._done = max(self._done, now)

    def waited(self, seconds: float) -> None:
        """The training thread waited ``seconds`` for pieces (overlap mode's forward pre-hooks)."""
        self._waited_s += max(0.0, seconds)

    def step_end(self, now: float, hook_waited: bool) -> None:
        """A synchronized backward launched its last bucket at ``now``: take the compute since the last one as a
        sample (from the second step on). ``hook_waited``: DDP will wait for this step's pieces before
        ``backward()`` returns (hook mode and overlap's probe), so that wait is not compute."""
        if self._last_end is not None and self.steps >= 2:  # every step from the third end on, on every rank
            blocked = self._waited_s + (max(0.0, self._done - self._last_end) if self._hook_waited else 0.0)
            self.samples.append(max(0.0, now - self._last_end - blocked))
        self._last_end, self._hook_waited, self._done, self._waited_s = now, hook_waited, now, 0.0
        self.steps += 1

    def window_due(self) -> bool:
        """Whether this rank's window is full: at the same step on every rank, since every step's end adds one
        sample (so the ranks launch the agreeing all-reduce together)."""
        return len(self.samples) >= self.window

    def take_window(self) -> int:
        """This window's lower median in whole microseconds (this rank's part of the all-reduce): of an even
        window the smaller middle sample, so that one long pause between two steps (an evaluation, a checkpoint, a
        barrier) does not become a two-step window's value; starts the next window, twice as long up to
        ``LAST_WINDOW``."""
        ordered = sorted(self.samples)
        median = ordered[(len(ordered) - 1) // 2]
        self.samples, self.window = [], min(self.window * 2, LAST_WINDOW)
        return max(1, round(median * 1e6))

    def agreed(self, total_us: int, world: int) -> bool:
        """The all-reduce completed with ``total_us`` (the sum of every rank's median): the mean over the ``world``
        ranks becomes ``compute_s`` unless within ``CHANGE`` of the value in force. Returns whether it changed."""
        self.agreements += 1
        value = (int(total_us) // max(1, int(world))) / 1e6
        if value <= 0 or (self.compute_s > 0 and abs(value - self.compute_s) <= CHANGE * self.compute_s):
            return False
        self.compute_s = value
        return True


@dataclass
class StepWindow:
    """The wall-clock ends of a rank's last steps (job policy ``slowdown``): the agents rank a job by the time since
    the end of the step ``SLOWDOWN_WINDOW`` steps before its last one, over that many ideal steps plus the one under
    way (``policies.jobs.slowdown_rank``). A step ends when its communication has: its last bucket launched and
    every piece complete (``ShimState`` calls ``step_end``), not at the launch ``ComputeClock`` takes, where the job
    still waits for its last bytes and must not drop back yet. On this host's wall clock, which the agent reads too.

    Usage: ``w = StepWindow(); w.step_end(time.time()); w.start, w.steps``
    """

    ends: deque = field(default_factory=lambda: deque(maxlen=SLOWDOWN_WINDOW + 1))

    def step_end(self, wall_s: float) -> None:
        self.ends.append(wall_s)

    @property
    def start(self) -> float:
        """The wall-clock end of the window's first step (0: fewer than two steps ended)."""
        return self.ends[0] if len(self.ends) >= 2 else 0.0

    @property
    def steps(self) -> int:
        """The steps ended since ``start`` (0 to ``SLOWDOWN_WINDOW``)."""
        return len(self.ends) - 1 if len(self.ends) >= 2 else 0

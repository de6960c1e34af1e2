"""The shim's measurement of a training step's compute time (``shim.compute.ComputeClock``), with made-up times:
what counts as compute, the windows, the agreement rule; the wall-clock window of the last steps (``StepWindow``).
The real collective is tested in test_shim.py."""
from __future__ import annotations

from tensorlane.policies.jobs import SLOWDOWN_WINDOW
from tensorlane.shim.compute import CHANGE, FIRST_WINDOW, LAST_WINDOW, ComputeClock, StepWindow


def run_hook_steps(clock: ComputeClock, n: int, compute: float, wait: float, t: float = 100.0) -> float:
    """``n`` hook-mode steps: ``compute`` seconds of work, then DDP waits ``wait`` for the pieces."""
    for _ in range(n):
        t += compute
        clock.completed(clock.steps, t - compute / 2)  # an early bucket completes during the backward: not a wait
        clock.step_end(t, hook_waited=True)
        t += wait
        clock.completed(clock.steps - 1, t)  # the last piece, after the step's end: DDP waited for it
    return t


def test_hook_mode_waits_are_not_compute_and_the_first_steps_are_left_out():
    clock = ComputeClock()
    t = run_hook_steps(clock, 2, compute=9.0, wait=5.0)  # the first two ends give no sample (start-up)
    assert clock.samples == [] and clock.steps == 2
    assert not clock.window_due()
    run_hook_steps(clock, FIRST_WINDOW, compute=0.3, wait=0.7, t=t)
    assert [round(s, 9) for s in clock.samples] == [0.3] * FIRST_WINDOW and clock.window_due()


def test_overlap_mode_counts_forward_waits_only():
    clock = ComputeClock()
    t = 0.0
    for _ in range(4):
        clock.waited(0.2)  # the forward pre-hooks waited for the last step's pieces
        t += 1.0
        clock.completed(clock.steps - 1, t - 0.5)  # seen complete in the forward: not a wait of DDP's
        clock.step_end(t, hook_waited=False)
    assert [round(s, 9) for s in clock.samples] == [0.8, 0.8]


def test_windows_double_and_take_the_median_in_microseconds():
    clock = ComputeClock()
    clock.samples = [0.5, 0.1, 0.2]
    assert clock.take_window() == 200_000 and clock.samples == [] and clock.window == 2 * FIRST_WINDOW
    clock.samples = [0.3, 2.0]  # one step that also waited 1.7 s outside training (a benchmark's release, an eval)
    assert clock.take_window() == 300_000
    for _ in range(10):
        clock.samples = [0.1] * clock.window
        clock.take_window()
    assert clock.window == LAST_WINDOW


def test_agreed_value_is_the_mean_and_changes_only_beyond_the_threshold():
    clock = ComputeClock()
    assert clock.agreed(300_000 + 500_000, 2) and clock.compute_s == 0.4
    assert not clock.agreed(2 * round(400_000 * (1 + CHANGE * 0.9)), 2) and clock.compute_s == 0.4
    assert clock.agreed(2 * 500_000, 2) and clock.compute_s == 0.5
    assert not clock.agreed(0, 3) and clock.agreements == 4


def test_step_window_spans_the_last_steps():
    """The window begins at the end of the step ``SLOWDOWN_WINDOW`` steps before the last one; nothing until two
    steps have ended (one end alone spans no step)."""
    w = StepWindow()
    assert (w.start, w.steps) == (0.0, 0)
    w.step_end(100.0)
    assert (w.start, w.steps) == (0.0, 0)
    for i in range(1, 8):
        w.step_end(100.0 + i)
        assert w.steps == min(i, SLOWDOWN_WINDOW) and w.start == 100.0 + max(0, i - SLOWDOWN_WINDOW)

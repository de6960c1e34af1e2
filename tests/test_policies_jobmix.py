"""The fluid model of jobs sharing a link under a job order (policies/jobmix.py), checked by hand."""
from __future__ import annotations

import pytest

from tensorlane.policies.jobmix import MixJob, link_rates, simulate_mix


def test_link_rates_by_hand():
    assert link_rates([0, 1], None, 0.8, {0, 1}) == {0: 0.5, 1: 0.5}  # FIFO: equal shares of the jobs sending
    assert link_rates([0, 2], [2, 1, 0], 0.6, {0, 1, 2}) == pytest.approx({0: 0.3, 2: 0.7})  # parts of 2 sending
    assert link_rates([0, 2], [2, 1, 0], 0.6, {0, 1, 2}, among="present") == pytest.approx({0: 0.2, 2: 0.8})
    assert link_rates([1], [0, 1], 0.6, {0, 1}) == pytest.approx({1: 1.0})  # alone on the link: all of it
    assert link_rates([0, 1], [1, 0], 0.0, {0, 1}) == {0: 0.0, 1: 1.0}  # strict order
    assert link_rates([], [0], 0.5, {0}) == {}
    with pytest.raises(ValueError, match="among"):
        link_rates([0, 1], [0, 1], 0.5, {0, 1}, among="all")


def test_one_job_takes_its_iterations():
    assert simulate_mix([MixJob(0.3, 0.2, 5, offset_s=1.0)]) == pytest.approx([2.5])


def test_link_bound_jobs_fifo_and_orders():
    """Two jobs that only communicate: FIFO halves the link for both; a strict order finishes the first at its own
    speed and the second after both; parts of 0.5 give the second a quarter while both send."""
    jobs = [MixJob(0.0, 1.0, 3), MixJob(0.0, 1.0, 3)]
    assert simulate_mix(jobs) == pytest.approx([6.0, 6.0])
    assert simulate_mix(jobs, order=[0, 1]) == pytest.approx([3.0, 6.0])
    first, second = simulate_mix(jobs, order=[0, 1], job_share=0.5)
    assert first == pytest.approx(3 / 0.75) and second == pytest.approx(6.0)


def test_an_order_interleaves_colliding_jobs():
    """Two jobs in lockstep, compute = communication = 0.5 s (the case CASSINI targets): under FIFO each iteration
    takes 0.5 + 1.0 s; a strict order lets the second communicate while the first computes: 4.0 and 4.5 s against
    6.0, an average of 0.71x FIFO."""
    jobs = [MixJob(0.5, 0.5, 4), MixJob(0.5, 0.5, 4)]
    assert simulate_mix(jobs) == pytest.approx([6.0, 6.0])
    assert simulate_mix(jobs, order=[0, 1]) == pytest.approx([4.0, 4.5])
    assert simulate_mix(jobs, order=[1, 0]) == pytest.approx([4.5, 4.0])


def test_bad_orders_are_refused():
    with pytest.raises(ValueError, match="order"):
        simulate_mix([MixJob(1, 1, 1), MixJob(1, 1, 1)], order=[0, 0])

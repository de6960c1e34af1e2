"""The fluid model of jobs sharing a link under a job order (policies/jobmix.py), checked by hand."""
from __future__ import annotations

import pytest

from tensorlane.policies.jobmix import MixJob, link_order_rates, link_rates, simulate_links, simulate_mix


def test_link_rates_by_hand():
    assert link_rates([0, 1], None, 0.8, {0, 1}) == {0: 0.5, 1: 0.5}  # FIFO: equal shares of the jobs sending
    assert link_rates([0, 2], [2, 1, 0], 0.6, {0, 1, 2}) == pytest.approx({0: 0.3, 2: 0.7})  # parts of 2 sending
    assert link_rates([0, 2], [2, 1, 0], 0.6, {0, 1, 2}, among="present") == pytest.approx({0: 0.2, 2: 0.8})
    assert link_rates([1], [0, 1], 0.6, {0, 1}) == pytest.approx({1: 1.0})  # alone on the link: all of it
    assert link_rates([0, 1], [1, 0], 0.0, {0, 1}) == {0: 0.0, 1: 1.0}  # strict order
    assert link_rates([], [0], 0.5, {0}) == {}
    with pytest.raises(ValueError, match="among"):
        link_rates([0, 1], [0, 1], 0.5, {0, 1}, among="all")


def test_even_borrowing_by_hand():
    """``borrow="even"`` (a design the agent does not have): parts of the jobs present, the most urgent present
    job's part also holds the link the parts leave, and what idle jobs' parts leave is shared evenly by the jobs
    sending; two jobs: the agent's own parts (the order's borrowing) give the same."""
    present = {0, 1, 2}
    assert link_rates([1, 2], [0, 1, 2], 0.9, present, borrow="even") == pytest.approx({1: 0.5, 2: 0.5})
    assert link_rates([0, 2], [0, 1, 2], 0.9, present, borrow="even") == pytest.approx({0: 0.55, 2: 0.45})
    assert link_rates([2], [0, 1, 2], 0.9, present, borrow="even") == pytest.approx({2: 1.0})
    for sending in ([0, 1], [1]):
        assert link_rates(sending, [1, 0], 0.2, {0, 1}, borrow="even") == pytest.approx(
            link_rates(sending, [1, 0], 0.2, {0, 1}))
    with pytest.raises(ValueError, match="borrow"):
        link_rates([0, 1], [0, 1], 0.5, {0, 1}, borrow="fair")
    jobs = [MixJob(0.5, 0.5, 4), MixJob(0.5, 0.5, 4, offset_s=0.25), MixJob(0.3, 0.4, 4, offset_s=0.1)]
    assert simulate_mix(jobs, [2, 0, 1], 0.9999, borrow="even") == pytest.approx(simulate_mix(jobs), rel=1e-3)


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


def test_sampled_parts_lag_behind_a_job_that_starts():
    """The agent counts a job as sending only at its next sample. Jobs 0 and 1 send all along, job 3 computes
    (present, idle), job 2 starts sending at 0.25 s; samples every 0.5 s, no hold, job_share 0.8. Until the sample
    at 0.5 s job 2 keeps an idle part: 0.8 / 4 would be 0.2, but jobs 0 and 1 keep 0.4 each and the parts never
    add up to more than the link, so the idle jobs 2 and 3 share the 0.2 left, and job 2 carries 0.025; then each
    of the three senders has 0.8 / 3, and job 2's other 0.475 take 1.78125 s: a JCT of 2.03125 s, against
    0.5 / (0.8 / 3) = 1.875 s if the agent saw it start at once."""
    jobs = [MixJob(0.0, 100.0, 1), MixJob(0.0, 100.0, 1), MixJob(0.0, 0.5, 1, offset_s=0.25), MixJob(100.0, 1.0, 1)]
    order = [0, 1, 2, 3]
    assert simulate_mix(jobs, order, 0.8, sample_s=0.5)[2] == pytest.approx(2.03125)
    assert simulate_mix(jobs, order, 0.8)[2] == pytest.approx(1.875)


def test_a_held_count_costs_the_lower_senders():
    """A job counted as sending after it stopped (``hold_s``) keeps its part; that part goes to the most urgent
    sender, not to the others: job 1 finishes later and job 0 earlier with a hold of 1 s than with none. FIFO
    does not depend on samples."""
    jobs = [MixJob(0.0, 6.0, 1), MixJob(0.0, 3.0, 1), MixJob(1.5, 0.2, 3), MixJob(100.0, 1.0, 1)]
    order = [0, 1, 2, 3]
    held = simulate_mix(jobs, order, 0.8, sample_s=0.5, hold_s=1.0)
    prompt = simulate_mix(jobs, order, 0.8, sample_s=0.5)
    assert held[1] > prompt[1] + 0.05 and held[0] < prompt[0]
    assert simulate_mix(jobs, sample_s=0.5, hold_s=1.0) == pytest.approx(simulate_mix(jobs))


def test_fast_samples_approach_the_ideal():
    jobs = [MixJob(0.84, 0.36, 4), MixJob(0.65, 0.35, 4, 1.0), MixJob(1.05, 0.45, 4, 2.0), MixJob(0.59, 0.31, 4, 3.0)]
    ideal = simulate_mix(jobs, [0, 2, 1, 3], 0.8)
    assert simulate_mix(jobs, [0, 2, 1, 3], 0.8, sample_s=1e-4) == pytest.approx(ideal, rel=1e-3)
    with pytest.raises(ValueError, match="sample_s"):
        simulate_mix(jobs, [0, 2, 1, 3], 0.8, sample_s=-1.0)


def test_link_order_rates_by_hand():
    """Several links: FIFO is max-min fair (a job held back on one link leaves the rest of another to its
    neighbour); an order serves each job in turn with what all its links leave beside the others' parts."""
    ring = [(2, 0), (0, 1), (1, 2)]
    assert link_order_rates([0, 1], ring, None, 0.0) == pytest.approx({0: 0.5, 1: 0.5})
    assert link_order_rates([0, 1, 2], [(0, 1), (1, 2)], None, 0.0) == pytest.approx({0: 0.5, 1: 0.5, 2: 0.5})
    assert link_order_rates([0, 1], [(0, 1), (1,)], None, 0.0) == pytest.approx({0: 0.5, 1: 0.5})
    assert link_order_rates([0, 1, 2], ring, [1, 0, 2], 0.2) == pytest.approx({1: 0.9, 0: 0.1, 2: 0.1})
    assert link_order_rates([0, 2], ring, [0, 2], 0.0) == {0: 1.0, 2: 0.0}
    assert link_order_rates([], ring, None, 0.5) == {}


def test_simulate_links_on_one_link_is_simulate_mix():
    """On one link FIFO and a static order give ``simulate_mix``'s JCTs (the parts counted at once)."""
    jobs = [MixJob(0.84, 0.36, 6), MixJob(0.65, 0.35, 6, offset_s=1.0), MixJob(1.05, 0.45, 5, offset_s=2.0)]
    assert simulate_links(jobs) == pytest.approx(simulate_mix(jobs))
    for share in (0.0, 0.2, 0.95):
        assert simulate_links(jobs, order=[2, 0, 1], job_share=share) == pytest.approx(
            simulate_mix(jobs, order=[2, 0, 1], job_share=share))
    with pytest.raises(ValueError, match="order"):
        simulate_links(jobs, order="fastest")


def test_slowdown_interleaves_and_keeps_every_job_within_fifo():
    """``slowdown`` (the agents' order that moves with the clock) with no table: two jobs in lockstep take turns
    (the average at about 0.73x FIFO, each job within 1.05x alone, as a static order gives); on a ring of four
    links, each job on two of them beside a different job on each (bench.jobs' spread4), no job is slower than
    under FIFO."""
    pair = [MixJob(1.2 * 0.55, 1.2 * 0.45, 12), MixJob(1.2 * 0.6, 1.2 * 0.4, 12)]
    fifo, slow = simulate_links(pair), simulate_links(pair, order="slowdown", job_share=0.2)
    assert sum(slow) / sum(fifo) < 0.75 and max(s / 14.4 for s in slow) < 1.05
    ring = [(3, 0), (0, 1), (1, 2), (2, 3)]
    four = [MixJob(p * (1 - f), p * f, 12, off) for p, f, off in ((1.2, 0.45, 0), (1.0, 0.4, 1), (1.5, 0.45, 2),
                                                                   (0.9, 0.4, 3))]
    fifo, slow = simulate_links(four, ring), simulate_links(four, ring, order="slowdown", job_share=0.2)
    assert max(s / f for s, f in zip(slow, fifo, strict=True)) < 1.0

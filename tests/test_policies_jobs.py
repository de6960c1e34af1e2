"""Job-side priorities (TensorLights, Crux): hand-checked orders and agent agreement."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.jobs import Job, gpu_intensity, gpu_intensity_order, job_levels, rotate_job_order, static_job_order

JOBS = [Job("c", priority=1), Job("a", priority=1), Job("b", priority=0)]


def test_static_order_by_hand() -> None:
    """b has static priority 0; a and c tie at 1 and go by id."""
    assert static_job_order(JOBS) == ("b", "a", "c")
    with pytest.raises(ValueError):
        static_job_order([Job("a"), Job("a")])


def test_rotation_by_hand() -> None:
    """Ids sorted a, b, c; epoch 20 s: [0, 20) -> a b c, [20, 40) -> b c a, [40, 60) -> c a b, 60 -> a b c."""
    assert rotate_job_order(JOBS, 20.0, 0.0) == ("a", "b", "c")
    assert rotate_job_order(JOBS, 20.0, 19.999) == ("a", "b", "c")
    assert rotate_job_order(JOBS, 20.0, 20.0) == ("b", "c", "a")
    assert rotate_job_order(JOBS, 20.0, 45.0) == ("c", "a", "b")
    assert rotate_job_order(JOBS, 20.0, 60.0) == ("a", "b", "c")
    assert rotate_job_order([], 20.0, 5.0) == ()
    with pytest.raises(ValueError):
        rotate_job_order(JOBS, 0.0, 1.0)


def test_gpu_intensity_by_hand() -> None:
    """x: 0.2 s compute, 10 MB over 1 Gbit/s = 0.08 s -> 2.5; y: 0.1 s, 1 MB over 1 Gbit/s = 0.008 s -> 12.5;
    z: 0.5 s, 100 MB at 10 Gbit/s = 0.08 s -> 6.25; w sends nothing -> infinite (first)."""
    jobs = [Job("x", 0.2, 10_000_000, 1e9), Job("y", 0.1, 1_000_000, 1e9), Job("z", 0.5, 100_000_000, 10e9),
            Job("w", 1.0, 0, 0.0)]
    assert gpu_intensity(jobs[0]) == pytest.approx(2.5) and gpu_intensity(jobs[1]) == pytest.approx(12.5)
    assert math.isinf(gpu_intensity(jobs[3]))
    assert gpu_intensity_order(jobs) == ("w", "y", "z", "x")
    # Crux's correction factor can move a job: x corrected by 4 -> 10.0, between y and z
    assert gpu_intensity_order(jobs[:3] + [Job("x2", 0.2, 10_000_000, 1e9, correction=4.0)])[:2] == ("y", "x2")
    # equal intensity: by job id
    assert gpu_intensity_order([Job("q", 1.0, 1000, 1e6), Job("p", 1.0, 1000, 1e6)]) == ("p", "q")


def test_job_levels() -> None:
    """8 queues, 3 reserved -> 5 levels; 7 jobs spread 2,1,... keeping order (least urgent filled first)."""
    lv = job_levels(tuple("abcdefg"))
    assert list(lv.values()) == sorted(lv.values()) and set(lv.values()) == {0, 1, 2, 3, 4}
    assert job_levels(("b", "a")) == {"b": 0, "a": 1}


job_st = st.builds(Job, st.text("abcdefgh", min_size=1, max_size=3), st.floats(0, 10),
                   st.integers(0, 10**9), st.floats(1e6, 1e11), st.integers(0, 3), st.floats(0.5, 2))


@settings(max_examples=100, deadline=None)
@given(st.lists(job_st, min_size=0, max_size=8, unique_by=lambda j: j.job_id), st.randoms(), st.floats(0, 1e6))
def test_every_agent_computes_the_same_order(jobs, rnd, now) -> None:
    """Agents may list the jobs in any order: the result depends only on the inputs' values."""
    shuffled = list(jobs)
    rnd.shuffle(shuffled)
    assert static_job_order(jobs) == static_job_order(shuffled)
    assert rotate_job_order(jobs, 20.0, now) == rotate_job_order(shuffled, 20.0, now)
    assert gpu_intensity_order(jobs) == gpu_intensity_order(shuffled)
    assert sorted(rotate_job_order(jobs, 20.0, now)) == sorted(j.job_id for j in jobs)

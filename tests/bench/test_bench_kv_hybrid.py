"""bench/kv/kv_hybrid.py's capacity search, against rounds whose true capacity is known: it must
find it below, at and above the theoretical capacity, report the first N that failed beside it,
and stop at its cap saying so. No stack: `run_round` is a function of N."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.bench.test_bench_compare import bench_module


@pytest.fixture(scope="module")
def kv_hybrid():
    return bench_module("kv.kv_hybrid")


def rounds_up_to(capacity: int, *, preempt: bool = True) -> tuple[Callable[[int], tuple[int, int]], list[int]]:
    """A run_round whose rounds run clean up to `capacity` requests; above it they preempt
    (or, with preempt=False, run only `capacity` at once without preempting); and the Ns it ran."""
    ran: list[int] = []

    def run_round(n: int) -> tuple[int, int]:
        ran.append(n)
        if n <= capacity:
            return 0, n
        return (n - capacity, n) if preempt else (0, capacity)

    return run_round, ran


@pytest.mark.parametrize("theory, capacity", [
    (10, 10),  # the theory holds
    (10, 9), (10, 7), (10, 3), (10, 1),  # below it: the theory's N fails
    (10, 11), (10, 13), (10, 25), (10, 39),  # above it: the old downward search never got there
    (1, 1), (1, 3), (0, 2),
])
def test_finds_the_capacity_and_the_first_failure(kv_hybrid, theory, capacity):
    run_round, ran = rounds_up_to(capacity)
    found = kv_hybrid.search_capacity(theory, run_round, cap=4 * max(theory, 1))
    assert (found.measured, found.first_failed, found.capped) == (capacity, capacity + 1, False)
    assert {capacity, capacity + 1} <= set(ran)  # both ends of the bracket ran
    assert list(found.tried) == ran and len(set(ran)) == len(ran)  # each N once, in order
    assert ran[0] == max(theory, 1)
    assert len(ran) <= 2 * (4 * max(theory, 1)).bit_length() + 2  # bounded: no walk one by one


def test_the_theory_holding_takes_two_rounds(kv_hybrid):
    run_round, ran = rounds_up_to(35)
    found = kv_hybrid.search_capacity(35, run_round, cap=140)
    assert ran == [35, 36] and (found.measured, found.first_failed) == (35, 36)


def test_not_all_running_at_once_is_a_failure(kv_hybrid):
    # a round that preempts nothing but never has all N running (e.g. max_num_seqs) is not clean
    run_round, _ = rounds_up_to(12, preempt=False)
    found = kv_hybrid.search_capacity(10, run_round, cap=40)
    assert (found.measured, found.first_failed) == (12, 13)


def test_not_even_one_request(kv_hybrid):
    run_round, ran = rounds_up_to(0)
    found = kv_hybrid.search_capacity(5, run_round, cap=20)
    assert (found.measured, found.first_failed) == (0, 1)
    assert ran[0] == 5 and ran[-1] == 1


@pytest.mark.parametrize("capacity", [40, 41, 1000])
def test_stops_at_the_cap(kv_hybrid, capacity):
    run_round, ran = rounds_up_to(capacity)
    found = kv_hybrid.search_capacity(10, run_round, cap=40)
    assert found.capped and found.first_failed is None and found.measured == 40
    assert max(ran) == 40

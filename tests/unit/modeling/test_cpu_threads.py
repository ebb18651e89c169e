"""A CPU worker's compute threads (modeling/cpu_threads.py): from the affinity mask and the
cgroup quota (v1 and v2 trees written here), `--threads` when given, and while serving from
what other processes take of the CPUs; the runner applies it on its compute thread."""

import time
from pathlib import Path

import torch
from tests.support.runner_helpers import make_runner

from modeling.cpu_threads import (DOWN_S, DOWN_WHOLE_S, READING_S, UP_S, CpuShare, cgroup_cpu_quota, choose_threads,
                                   read_busy_seconds)


def test_the_quota_caps_the_affinity_and_threads_given_win():
    assert choose_threads(None, cpus={0, 1, 2, 3}, quota=None).threads == 4
    one = choose_threads(None, cpus={0, 1}, quota=1.0)  # docker run --cpus 1 on two cores
    assert (one.threads, one.allowed, one.fixed) == (1, 1, False) and "quota of 1" in one.why
    assert choose_threads(None, cpus={0, 1, 2, 3}, quota=2.5).threads == 2  # rounded down
    assert choose_threads(None, cpus={0, 1}, quota=0.5).threads == 1  # at least one
    given = choose_threads(3, cpus={0, 1}, quota=1.0)
    assert (given.threads, given.fixed) == (3, True) and given.why == "--threads 3"


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota_of_the_process_or_an_ancestor(tmp_path):
    _write(tmp_path / "kubepods" / "cpu.max", "max 100000\n")
    _write(tmp_path / "kubepods" / "pod1" / "cpu.max", "150000 100000\n")
    assert cgroup_cpu_quota(tmp_path, "0::/kubepods/pod1\n") == 1.5
    assert cgroup_cpu_quota(tmp_path, "0::/kubepods\n") is None  # "max": unlimited
    _write(tmp_path / "cpu.max", "100000 100000\n")  # a container's own cgroup at the mount
    assert cgroup_cpu_quota(tmp_path, "0::/\n") == 1.0


def test_cgroup_v1_quota(tmp_path):
    d = tmp_path / "cpu,cpuacct" / "docker" / "abc"
    _write(d / "cpu.cfs_quota_us", "50000\n")
    _write(d / "cpu.cfs_period_us", "100000\n")
    text = "12:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n"
    assert cgroup_cpu_quota(tmp_path, text) == 0.5
    _write(d / "cpu.cfs_quota_us", "-1\n")
    assert cgroup_cpu_quota(tmp_path, text) is None
    assert cgroup_cpu_quota(tmp_path / "nowhere", text) is None


def test_proc_stat_busy_seconds_of_the_chosen_cpus(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  1 1 1 1 1 1 1 1 0 0\n"
                    "cpu0 100 0 50 1000 20 5 5 10 0 0\n"  # busy: 100 + 50 + 5 + 5 + 10
                    "cpu1 300 0 0 0 0 0 0 0 0 0\nintr 5\n")
    import os
    hz = os.sysconf("SC_CLK_TCK")
    assert read_busy_seconds({0}, stat) == 170 / hz
    assert read_busy_seconds({0, 1}, stat) == 470 / hz


class FakeCounters:
    def __init__(self):
        self.t = self.busy = self.own = 0.0

    def run(self, seconds: float, own_cores: float, other_cores: float) -> None:
        self.t += seconds
        self.own += own_cores * seconds
        self.busy += (own_cores + other_cores) * seconds


def _share(c: FakeCounters) -> CpuShare:
    return CpuShare(choose_threads(None, cpus={0, 1}, quota=None), cpus={0, 1},
                    busy_seconds=lambda: c.busy, own_seconds=lambda: c.own, clock=lambda: c.t)


def _readings(share: CpuShare, c: FakeCounters, seconds: float, own: float, other: float) -> list[tuple[float, int]]:
    """Readings every READING_S over `seconds` with these loads, each followed by a step:
    each count the step changed to, and how long after the first of these readings."""
    said, start = [], c.t
    for _ in range(round(seconds / READING_S)):
        c.run(READING_S, own, other)
        share.read()
        if (threads := share.threads()) is not None:
            said.append((round(c.t - start, 6), threads))
    return said


def test_a_neighbour_holding_a_core_takes_a_thread_within_a_second_and_gives_it_back():
    c = FakeCounters()
    share = _share(c)
    assert share.current == 2
    assert _readings(share, c, 3.0, 1.9, 0.05) == [] and share.taken < 0.1  # alone: keeps two
    assert _readings(share, c, 2.0, 1.0, 1.0) == [(DOWN_WHOLE_S, 1)]  # a hog: one thread, after a second
    assert share.current == 1 and round(share.taken, 6) == 1.0
    assert _readings(share, c, 3.0, 1.0, 0.3) == [(UP_S, 2)]  # a light neighbour: two again


def test_part_of_a_core_for_a_few_seconds_is_not_worth_a_thread():
    c = FakeCounters()
    share = _share(c)
    assert _readings(share, c, DOWN_S - READING_S, 1.2, 0.75) == []  # a client starting up: ignored
    assert _readings(share, c, 1.0, 1.9, 0.05) == []
    assert _readings(share, c, DOWN_S + 1, 1.2, 0.75) == [(DOWN_S, 1)]  # for longer: one thread
    share = _share(c := FakeCounters())  # part of a core among whole ones: DOWN_S again
    assert _readings(share, c, 0.5, 1.2, 0.75) + _readings(share, c, 3.0, 1.0, 1.0) == []


def test_readings_go_on_while_the_worker_is_idle():
    """A neighbour busy before the first step of a burst: that step already has one thread
    (a first prefill step with two threads and a busy neighbour took 20 s, measured)."""
    c = FakeCounters()
    share = _share(c)
    for _ in range(4):  # idle: no steps, the reading thread alone
        c.run(READING_S, 0.0, 1.0)
        share.read()
    assert share.threads() == 1


def test_the_reading_thread_reads_and_ends_with_its_share():
    share = CpuShare(choose_threads(None, cpus={0, 1}, quota=None), cpus={0, 1}, interval_s=0.01)
    first = share._last.wall
    thread = share.start()
    deadline = time.monotonic() + 10
    while share._last.wall == first:  # until the thread has read
        assert time.monotonic() < deadline
        time.sleep(0.01)
    del share
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_the_runner_computes_with_the_threads_it_chose(family_model_dir):
    before = torch.get_num_threads()
    try:
        runner = make_runner(family_model_dir("llama"), threads=1)
        assert torch.get_num_threads() == 1 and runner.cpu_share is None  # given: never changed
        runner = make_runner(family_model_dir("llama"))
        chosen = choose_threads(None)
        assert torch.get_num_threads() == chosen.threads
        assert (runner.cpu_share is not None) == (chosen.allowed > 1)
    finally:
        torch.set_num_threads(before)

"""A CPU worker's compute threads (worker_svc/cpu_threads.py): from the affinity mask and the
cgroup quota (v1 and v2 trees written here), `--threads` when given, and while serving from
what other processes take of the CPUs; the runner applies it on its compute thread."""

from pathlib import Path

import torch
from runner_helpers import make_runner

from worker_svc.cpu_threads import DOWN_READINGS, CpuShare, cgroup_cpu_quota, choose_threads, read_busy_seconds


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


def test_threads_follow_what_other_processes_take_for_a_few_readings_in_a_row():
    c = FakeCounters()
    share = CpuShare(choose_threads(None, cpus={0, 1}, quota=None), cpus={0, 1}, interval_s=0.9,
                     busy_seconds=lambda: c.busy, own_seconds=lambda: c.own, clock=lambda: c.t)
    assert share.current == 2
    c.run(0.5, 1.9, 0.05)
    assert share.threads() is None  # not an interval yet
    c.run(0.6, 1.9, 0.05)
    assert share.threads() is None and share.taken < 0.1  # alone: keeps two
    for _ in range(DOWN_READINGS - 1):  # a burst of a few seconds: ignored
        c.run(1.0, 1.0, 1.0)
        assert share.threads() is None and round(share.taken, 6) == 1.0
    c.run(1.0, 1.9, 0.1)
    assert share.threads() is None
    for _ in range(DOWN_READINGS - 1):  # a process keeps a core: one thread, after DOWN_READINGS
        c.run(1.0, 1.0, 1.0)
        assert share.threads() is None
    c.run(1.0, 1.0, 1.0)
    assert share.threads() == 1 and share.current == 1
    c.run(1.0, 1.0, 0.3)  # a light neighbour: two again, after UP_READINGS
    assert share.threads() is None
    c.run(1.0, 1.0, 0.3)
    assert share.threads() == 2


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

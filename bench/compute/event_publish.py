"""What publishing a step's token events costs the worker's compute thread, per step.

    python bench/compute/event_publish.py                               # this tree's EventPublisher
    python bench/compute/event_publish.py --baseline REV                # ... against REV's, interleaved
    python bench/compute/event_publish.py --baseline REV --batch 64 --rounds 11

Each step publishes one batch of `--batch` TokenEvents (one per running request, one
token each) to one gateway's reply channel, as the worker does; a separate process
subscribes and reads them, as the gateway does. A round times `--steps` publishes of each
implementation, one after the other (the order alternates between rounds); the figure of
a round is its median publish (and its mean, which the slow tail pulls up), and the report
gives the median and spread of those over the rounds. Publishing waits for Redis's replies or
not depending on the implementation, so the figure is what the compute thread spends before it
can return a step's result.
A redis-server is started on a free loopback port unless --redis-url names one.
`--spinners N` keeps N processes spinning on the CPU meanwhile, as a machine whose cores
are busy with the other services would be: Redis, the subscriber and the publisher then
wait for a core.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[2]
if not __package__:  # run as a file: the repository root on sys.path, this folder off it (bench/README.md)
    sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent)]

from compose.launcher import free_port, redis_server_argv  # noqa: E402
from proto.messages import TokenEvent  # noqa: E402
from worker_svc.event_publisher import EventPublisher  # noqa: E402

SUBSCRIBER = """
import sys, redis
sub = redis.Redis.from_url(sys.argv[1]).pubsub(ignore_subscribe_messages=True)
sub.subscribe(sys.argv[2])
print("ready", flush=True)
for message in sub.listen():
    pass
"""


def publisher_at(rev: str) -> type:
    """EventPublisher as worker_svc/event_publisher.py is at git revision `rev`."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:worker_svc/event_publisher.py"],
                            check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "baseline_event_publisher.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("baseline_event_publisher", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.EventPublisher


def start_redis() -> tuple[subprocess.Popen, str]:
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("no redis-server on PATH: install one, or pass --redis-url")
    port = free_port()
    proc = subprocess.Popen(redis_server_argv(binary, port), stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    while True:
        try:
            redis.Redis.from_url(url).ping()
            return proc, url
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def step_events(channel: str, batch: int, step: int) -> dict[str, list[TokenEvent]]:
    return {channel: [TokenEvent(f"request-{i}", step, [1000 + i]) for i in range(batch)]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", help="git revision whose EventPublisher to compare against")
    p.add_argument("--redis-url", help="default: start a redis-server on a free port")
    p.add_argument("--batch", type=int, default=32, help="events per step (running requests)")
    p.add_argument("--steps", type=int, default=2000, help="publishes per implementation per round")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--spinners", type=int, default=0, help="processes spinning on the CPU meanwhile")
    args = p.parse_args(argv)

    server, url = (None, args.redis_url) if args.redis_url else start_redis()
    channel = "bench:out:gateway"
    subscriber = subprocess.Popen([sys.executable, "-c", SUBSCRIBER, url, channel],
                                  stdout=subprocess.PIPE, text=True)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.spinners)]
    try:
        subscriber.stdout.readline()  # subscribed
        contenders = {"public pipeline (this tree)": EventPublisher}
        if args.baseline:
            contenders[f"baseline ({args.baseline})"] = publisher_at(args.baseline)
        publishers = {name: cls(redis.Redis.from_url(url)) for name, cls in contenders.items()}
        rounds: dict[str, list[tuple[float, float]]] = {name: [] for name in publishers}
        step = 0
        for r in range(args.rounds):
            order = list(publishers) if r % 2 == 0 else list(reversed(publishers))
            for name in order:
                publisher, times = publishers[name], []
                for _ in range(args.steps):
                    events = step_events(channel, args.batch, step)
                    step += 1
                    start = time.perf_counter()
                    publisher.publish(events)
                    times.append(time.perf_counter() - start)
                publisher.flush()
                rounds[name].append((statistics.median(times), statistics.fmean(times)))
        print(f"publish of {args.batch} events per step, {args.spinners} spinner(s); median of "
              f"{args.rounds} interleaved rounds of {args.steps} steps each (range over rounds):")
        summary = {}
        for name, figures in rounds.items():
            medians, means = ([f[i] * 1e6 for f in figures] for i in (0, 1))
            summary[name] = statistics.median(medians), statistics.median(means)
            print(f"  {name:30s} median {summary[name][0]:7.1f} us ({min(medians):.1f}..{max(medians):.1f}), "
                  f"mean {summary[name][1]:7.1f} us ({min(means):.1f}..{max(means):.1f})")
        if args.baseline:
            (ours_median, ours_mean), (their_median, their_mean) = summary.values()
            print(f"  this tree minus the baseline, per step: median {ours_median - their_median:+.1f} us, "
                  f"mean {ours_mean - their_mean:+.1f} us")
        for publisher in publishers.values():
            publisher.close()
    finally:
        for proc in [*spinners, subscriber]:
            proc.terminate()
            proc.wait()
        if server is not None:
            server.terminate()
            server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())

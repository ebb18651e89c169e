"""The local launcher: the same services `docker-compose.yml` runs, as child processes.

Start order: Redis (unless a URL is given) → workers (ready once registered in Redis) →
scheduler → gateways (ready once `/health/ready` answers and it lists the model, and, with
`gateways` > 1, once every one has published its metrics to Redis: they share the port with
SO_REUSEPORT, `gateway`, `gateway-1`, ...). Stop order is the reverse; every child gets
SIGTERM, then SIGKILL if it lingers. While it runs (`wait`), a child that exits on its own
is restarted with the same command line, after a backoff (compose/restarts.py), and both
are logged. The scheduler and each worker serve /metrics on a free port of their own
(`metrics_urls`), unless their extra args name one.
"""

from __future__ import annotations

import functools
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import redis

from compose.flags import gateway_parser
from compose.restarts import RestartBackoff
from gateway.config import config_from_args
from proto.keys import RedisKeys
from proto.registry import WorkerRegistry


def die_with_parent() -> None:
    """In the child, before exec: ask Linux for SIGTERM when the launcher dies."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux/glibc: children then outlive a killed launcher
        pass


def free_port() -> int:
    """A port free now, for a child to bind later. Drawn outside the kernel's ephemeral
    range, so that the connections and port-0 binds made meanwhile (Redis clients, gRPC
    servers) cannot take it before the child binds it; the kernel's own choice when that
    range leaves no room."""
    low, high = _ephemeral_range()
    candidates = [*range(10_000, min(low, 65_536)), *range(max(high + 1, 10_000), 65_536)]
    for port in random.sample(candidates, min(len(candidates), 64)):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_server_argv(binary: str, port: int, workdir: Path | None = None) -> list[str]:
    """A throwaway redis-server on loopback: no snapshots, no append-only file; its working
    directory `workdir` (where it would write) when given."""
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    return argv + (["--dir", str(workdir)] if workdir is not None else [])


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(unreadable: {exc})"


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):  # not Linux: the IANA dynamic range
        return 49_152, 65_535


@dataclass(frozen=True)
class StackConfig:
    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    workers: int = 1
    gateways: int = 1  # > 1: all on `port` (--reuse-port), the kernel spreads connections over them
    schedulers: int = 1  # one leads; the others stand by (scheduler_svc/leader.py)
    encoders: int = 0  # vision encoder services (encoder_svc/): media encoded ahead of questions
    redis_url: str | None = None  # None: start a redis-server on a free port
    key_prefix: str = "pagedserve"
    run_dir: Path = Path(".run")
    worker_args: tuple[str, ...] = ()
    encoder_args: tuple[str, ...] = ()
    scheduler_args: tuple[str, ...] = ()
    gateway_args: tuple[str, ...] = ()
    startup_timeout_s: float = 300.0
    env: dict[str, str] = field(default_factory=dict)


class Stack:
    def __init__(self, config: StackConfig):
        self.config = config
        self.procs: dict[str, subprocess.Popen] = {}
        self._argv: dict[str, list[str]] = {}  # each child's command line, to restart it
        self.restarts = RestartBackoff()
        self.redis_url = config.redis_url or ""
        self.keys = RedisKeys(config.key_prefix)
        self._worker_count = 0
        self._encoder_count = 0
        self._stopped: set[str] = set()  # stopped on purpose: their exit is no failure
        self.metrics_ports: dict[str, int] = {}  # service name → its /metrics port

    # ---- context manager ---------------------------------------------------------------

    def __enter__(self) -> "Stack":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def base_url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}/v1"

    @functools.cached_property
    def gateway_config(self):
        """The gateway's config as its own argument parsing makes it from our flags and the
        environment (served model name, API keys)."""
        return config_from_args(gateway_parser().parse_args(
            ["--model", self.config.model, *self.config.gateway_args]))

    @property
    def served_model_name(self) -> str:
        return self.gateway_config.model_name

    @property
    def metrics_urls(self) -> dict[str, str]:
        """Every service's own /metrics: the gateway's (which aggregates them all), the
        scheduler's and each worker's, by process name."""
        urls = {"gateway": f"http://{self.config.host}:{self.config.port}/metrics"}
        urls.update((name, f"http://127.0.0.1:{port}/metrics") for name, port in self.metrics_ports.items())
        return urls

    # ---- start ---------------------------------------------------------------------------

    def start(self) -> None:
        self.config.run_dir.mkdir(parents=True, exist_ok=True)
        if not self.redis_url:
            self._start_redis()
        for _ in range(self.config.workers):
            self.add_worker(wait=False)
        self.wait_for_workers(self.config.workers)
        encoders = [self.add_encoder(wait=False) for _ in range(self.config.encoders)]
        self._wait_for(lambda: set(encoders) <= set(self.live_encoder_ids()), f"{len(encoders)} encoder(s) to register")
        for i in range(self.config.schedulers):
            self.add_scheduler(i)
        shared = ()
        if self.config.gateways > 1:
            # SO_REUSEPORT would let them join another stack's gateways on a taken port
            self._check_port_free()
            shared = ("--reuse-port",)
        for i in range(self.config.gateways):
            self._spawn("gateway" if i == 0 else f"gateway-{i}", self._service(
                "gateway", "--model", self.config.model, "--host", self.config.host,
                "--port", str(self.config.port), *shared, *self.config.gateway_args))
        self._wait_for(self._gateway_ready, "the gateway to be ready and see the workers")
        if self.config.gateways > 1:  # a connection may reach any of them: all must be up
            self._wait_for(lambda: len(self.live_gateway_ids()) >= self.config.gateways,
                           f"{self.config.gateways} gateways to start")

    def _check_port_free(self) -> None:
        """RuntimeError when the gateways' port is taken (bound here without SO_REUSEPORT)."""
        family = socket.AF_INET6 if ":" in self.config.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no owner
            try:
                probe.bind((self.config.host, self.config.port))
            except OSError as exc:
                raise RuntimeError(f"the gateways' port {self.config.host}:{self.config.port} is taken "
                                   f"({exc}): stop what listens there, or choose another --port") from None

    def _start_redis(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("no redis-server on PATH: `make up` installs one, or pass --redis-url")
        port = free_port()
        self._spawn("redis", redis_server_argv(binary, port, self.config.run_dir.resolve()))
        self.redis_url = f"redis://127.0.0.1:{port}/0"
        self._wait_for(lambda: self._redis().ping(), "redis-server to answer")

    def add_worker(self, wait: bool = True, extra: tuple[str, ...] = ()) -> str:
        name = f"worker-{self._worker_count}"
        self._worker_count += 1
        args = (*self.config.worker_args, *extra)
        self._spawn(name, self._service("worker", "--model", self.config.model, "--port", "0",
                                        "--worker-id", name, *self._metrics_port(name, args), *args))
        if wait:
            self._wait_for(lambda: name in self.live_worker_ids(), f"{name} to register")
        return name

    def add_encoder(self, wait: bool = True, extra: tuple[str, ...] = ()) -> str:
        """An encoder service (`encoder-<i>`) on the stack's model; `wait`: until registered."""
        name = f"encoder-{self._encoder_count}"
        self._encoder_count += 1
        args = (*self.config.encoder_args, *extra)
        self._spawn(name, self._service("encoder", "--model", self.config.model, "--encoder-id", name,
                                        *self._metrics_port(name, args), *args))
        if wait:
            self._wait_for(lambda: name in self.live_encoder_ids(), f"{name} to register")
        return name

    def add_scheduler(self, index: int) -> str:
        """Scheduler `index`: `scheduler` for the first, `scheduler-<i>` (consumer name
        `scheduler-<hostname>-<i>`) for each standby beside it."""
        name = "scheduler" if index == 0 else f"scheduler-{index}"
        args = self.config.scheduler_args
        if index:
            args = ("--consumer-name", f"scheduler-{socket.gethostname()}-{index}", *args)
        self._spawn(name, self._service("scheduler", *self._metrics_port(name, args), *args))
        return name

    def _metrics_port(self, name: str, args: tuple[str, ...]) -> tuple[str, ...]:
        """`--metrics-port N` on a free port, unless `args` choose one."""
        if any(a.startswith("--metrics-port") for a in args):
            return ()
        self.metrics_ports[name] = free_port()
        return ("--metrics-port", str(self.metrics_ports[name]))

    def _service(self, name: str, *args: str) -> list[str]:
        return [sys.executable, "-m", "compose.cli", name, "--redis-url", self.redis_url,
                "--key-prefix", self.config.key_prefix, *args]

    def _spawn(self, name: str, argv: list[str]) -> None:
        self._argv[name] = argv
        log = open(self.config.run_dir / f"{name}.log", "ab")
        env = {**os.environ, **self.config.env}
        # A new session: Ctrl-C reaches us only, and we stop them in order. The parent-death
        # signal: if we are killed outright, they still go (no orphaned servers).
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True, preexec_fn=die_with_parent)
        log.close()

    # ---- readiness -------------------------------------------------------------------------

    def _redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url, socket_timeout=2)

    def live_worker_ids(self) -> list[str]:
        with self._redis() as client:
            return list(WorkerRegistry(self.keys).read_blocking(client).live)

    def live_encoder_ids(self) -> list[str]:
        with self._redis() as client:
            ids = sorted(i.decode() for i in client.smembers(self.keys.encoders))
            return [i for i, v in zip(ids, client.mget([self.keys.encoder(i) for i in ids]) if ids else []) if v]

    def live_gateway_ids(self) -> list[str]:
        """The gateways (uuids) whose metrics record in Redis is fresh: the ones started and running."""
        with self._redis() as client:
            ids = sorted(i.decode() for i in client.smembers(self.keys.gateways))
            values = client.mget([self.keys.gateway_metrics(i) for i in ids]) if ids else []
            return [i for i, v in zip(ids, values) if v]

    def wait_for_workers(self, n: int) -> None:
        self._wait_for(lambda: len(self.live_worker_ids()) >= n, f"{n} worker(s) to register")

    def _gateway_ready(self) -> bool:
        keys = self.gateway_config.api_keys
        key = keys[0] if keys else None
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        try:
            url = f"http://{self.config.host}:{self.config.port}/health/ready"
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=2):
                pass
            request = urllib.request.Request(f"{self.base_url}/models", headers=headers)
            with urllib.request.urlopen(request, timeout=2) as resp:
                return self.served_model_name.encode() in resp.read()
        except OSError:
            return False

    def _wait_for(self, ready, what: str) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        while True:
            for name, proc in self.procs.items():
                if proc.poll() is not None and name not in self._stopped:
                    log = self.config.run_dir / (name + ".log")
                    raise RuntimeError(f"{name} exited with {proc.returncode} while waiting for {what}; "
                                       f"the end of {log}:\n{_tail(log)}")
            try:
                if ready():
                    return
            except (OSError, redis.RedisError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}; logs in {self.config.run_dir}")
            time.sleep(0.1)

    # ---- stop ------------------------------------------------------------------------------

    def stop_process(self, name: str, sig: int | None = signal.SIGTERM, timeout: float = 15.0) -> int | None:
        """Send `sig` (None: it was sent already) and wait up to `timeout`, then SIGKILL."""
        proc = self.procs.get(name)
        self._stopped.add(name)
        if proc is None or proc.poll() is not None:
            return proc.returncode if proc else None
        if sig is not None:
            proc.send_signal(sig)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()

    def stop(self) -> None:
        gateways = sorted(n for n in self.procs if n.startswith("gateway"))
        for name in gateways:  # they share a port: all stop taking connections at once, then drain
            self._stopped.add(name)
            if self.procs[name].poll() is None:
                self.procs[name].send_signal(signal.SIGTERM)
        for name in gateways:
            self.stop_process(name, sig=None)
        order = [*sorted(n for n in self.procs if n.startswith("scheduler")),
                 *sorted(n for n in self.procs if n.startswith(("worker", "encoder"))), "redis"]
        for name in order:
            self.stop_process(name)

    def wait(self) -> bool:
        """Block until Ctrl-C / SIGTERM, restarting services that die meanwhile (`supervise`)."""
        stopping = []
        previous = signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
        try:
            while not stopping:
                self.supervise()
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
        finally:
            signal.signal(signal.SIGTERM, previous)
        return True

    def supervise(self) -> list[str]:
        """Restart every child that exited on its own and whose backoff has passed (the
        same command line; a worker keeps its id, Redis its port); the names restarted.
        Call it from a thread that outlives the children it starts (the main thread, or
        one running until the stack stops): Linux sends a child its parent-death signal
        when the *thread* that started it ends."""
        restarted = []
        for name, proc in list(self.procs.items()):
            if proc.poll() is None or name in self._stopped:
                continue
            now = time.monotonic()
            wait = self.restarts.due(name, now)
            if wait > 0:
                continue
            print(f"pagedserve: {name} exited with {proc.returncode}; restarting it "
                  f"(log: {self.config.run_dir / (name + '.log')})", file=sys.stderr, flush=True)
            self._spawn(name, self._argv[name])
            self.restarts.restarted(name, now)
            restarted.append(name)
        return restarted

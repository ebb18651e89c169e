"""The scheduler service: leads its share of the scheduler shards, each a Shard.

The requests of a stack go to `--shards` shards (default 1), each with its own requests
stream, its own lease and its own share of the workers (scheduler_svc/shard.py). Every
scheduler process runs this service, which owns what is the process's, not a shard's:

  * the heartbeat (scheduler_svc/heartbeat.py): its workers, the requests waiting, and
    each shard it leads with its workers and requests (the gateways choose a shard for
    each request from these: gateway/shard_choice.py);
  * /metrics and /health (scheduler_svc/metrics.py);
  * which shards it leads (`_balance`, every `lease_ttl_s / 6`): with P live schedulers,
    each leads about `ceil(shards / P)`. Below that share it takes the lease of a shard
    nobody leads (trying the shards in an order of its own: a rendezvous hash of its
    name), so a shard whose leader died is taken over within about a lease TTL; above it
    (another scheduler came) it hands one over: the shard stops and gives its leases up,
    and whoever takes it claims its pending requests and serves them again from their
    prompts (as after a leader's death).

With one shard this is the leader and its standbys of before: one scheduler leads, the
others wait for its lease. A shard that ends with a lost lease is dropped (this process
may lead it again later); one that crashes ends the process, as a bug should.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

import redis.asyncio as aioredis

from proto.keys import RedisKeys
from proto.rendezvous import rendezvous_order
from proto.scheduler_registry import SchedulerRegistry
from scheduler_svc.heartbeat import Heartbeat, Load
from scheduler_svc.leader import LeaseLost, shard_lease
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.service_config import SchedulerServiceConfig
from scheduler_svc.shard import Shard

log = logging.getLogger("pagedserve.scheduler")


class SchedulerService:
    def __init__(self, config: SchedulerServiceConfig):
        self.config = config
        self.keys = RedisKeys(config.key_prefix)
        self.redis = aioredis.Redis.from_url(config.redis_url)
        self.metrics = SchedulerMetrics()
        self.heartbeat = Heartbeat(self.redis, self.keys, config.consumer_name,
                                   interval_s=config.heartbeat_interval_s, ttl_s=config.heartbeat_ttl_s,
                                   max_waiting_requests=config.max_waiting_requests, load=self.load)
        self.shards: dict[int, Shard] = {}  # the shards this scheduler leads now
        self._shard_tasks: dict[int, asyncio.Task] = {}
        self._led_elsewhere: set[int] = set()  # shards other live schedulers lead
        self._failed: asyncio.Future | None = None  # a shard that crashed: the process ends
        self._stopping = False

    @property
    def shard(self) -> Shard | None:
        """Shard 0 if this scheduler leads it (the only one of a one-shard stack)."""
        return self.shards.get(0)

    # ---- lifecycle -------------------------------------------------------------------

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Serve until `stop` is set: heartbeat at once, then lead this scheduler's share
        of the shards (a standby while others lead them all). Raises what crashed a shard."""
        stop = stop or asyncio.Event()
        self._failed = asyncio.get_running_loop().create_future()
        metrics_server = self.metrics.serve(self.config.metrics_host, self.config.metrics_port, self.health)
        tasks = [asyncio.create_task(self.heartbeat.run(), name="heartbeat"),
                 asyncio.create_task(self._balance(), name="balance-shards")]
        waiter = asyncio.create_task(stop.wait())
        done: set[asyncio.Future] = set()
        try:
            done, _ = await asyncio.wait([waiter, self._failed, *tasks], return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._stopping = True
            for task in [waiter, *tasks]:
                task.cancel()
            try:
                await asyncio.wait([waiter, *tasks], timeout=3)
                for k in list(self._shard_tasks):
                    await self._drop(k)
            finally:
                await self.heartbeat.clear()
                if metrics_server is not None:
                    metrics_server.close()
                await self.redis.aclose()
        for task in done:  # surface a crashed loop instead of hiding it
            if task is not waiter and not task.cancelled() and task.exception():
                raise task.exception()

    async def _balance(self) -> None:
        """Lead this scheduler's share of the shards: take free ones below it, hand one
        over above it (see the module docstring)."""
        while not self._stopping:
            try:
                beats = await SchedulerRegistry(self.keys).read(self.redis)
            except (aioredis.RedisError, OSError) as exc:
                log.warning("could not read the schedulers' heartbeats: %s", exc)
                beats = None
            if beats is not None:
                others = [b for b in beats if b.scheduler_id != self.config.consumer_name]
                self._led_elsewhere = {s.shard for b in others for s in b.shards}
                share = math.ceil(self.config.shards / (len(others) + 1))
                for k in self._preference():
                    if len(self._shard_tasks) >= share:
                        break
                    if k not in self._shard_tasks and k not in self._led_elsewhere:
                        await self._try_lead(k)
                if len(self._shard_tasks) > share:
                    k = min(self.shards, key=lambda s: self.shards[s].load()[0].num_requests)
                    log.info("handing shard %d over: %d scheduler(s) share %d shard(s)",
                             k, len(others) + 1, self.config.shards)
                    await self._drop(k)
            await asyncio.sleep(self.config.lease_ttl_s / 6)

    def _preference(self) -> list[int]:
        """The shards in the order this scheduler tries them (rendezvous hashing)."""
        return rendezvous_order(f"{self.config.consumer_name}:".encode(), range(self.config.shards))

    def led_shards(self) -> int:
        """Shards with a leader now (this scheduler's and the others'): each shard's
        workers are its fair share of them (scheduler_svc/worker_leases.py)."""
        return max(1, len(self._led_elsewhere | set(self.shards)))

    async def _try_lead(self, k: int) -> None:
        lease = shard_lease(self.redis, self.keys, self.config.consumer_name, self.config.lease_ttl_s, k)
        try:
            if not await lease.acquire():
                return
        except (aioredis.RedisError, OSError) as exc:
            log.warning("could not try the lease of shard %d: %s", k, exc)
            return
        self.shards[k] = Shard(self.config, k, self.redis, self.metrics, lease, self.led_shards)
        self._shard_tasks[k] = asyncio.create_task(self._lead(self.shards[k]), name=f"shard-{k}")

    async def _lead(self, shard: Shard) -> None:
        """Lead the shard until its lease is lost or it is dropped; then stop it."""
        try:
            await shard.lead()
        except LeaseLost as exc:
            log.warning("shard %d: %s; no longer leading it", shard.shard, exc)
        except asyncio.CancelledError:
            pass  # dropped
        except Exception as exc:  # a bug: end the process (it is restarted)
            if self._failed is not None and not self._failed.done():
                self._failed.set_exception(exc)
        finally:
            # Stopped before it leaves the books: the shard is not led again from this
            # process while its read may still hand it entries (Shard._handle_entry).
            await shard.stop()
            if self.shards.get(shard.shard) is shard:
                del self.shards[shard.shard], self._shard_tasks[shard.shard]

    async def _drop(self, k: int) -> None:
        """Stop leading shard `k`: its task ends and gives its leases up."""
        task = self._shard_tasks.get(k)
        if task is not None:
            task.cancel()
            await asyncio.wait([task], timeout=10)

    # ---- health ------------------------------------------------------------------------

    def health(self) -> tuple[bool, dict]:
        """GET /health on the metrics port (called from its thread): healthy while the
        heartbeat reaches Redis (its last beat younger than its TTL); the role says whether
        this scheduler leads shards (which, and how many workers) or stands by."""
        written_at, load = self.heartbeat.written_at, self.heartbeat.written
        age = None if written_at is None else time.monotonic() - written_at
        healthy = age is not None and age < self.config.heartbeat_ttl_s
        return healthy, {"status": "ok" if healthy else "heartbeat_not_written",
                         "role": "leader" if load and load.shards else "standby",
                         "shards": [s.shard for s in load.shards] if load else [],
                         "workers": load.worker_ids if load else [],
                         "heartbeat_age_s": None if age is None else round(age, 3)}

    def load(self) -> Load:
        """The heartbeat's report: every shard's live workers and requests."""
        loads = [shard.load() for _, shard in sorted(self.shards.items())]
        return Load([w for shard, _ in loads for w in shard.worker_ids], sum(w for _, w in loads),
                    [shard for shard, _ in loads])

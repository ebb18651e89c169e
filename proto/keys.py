"""Redis key names, in one place. Every service builds its keys from a RedisKeys."""

from dataclasses import dataclass

SCHEDULER_GROUP = "schedulers"
ENCODER_GROUP = "encoders"  # the consumer group of the encode-job stream
STREAM_FIELD = b"m"  # the one field of every stream entry: a msgpack-encoded StreamMessage


@dataclass(frozen=True)
class RedisKeys:
    prefix: str = "pagedserve"

    @property
    def requests(self) -> str:
        """Stream of NewRequest / AbortRequest entries, read by the scheduler group."""
        return f"{self.prefix}:requests"

    def reply_channel(self, gateway_id: str) -> str:
        """Pub/sub channel a gateway subscribes to; workers publish TokenEvent batches."""
        return f"{self.prefix}:out:{gateway_id}"

    @property
    def gateways(self) -> str:
        """Set of gateway ids that have published their metrics (possibly gone: check gateway_metrics(id))."""
        return f"{self.prefix}:gateways"

    def gateway_metrics(self, gateway_id: str) -> str:
        """A gateway's own metrics (a GatewayMetricsRecord: its exposition text), with a short
        TTL it refreshes about every second; any gateway's /metrics sums them all
        (gateway/gateway_metrics_peers.py)."""
        return f"{self.prefix}:gateway-metrics:{gateway_id}"

    @property
    def workers(self) -> str:
        """Set of worker ids that have registered (possibly dead: check worker(id))."""
        return f"{self.prefix}:workers"

    def worker(self, worker_id: str) -> str:
        """A worker's WorkerRegistration, with a TTL its heartbeat keeps refreshing."""
        return f"{self.prefix}:worker:{worker_id}"

    def worker_stats(self, worker_id: str) -> str:
        """The scheduler's WorkerStats for that worker (block pool, preemptions, integrity)."""
        return f"{self.prefix}:stats:{worker_id}"

    @property
    def schedulers(self) -> str:
        """Set of scheduler ids that have sent a heartbeat (possibly dead: check scheduler(id))."""
        return f"{self.prefix}:schedulers"

    def scheduler(self, scheduler_id: str) -> str:
        """A scheduler's SchedulerHeartbeat, with a TTL its heartbeat keeps refreshing."""
        return f"{self.prefix}:scheduler:{scheduler_id}"

    @property
    def scheduler_lease(self) -> str:
        """`<scheduler id>:<fencing token>` of the scheduler that drives the workers, with a TTL."""
        return f"{self.prefix}:scheduler-lease"

    def shard_requests(self, shard: int) -> str:
        """Shard `shard`'s requests stream (scheduler_svc/shard.py); shard 0's is `requests`."""
        return self.requests if shard == 0 else f"{self.prefix}:requests:{shard}"

    def shard_lease(self, shard: int) -> str:
        """`<scheduler id>:<fencing token>` of the scheduler leading shard `shard`, with a
        TTL (scheduler_svc/leader.py); shard 0's is `scheduler-lease`."""
        return self.scheduler_lease if shard == 0 else f"{self.prefix}:scheduler-lease:{shard}"

    def worker_lease(self, worker_id: str) -> str:
        """`<shard>:<fencing token>` of the shard that drives this worker, with a TTL
        (scheduler_svc/worker_leases.py)."""
        return f"{self.prefix}:worker-lease:{worker_id}"

    @property
    def scheduler_epoch(self) -> str:
        """The last fencing token drawn by a scheduler taking the lease (scheduler_svc/leader.py)."""
        return f"{self.prefix}:scheduler-epoch"

    def media(self, content_hash: str) -> str:
        """A MediaItem (an image's encoded bytes, or one video frame's RGB pixels) under the
        sha256 hex of its content, with a TTL every reuse refreshes (gateway/media/store.py)."""
        return f"{self.prefix}:media:{content_hash}"

    def media_uuid(self, scope: str, kind: str, uuid: str) -> str:
        """The content hashes (a gateway-only msgpack record) of the media a client sent with
        `uuid` (vLLM's per-part id), for later parts that name them without data; per client
        `scope` and media `kind`, with the media's TTL (gateway/media/uuids.py)."""
        return f"{self.prefix}:media-uuid:{scope}:{kind}:{uuid}"

    def file(self, scope: str, file_id: str) -> str:
        """An uploaded file's record (a gateway-only msgpack `FileRecord`: name, purpose, size,
        times, the content hash of its `media(...)` item), per client `scope`, with a TTL that
        ends at its `expires_at` (gateway/files/store.py)."""
        return f"{self.prefix}:file:{scope}:{file_id}"

    def files(self, scope: str) -> str:
        """Sorted set of one scope's file ids, scored by expiry (ms); expired ones are pruned
        when it is read or written (gateway/files/store.py)."""
        return f"{self.prefix}:files:{scope}"

    @property
    def file_storage(self) -> str:
        """Sorted set of every stored file, all scopes together, as `<scope>/<file id>/<bytes>`
        scored by expiry (ms): what --max-file-storage-bytes bounds (gateway/files/ledger.py)."""
        return f"{self.prefix}:file-storage"

    @property
    def file_storage_bytes(self) -> str:
        """The bytes of the files `file_storage` holds that have not expired (gateway/files/ledger.py)."""
        return f"{self.prefix}:file-storage-bytes"

    @property
    def encode_jobs(self) -> str:
        """Stream of EncodeJob entries (gateway → encoder service, group `encoders`): content
        hashes of media just stored, to encode before any question needs them."""
        return f"{self.prefix}:encode"

    @property
    def encoders(self) -> str:
        """Set of encoder-service ids that have registered (possibly dead: check encoder(id))."""
        return f"{self.prefix}:encoders"

    def encoder(self, encoder_id: str) -> str:
        """An encoder's EncoderRegistration, with a TTL its heartbeat keeps refreshing."""
        return f"{self.prefix}:encoder:{encoder_id}"

    def encoder_stats(self, encoder_id: str) -> str:
        """An encoder's EncoderStats, written beside its registration with the same TTL."""
        return f"{self.prefix}:encoder-stats:{encoder_id}"

    def embeddings(self, fingerprint: str, content_hash: str) -> str:
        """A medium's image embeddings (EmbeddingsRecord) as one vision tower in one dtype
        (`fingerprint`, vision/published_embeddings.py) computes them, with a TTL."""
        return f"{self.prefix}:embeds:{fingerprint}:{content_hash}"

    def encoding(self, content_hash: str) -> str:
        """`queued` (the gateway announced the medium), or held (short TTL) by the encoder
        or worker encoding it now, until it has published the embeddings: the scheduler
        routes a request needing it afterwards (vision/published_embeddings.py)."""
        return f"{self.prefix}:encoding:{content_hash}"

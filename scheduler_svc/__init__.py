"""`pagedserve scheduler`: the scheduler service -- the Redis and gRPC shell around the
scheduler's policy (policy/: the batching core, BatchScheduler, and prefix-aware routing;
pure, testable on its own). docs/architecture.md, "One request's life", steps 3, 4, 5 and 7.

    service.py         SchedulerService: the process -- heartbeat, /metrics, which shards it leads
    service_config.py  SchedulerServiceConfig: the service's settings (policy/config.py's and its own)
    shard.py           Shard: one shard's Redis + gRPC shell; wires the parts below and decides
                       what each stream message does
    request_stream.py  RequestStream: the requests stream as this scheduler's consumer sees it --
                       reading, claiming, acknowledging
    ledger.py          RequestLedger: where every request of a shard is -- on a worker, parked, in
                       transit -- its stream entry, its children
    worker_pool.py     WorkerPool, WorkerHandle: a shard's workers -- discovery, leasing its share,
                       joining (a BatchScheduler each), handing over, retiring, evacuation
    worker_leases.py   WorkerLeases: a shard's leases on its workers; fair_share
    step_loop.py       StepLoop: one worker's schedule() -> Steps (gRPC) -> update(), and its stats
    encoding_wait.py   EncodingWait: a request routed once the encoder service published its media
    leader.py          Lease: a lease with fencing tokens, a shard's or a worker's
    heartbeat.py       Heartbeat: the SchedulerHeartbeat in Redis, the scheduler's health
    metrics.py         WorkerRecorder (each worker's request phases), SchedulerMetrics (/metrics)
"""

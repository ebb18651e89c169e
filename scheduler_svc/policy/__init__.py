"""The scheduler's policy: one worker's batching core and the choice of a worker, pure --
no Redis, no gRPC, no asyncio, no scheduler service module (tests/architecture/test_import_graph.py),
so it runs and is tested on its own (the scheduler service, compose/engine.py, the benchmarks).

    batching.py        BatchScheduler: the composition the callers drive -- requests in, a
                       StepRequest out, a StepResult in; check_integrity over every part
    config.py          SchedulerConfig: the limits of one worker's steps
    request.py         SchedulerRequest, RequestStatus: a request as the scheduler tracks it;
                       to_pb_sampling
    queues.py          RequestQueues: waiting / running / swapped, each request's status, the load
    planner.py         StepPlanner: the scheduling rule -- what the next step computes (StepPlan)
    preemption.py      Preemptor: how a running request gives up its blocks (recompute or swap)
    fork.py            ForkManager: parallel sampling (n > 1), copy-on-write of shared blocks
    step.py            StepBuilder: the step message, the steps in flight, their results back in
    image_ranges.py    a request's images: validity, the image a position falls in, a prefix
                       hit cut back to an image's start, per-block prefix-cache keys
    encoder_budget.py  EncoderCacheMirror (the embeddings a worker holds, as its steps tell),
                       StepEncoderBudget (--encoder-budget: images one step may encode)
    routing.py         pick_worker, route_cost: prefix-aware choice of a worker
    stats.py           SchedulerStats: BatchScheduler.stats()' accounting of blocks and steps
"""

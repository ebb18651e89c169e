"""The worker (`pagedserve worker`): weights, KV cache tensors, one batched forward + sampling
per `Step`, publishing tokens (docs/architecture.md, "Packages"). The model code is modeling/,
the vision path vision/.

The service
    server.py             ModelWorkerServicer: the gRPC + Redis shell around ModelRunner
    service_config.py     its settings (`pagedserve worker` flags); config.py: RunnerConfig,
                          the compute core's
    registration.py       the worker's registration in Redis, its heartbeat, the drain on SIGTERM
    event_publisher.py    a step's TokenEvents to Redis, one pipelined round trip
    compute_thread.py     ComputeThread: the one thread that loads the model and runs every
                          step (the worker and the in-process engine, compose/engine.py)
    step_gap.py           the compute thread's idle time between two steps
    host_memory.py        on the CPU, glibc's malloc set to keep the memory a step frees
The compute core
    model_runner.py       ModelRunner: a StepRequest in, sampled tokens out (launch, finish)
    held_requests.py      HeldRequests: the requests it holds and a step's changes to them
    request_state.py      RequestState: what it remembers of one request between steps
    launched_step.py      LaunchedStep: a step launched on the device, its ids on their way
    step_output.py        StepOutput: a step finished -- tokens appended, the result, events
    stop.py               the one finish rule
    kv_budget.py          the KV cache's memory: fixed, or a share of the GPU
The step's inputs
    input_batch.py        InputBatch: the persistent batch, a step laid out and copied once
    staging_buffers.py    StagingBuffers: the int32 buffer it is laid out in, its device twin
    sampling_rows.py      SamplingRows: each row's sampling settings, staged per step
    batch.py              FlatBatch: the flat batch of one step
    cuda_graphs.py        DecodeGraphs: pure-decode steps captured per batch size, replayed
    vision_step.py        ImageEmbedder: a step's images from the encoder cache, the published
                          embeddings or encoded once (vision/); placed over the step's rows
Sampling
    sampler.py            batched sampling, one token per logits row
    logits_processors.py  the requests' edits of the logits (bias, bans, penalties)
    logprobs.py           logprobs of the chosen tokens and their top alternatives
    grammar.py            structured output: a matcher per request, the batched token mask
"""

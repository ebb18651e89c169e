"""`pagedserve encoder`: encodes media as soon as a gateway stores them and publishes their
embeddings for every worker (docs/architecture.md, "The encoder service").

    service.py  EncoderService: the loop (jobs, claims, batches, publishing), registration,
                /health, /metrics
    jobs.py     EncodeJobStream: the encode-job stream as one encoder sees it
    config.py   EncoderServiceConfig: its settings (`pagedserve encoder` flags)

It encodes by the workers' own path, from the packages it shares with them: vision/ (the
media source, MediaEncoder, the published embeddings) over modeling/ (the checkpoint's
vision tower, its dtype, the thread count). It imports no worker_svc module
(tests/architecture/test_import_graph.py)."""

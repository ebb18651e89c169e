"""The vision path shared by the worker and the encoder service: media to image embeddings,
and where they are kept and shared (docs/architecture.md, "Images and video"). The model it
runs is modeling/gemma3_vision.py; it imports no service (tests/architecture/test_import_graph.py).

    media_source.py          MediaSource, RedisMediaSource: the media the gateway stored, by
                             content hash (the worker's steps and the encoder service)
    image_preprocess.py      a PIL image (or one pan-and-scan crop of it) -> pixel values,
                             exactly as Gemma3ImageProcessor (used by media_encoder.py)
    media_encoder.py         MediaEncoder: media fetched, decoded, preprocessed and encoded in
                             one batch -- the worker's and the encoder service's one path
    published_embeddings.py  PublishedEmbeddings: embeddings in Redis under the vision tower's
                             fingerprint, and the encoding claims (the encoder service
                             publishes, the worker reads, takes over and publishes too)
    encoder_cache.py         EncoderCache: the worker's image embeddings by embedding key, LRU
                             by bytes (mirrored by scheduler_svc's encoder budget)

The worker's per-step use of them (a step's images from the cache, the published
embeddings or encoded once; placed over the decoder's rows) is worker_svc/vision_step.py.
"""

"""Media in chat content parts (image_url, video_url, the Responses API's input_image): fetched,
checked and stored once under their content hash in Redis, so a request carries only hashes
and a worker on any host reads what it must encode (DESIGN.md "Images and video").

    options.py   --limit-mm-per-prompt / --media-io-kwargs (vLLM's JSON), VideoSampling
    fetch.py     a URL (data:, http(s)://, file:// or a path) → bytes, with the flags' guards
    address_policy.py  which addresses http(s) fetches may reach: public ones, and
                 --allowed-media-networks; a host resolved once, every address checked
    images.py    PIL: format, pixel cap, full decode; the file is what is stored
    video.py     PyAV: frame cap, sampling by num_frames / fps, frames as RGB8 + timestamps
    store.py     MediaStore: MediaItem under RedisKeys.media(sha256), TTL refreshed on reuse
    uuids.py     MediaUUIDs: a part's uuid → what it loaded to, for parts by uuid alone (no data)
    loaded.py    MediaPart in, LoadedImage / LoadedVideo out
    loader.py    MediaLoader: one request's parts → LoadedImage / LoadedVideo, limits, concurrency

Imports nothing here: gateway/config.py reads options.py and address_policy.py, and must stay
stdlib-only.
"""

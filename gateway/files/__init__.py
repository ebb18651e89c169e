"""OpenAI's Files API for images: a client (a camera) uploads a frame once and names it by
its `file_id` in later requests (the Responses API's `input_image`, chat's `file` part).

    models.py      the File, file list and deletion objects; the record kept in Redis; ids
    upload.py      POST /v1/files' multipart body, read under a byte cap and checked
    ledger.py      FileLedger: each file's record, its scope's index, and every stored
                   file's bytes under --max-file-storage-bytes, kept by atomic scripts
    store.py       FileStore: upload (the image checked and stored as a media item), list,
                   get, content, delete; per API key, each file until its expires_at
    references.py  FileReferences: a request's parts by file_id → the images they name

The five /v1/files routes over the store are gateway/routes/files.py.

An image file is stored once, as the `MediaItem` an inline image of the same bytes is
(gateway/media/store.py, under its content hash), and the file's record points at that
hash: a request naming the file takes the same prompt, the same hashes, hence the same
encoder-cache and prefix-cache entries, as one sending the image inline.
"""

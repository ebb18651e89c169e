"""Every contract between services: the worker gRPC service (worker.proto and its
generated modules) and the msgspec messages carried through Redis (messages.py), with
the Redis key names in one place (keys.py)."""

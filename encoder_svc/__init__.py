"""`pagedserve encoder`: encodes media as soon as a gateway stores them and publishes their
embeddings for every worker (docs/architecture.md, "The encoder service")."""

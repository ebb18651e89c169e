# Redis for the compose test where Docker Hub's redis:7 cannot be pulled: Debian's
# redis-server on the debootstrap base (base-image.sh). Selected with REDIS_IMAGE.
# Like the official image's entrypoint, it turns protected mode off: without a config
# file, Redis would refuse every client but the container's own loopback.
ARG BASE_IMAGE=pagedserve-base:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update && apt-get install -y --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/* && mkdir -p /data && chown redis:redis /data
WORKDIR /data
USER redis
ENTRYPOINT ["sh", "-c", "exec \"$@\" --protected-mode no", "--"]

#!/usr/bin/env bash
# `make test-compose`: the stack built and run in containers, checked with the official
# openai client (tests/e2e/test_compose_stack.py). Here Docker Hub cannot be reached and pip
# goes through a TLS-re-signing proxy, so this build only:
#   - bases the images on a debootstrap bookworm image (base-image.sh; built once, cached)
#     and runs Redis from Debian's package on it (redis.Dockerfile);
#   - hands pip the machine's CA bundle ($SSL_CERT_FILE) and the local CPU torch wheel
#     (pip's find-links folder) through .build-extra/, removed again on exit; torch's other
#     dependencies come from PyPI (TORCH_INDEX).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}

bash compose/testing/dockerd.sh
export BASE_IMAGE=${BASE_IMAGE:-pagedserve-base:bookworm}
export REDIS_IMAGE=${REDIS_IMAGE:-pagedserve-test-redis:bookworm}
bash compose/testing/base-image.sh "$BASE_IMAGE"
docker image inspect "$REDIS_IMAGE" >/dev/null 2>&1 \
  || docker build -q -t "$REDIS_IMAGE" --build-arg BASE_IMAGE="$BASE_IMAGE" -f compose/testing/redis.Dockerfile compose/testing

cleanup() { find .build-extra -mindepth 1 ! -name README.md ! -name .gitignore -delete; }
trap cleanup EXIT
cleanup
if [ -n "${SSL_CERT_FILE:-}" ] && [ -f "$SSL_CERT_FILE" ]; then
  cp "$SSL_CERT_FILE" .build-extra/ca.crt
fi
FIND_LINKS=${PIP_FIND_LINKS:-$($PY -m pip config get global.find-links 2>/dev/null || true)}
mkdir -p .build-extra/wheels
for dir in $FIND_LINKS; do
  cp "$dir"/torch-*+cpu-*.whl .build-extra/wheels/ 2>/dev/null || true
done
export TORCH_INDEX=${TORCH_INDEX:-https://pypi.org/simple}

export PAGEDSERVE_COMPOSE_TEST=1
start=$(date +%s)
$PY -m pytest -q -p no:cacheprovider tests/e2e/test_compose_stack.py ${PYTEST_ARGS:-}
echo "compose test: $(( $(date +%s) - start )) s"

# pagedserve: `make up` serves the default model; `make test` runs the whole suite.
# Both install what they need first (a virtualenv with torch pinned, a redis-server).

PYTHON ?= python3
VENV   ?= .venv
MODEL  ?=
PORT   ?= 8000
WORKERS ?= 1
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed

.PHONY: up test test-compose install redis cc docker-compose bench gpu-bundle gpu-check gpu-dry-run clean

# Run apt as root, or through sudo when there is one.
SUDO    = $(shell [ "$$(id -u)" = 0 ] || command -v sudo)
APT     = DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get

$(STAMP): pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
	  || (echo "pagedserve needs Python >= 3.11: run with PYTHON=python3.11 (or newer)" && exit 1)
	@# A venv whose creation failed halfway (no python3-venv) has a python but no pip: redo it.
	$(PY) -m pip --version >/dev/null 2>&1 || { rm -rf $(VENV) && $(PYTHON) -m venv $(VENV); }
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP) redis cc

# A redis-server on PATH, from Debian's package when the machine has none.
# (Not needed when REDIS_URL names a Redis to use.)
redis:
	@[ -n "$(REDIS_URL)" ] || command -v redis-server >/dev/null \
	  || ($(APT) update -qq && $(APT) install -y -qq --no-install-recommends redis-server) \
	  || (echo "redis-server is missing and could not be installed: install it, or set REDIS_URL" && exit 1)

# A C compiler for the CPU attention kernel (kernels/cpu_attention.c); without one the
# workers fall back to the slower torch backend, with a warning.
cc:
	@command -v $${CC:-cc} >/dev/null \
	  || ($(APT) update -qq && $(APT) install -y -qq --no-install-recommends gcc libc6-dev) \
	  || echo "no C compiler and gcc could not be installed: CPU workers use the torch attention backend"
	@# The kernel's cffi binding compiles against Python's headers (a Debian python3 lacks them).
	@$(PYTHON) -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
	  || ($(APT) update -qq && $(APT) install -y -qq --no-install-recommends python3-dev) \
	  || echo "no Python headers and python3-dev could not be installed: CPU workers use the torch attention backend"

# Only the tests need it: they validate compose/docker-compose.yml with `docker-compose config`.
docker-compose:
	@command -v docker-compose >/dev/null \
	  || ($(APT) update -qq && $(APT) install -y -qq --no-install-recommends docker-compose) \
	  || echo "docker-compose could not be installed; the compose test will fail"

up: install
	$(VENV)/bin/pagedserve up --port $(PORT) --workers $(WORKERS) $(if $(MODEL),--model $(MODEL),) \
	  $(if $(REDIS_URL),--redis-url $(REDIS_URL),)

test: install docker-compose
	$(PY) -m ruff check .
	$(PY) -m pytest -q --durations=15 $(PYTEST_ARGS)

# The stack built and run in containers (tests/e2e/test_compose_stack.py): starts dockerd when
# none answers (as root), builds a debootstrap base image once, then the images. See
# compose/testing/test-compose.sh.
test-compose: install docker-compose
	PY=$(PY) bash compose/testing/test-compose.sh

# Every contender (full stack, in-process engine, transformers serve, static generate()),
# medians of 3 interleaved runs; see docs/benchmarks.md, "Serving: the stack against the baselines".
bench: install
	$(PY) -m pip install --quiet -c constraints.txt -e '.[bench]'
	$(PY) bench/stack/compare.py $(BENCH_ARGS)

# The GPU check (.ci/gpu/check.py; CONTRIBUTING.md "On a GPU"). Here, with network: the bundle of
# wheels (for the GPU image's Python), Redis and tokenizers that the lent machine lacks.
# There, without network: install it and run the GPU tests and benchmarks in one call.
# DEVICE=cpu runs what a CPU can (the dry run); GPU_PY is the Python to check with.
GPU_BUNDLE ?= .gpu-bundle
GPU_PYTHON_VERSION ?= 3.12
GPU_PY  ?= python3
DEVICE  ?= cuda
gpu-bundle: install
	$(PY) .ci/gpu/bundle.py --dest $(GPU_BUNDLE) --python-version $(GPU_PYTHON_VERSION)

gpu-check:
	$(GPU_PY) .ci/gpu/check.py --device $(DEVICE) --bundle $(GPU_BUNDLE) $(if $(OUT),--out $(OUT),)

# The proof here that the bundle is complete: a venv with only the GPU image's packages
# (for this machine's Python), a bundle for that Python, and the check on the CPU.
gpu-dry-run: install
	$(PY) .ci/gpu/image_venv.py --dest .gpu-image-venv
	$(PY) .ci/gpu/bundle.py --dest .gpu-bundle-dry-run \
	  --python-version $$($(PY) -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
	$(MAKE) gpu-check DEVICE=cpu GPU_PY=.gpu-image-venv/bin/python GPU_BUNDLE=.gpu-bundle-dry-run

clean:
	rm -rf $(VENV) .run models

# pagedserve: `make up` serves the default model; `make test` runs the whole suite.
# Both install what they need first (a virtualenv with torch pinned, a redis-server).

PYTHON ?= python3
VENV   ?= .venv
MODEL  ?=
PORT   ?= 8000
WORKERS ?= 1
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed

.PHONY: up test install redis docker-compose bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP) redis

# A redis-server on PATH, from Debian's package when the machine has none.
redis:
	@command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server) \
	  || (echo "redis-server is missing and could not be installed: install it, or set REDIS_URL" && exit 1)

# Only the tests need it: they validate compose/docker-compose.yml with `docker-compose config`.
docker-compose:
	@command -v docker-compose >/dev/null || (apt-get update -qq && apt-get install -y -qq docker-compose) \
	  || echo "docker-compose could not be installed; the compose test will fail"

up: install
	$(VENV)/bin/pagedserve up --port $(PORT) --workers $(WORKERS) $(if $(MODEL),--model $(MODEL),)

test: install docker-compose
	$(PY) -m pytest -q $(PYTEST_ARGS)

# Every contender (full stack, in-process engine, transformers serve, static generate()),
# medians of 3 interleaved runs; see docs/benchmarks.md.
bench: install
	$(PY) -m pip install --quiet -c constraints.txt -e '.[bench]'
	$(PY) bench/compare.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .run models

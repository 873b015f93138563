# servelab: `make demo` runs the main job, `make test` runs the tests. Both create .venv on first use.
# `make lock` writes requirements.lock again; `make stop` stops the local stack; `make clean` removes it all;
# `make clients` installs the benchmark clients (AIPerf, GuideLLM) that `make test` runs against the API.
# `make gpu-wheels` makes the folder `make gpu-check` installs on an air-gapped CUDA host (docs/deployment.md).
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
SL := $(VENV)/bin/servelab
STAMP := $(VENV)/.installed
LOCK := requirements.lock
EXTRAS := engine,dashboard,test,local
PIP_VERSION := 26.3

CLIENTS := .cache/clients
# The suite runs in this many pytest processes (pytest-xdist), one file's tests in one of them: a run on its own
# keeps one of two cores busy on average (each test's engines and workers run one thread, and much of a test is
# waiting on processes it started), so two share a 2-core machine's cores.
TEST_PROCESSES ?= 2

GPU_WHEELS ?= dist/gpu-wheels
GPU_PYTHON ?= python3
GPU_VENV := .cache/gpu-check-venv
GPU_CHECK_ARGS ?=

.PHONY: install lock demo test clients clients-lock bench stop clean gpu-wheels gpu-check

# Every package at the version requirements.lock names (applied as pip constraints: the whole tree pinned).
$(STAMP): pyproject.toml requirements-nodeps.txt $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet pip==$(PIP_VERSION)
	# torch==2.13.0 is pinned: on these machines pip takes the CPU wheel already on disk.
	$(PY) -m pip install --quiet -c $(LOCK) -e ".[$(EXTRAS)]"
	# Packages whose declared dependencies are wrong for this stack (see docs/development.md, "Dependencies").
	$(PY) -m pip install --quiet --no-deps -c $(LOCK) -r requirements-nodeps.txt
	touch $(STAMP)

install: $(STAMP)

# Write requirements.lock again from a fresh resolve (after a pin in pyproject.toml changed), in a throwaway venv.
lock:
	rm -rf .lock-venv
	$(PYTHON) -m venv .lock-venv
	.lock-venv/bin/python -m pip install --quiet pip==$(PIP_VERSION)
	.lock-venv/bin/python -m pip install --quiet -e ".[$(EXTRAS)]"
	.lock-venv/bin/python -m pip install --quiet --no-deps -r requirements-nodeps.txt
	sed -n '/^#/p' $(LOCK) > .lock-venv/lock.txt
	.lock-venv/bin/python -m pip freeze --exclude-editable | sed -E 's/\+[A-Za-z0-9.]+$$//' >> .lock-venv/lock.txt
	mv .lock-venv/lock.txt $(LOCK)
	rm -rf .lock-venv

# The main job: the local stack, a batch file through the API, AWQ int4 against fp32, the verdict.
demo: $(STAMP)
	$(SL) up --configs configs/smollm2.yaml
	$(SL) keys create --tenant demo > .state/demo.key
	SERVELAB_API_KEY=$$(cat .state/demo.key) $(SL) submit examples/batch.jsonl --config smollm2
	$(SL) quantize --config configs/awq-int4-fast.yaml
	@# compare exits 0 accept, 1 reject, 3 inconclusive (answers the demo prints), 2 an error (the demo fails)
	$(SL) compare plans/demo.yaml; status=$$?; [ $$status -eq 0 ] || [ $$status -eq 1 ] || [ $$status -eq 3 ]
	@echo
	@echo "The stack is still up: API http://127.0.0.1:8000/v1 (key in .state/demo.key), model 'smollm2'."
	@echo "Dashboard: $(SL) dashboard   then open http://127.0.0.1:8501"
	@echo "What runs: $(SL) status    Stop everything: make stop"

# AIPerf and GuideLLM, each in a venv of its own (their pins clash with the lock), at the versions
# bench/clients/requirements-NAME.txt pins, their trees at bench/clients/lock-NAME.txt's versions:
# tests/api/test_bench_clients.py runs them against a live api.
$(CLIENTS)/%/.installed: bench/clients/requirements-%.txt bench/clients/lock-%.txt
	rm -rf $(CLIENTS)/$*
	$(PYTHON) -m venv $(CLIENTS)/$*
	$(CLIENTS)/$*/bin/python -m pip install --quiet pip==$(PIP_VERSION)
	$(CLIENTS)/$*/bin/python -m pip install --quiet -c bench/clients/lock-$*.txt -r $<
	touch $@

clients: $(CLIENTS)/aiperf/.installed $(CLIENTS)/guidellm/.installed

# Write bench/clients/lock-NAME.txt again from a fresh resolve of requirements-NAME.txt, in a throwaway venv.
clients-lock:
	for name in aiperf guidellm; do \
	  rm -rf .lock-venv && $(PYTHON) -m venv .lock-venv && \
	  .lock-venv/bin/python -m pip install --quiet pip==$(PIP_VERSION) && \
	  .lock-venv/bin/python -m pip install --quiet -r bench/clients/requirements-$$name.txt && \
	  sed -n '/^#/p' bench/clients/lock-$$name.txt > .lock-venv/lock.txt && \
	  .lock-venv/bin/python -m pip freeze | sed -E 's/\+[A-Za-z0-9.]+$$//' >> .lock-venv/lock.txt && \
	  mv .lock-venv/lock.txt bench/clients/lock-$$name.txt || exit 1; \
	done
	rm -rf .lock-venv

# The two clients' venvs install side by side (each is mostly downloads and unpacking); then the suite, in
# TEST_PROCESSES processes (`make test TEST_PROCESSES=0` runs it in this one).
test: $(STAMP)
	$(MAKE) -j2 clients
	$(PY) -m pytest -n $(TEST_PROCESSES) --durations=25

# The engine's speed steps side by side (docs/performance.md, "The engine's speed work, step by step"); the peer engines: bench/peers/README.md.
bench: $(STAMP)
	$(SL) bench steps --config configs/fp32.yaml --threads 1
	$(SL) bench steps --config configs/bf16.yaml --threads 1

# On a networked machine: the wheels a CUDA host with Python 3.12, PyTorch, transformers and Triton lacks, servelab's
# wheel and the bundled tokenizer, then the folder's size against its 64 MiB limit (it fails when over).
gpu-wheels: $(STAMP)
	$(PY) deploy/gpu_wheels.py $(GPU_WHEELS)

# On the CUDA host, no network, no project venv: a throwaway venv over the host's own packages (its torch, transformers
# and Triton, also where its python3 is itself a venv), the folder's wheels, then the check from this checkout. Exit
# status: the check's.
gpu-check:
	$(GPU_PYTHON) deploy/gpu_check_venv.py $(GPU_VENV) $(GPU_WHEELS)
	PYTHONPATH=$(CURDIR) $(GPU_VENV)/bin/python -m servelab.cli check-gpu --tokenizer $(GPU_WHEELS)/tokenizer $(GPU_CHECK_ARGS)

stop:
	@if [ -x $(SL) ]; then $(SL) down; fi

clean: stop
	rm -rf $(VENV) .cache .state

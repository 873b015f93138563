# servelab: `make demo` runs the main job, `make test` runs the tests. Both create .venv on first use.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test bench stop clean

$(STAMP): pyproject.toml requirements-nodeps.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch==2.13.0 is pinned: on these machines pip takes the CPU wheel already on disk.
	$(PY) -m pip install --quiet -e ".[engine,dashboard,test]"
	# Packages whose declared dependencies are wrong for this stack (see README, "Dependencies").
	$(PY) -m pip install --quiet --no-deps -r requirements-nodeps.txt
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/servelab generate --config configs/fp32.yaml --max-new-tokens 24 \
		"The capital of France is" "Water boils at a temperature of"
	$(VENV)/bin/servelab generate --config configs/bf16.yaml --chat --max-new-tokens 48 "What is the capital of France?"
	$(VENV)/bin/servelab bench engine --configs configs/fp32.yaml,configs/bf16.yaml --batch-sizes 1,4,16 --new-tokens 16 --rounds 1 --threads 1
	$(VENV)/bin/servelab bench queue --config configs/bf16.yaml --requests 16 --new-tokens 8 --rounds 1 --threads 1

test: $(STAMP)
	$(PY) -m pytest

bench: $(STAMP)
	$(VENV)/bin/servelab bench engine --configs configs/fp32.yaml,configs/bf16.yaml --threads 1

stop:
	$(VENV)/bin/servelab down

clean: stop
	rm -rf $(VENV) .cache .state

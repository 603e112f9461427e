# make demo: train a small T5 on the bundled Bible task, evaluate BLEU, show translations.
# make test: the whole test suite (about 37 min on 2 CPU cores, two pytest workers);
# make test-fast (under 3 min): all but the tests marked slow, for your own edit-test loop.
# make bench: the benchmarks.
# Each creates .venv (Python 3.11) if it is missing and installs what it uses: the demo
# only the library, test adds pytest + the numerical references (torch, transformers)
# and the [tf] and [beam] extras (SavedModel export, cache_tasks; TensorFlow also writes
# the Mesh TF bundles the tests read), bench adds torch, transformers and CTranslate2.  .venv/bin/python -m t5forge ... works
# after any of them.  test also needs a browser for the serving page's test
# (tests/test_serve_page.py drives headless chromium through selenium): when `chromium` or
# `chromedriver` is not on PATH, the browser target installs Debian's chromium and
# chromium-driver with apt-get (root, or sudo when not root; a few minutes, ~300 MB); when
# both are present it does nothing.  Every target but clean also installs Debian's jemalloc
# when it is missing and apt-get can run (the allocator target; t5forge preloads it where
# glibc's malloc cannot use transparent huge pages, see t5forge/host_memory.py), and carries
# on without it otherwise.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# One stamp per set of extras, so `make demo` then `make test` still installs the test
# extras; each is redone only when the pins change.
STAMP_BASE := $(VENV)/.t5forge-installed
STAMP_TEST := $(VENV)/.t5forge-installed-test
STAMP_BENCH := $(VENV)/.t5forge-installed-bench
PINS := pyproject.toml requirements.lock

.PHONY: test test-fast lint demo bench venv clean browser allocator coverage

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP_BASE): $(PY) $(PINS)
	$(PY) -m pip install --quiet -c requirements.lock -e .
	touch $@

$(STAMP_TEST): $(STAMP_BASE) $(PINS)
	$(PY) -m pip install --quiet -c requirements.lock -e '.[test,tf,beam]'
	touch $@

$(STAMP_BENCH): $(STAMP_BASE) $(PINS)
	$(PY) -m pip install --quiet -c requirements.lock -e '.[bench]'
	touch $@

venv: $(STAMP_BASE) allocator

# Checked on every run (phony) rather than stamped: the question is whether the programs are on
# PATH now, whoever installed them.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; else \
	  echo "installing Debian's chromium and chromium-driver for tests/test_serve_page.py"; \
	  $(SUDO) apt-get update && \
	  $(SUDO) apt-get install -y --no-install-recommends chromium chromium-driver; fi

# The host allocator `t5forge` falls back to (T5FORGE_MALLOC=auto, t5forge/host_memory.py) where
# glibc's malloc cannot use transparent huge pages (glibc < 2.35, or the kernel's are off):
# Debian's jemalloc, ~1 MB. Without root, sudo or apt-get this only says so.
allocator:
	@if ls /usr/lib/*/libjemalloc.so.2 >/dev/null 2>&1; then :; \
	elif command -v apt-get >/dev/null && { [ "$$(id -u)" = 0 ] || sudo -n true 2>/dev/null; }; then \
	  echo "installing Debian's libjemalloc2 (faster host memory)"; \
	  { $(SUDO) apt-get update -qq && \
	    $(SUDO) apt-get install -y -qq libjemalloc2; } || \
	  echo "note: could not install jemalloc; where huge pages cannot work t5forge will use the system malloc"; \
	else echo "note: no apt-get or root for jemalloc; where huge pages cannot work t5forge will use the system malloc"; fi

# Two worker processes. `loadgroup`: the tests that share a module fixture (a server, a
# trained run) run in one worker, so it is built once; every other test goes to whichever
# worker is free (tests/conftest.py forms the groups). One JAX compilation cache serves
# the workers and every process they start (tests/conftest.py); pytest-timeout fails a test
# that runs past its limit by name; the 15 slowest tests are printed (pyproject.toml).
PYTEST := $(PY) -m pytest -q -n 2 --dist loadgroup
test: $(STAMP_TEST) browser allocator lint
	$(PYTEST) tests

test-fast: $(STAMP_TEST) browser allocator lint
	$(PYTEST) -m "not slow" tests

# Line coverage of t5forge/ over the whole suite: the workers and every process they start
# (coverage's subprocess patch), combined, then reported (coverage.xml and the total).
COVERAGE := COVERAGE_RCFILE=$(CURDIR)/pyproject.toml COVERAGE_FILE=$(CURDIR)/.coverage-data/.coverage $(VENV)/bin/coverage
coverage: $(STAMP_TEST) browser allocator
	rm -rf .coverage-data && mkdir -p .coverage-data
	-$(COVERAGE) run -m pytest -q -n 2 --dist loadgroup tests
	$(COVERAGE) combine -q
	$(COVERAGE) report --format=total

# The linter's rules are in pyproject.toml; the import layers are tests/test_layers.py.
lint: $(STAMP_TEST)
	$(VENV)/bin/ruff check t5forge bench tests tools

demo: $(STAMP_BASE) allocator
	$(PY) -m t5forge demo

bench: $(STAMP_BENCH) allocator
	$(PY) -m bench

clean:
	rm -rf $(VENV) build *.egg-info

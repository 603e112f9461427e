# make demo: train a small T5 on the bundled Bible task, evaluate BLEU, show translations.
# make test: the whole test suite.  Both create .venv (Python 3.11) if it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.t5forge-installed

.PHONY: test demo bench venv clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# Reinstall only when the pins change.
$(STAMP): $(PY) pyproject.toml requirements.lock
	$(PY) -m pip install --quiet -c requirements.lock -e '.[test,bench]'
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

demo: $(STAMP)
	$(PY) -m t5forge demo

bench: $(STAMP)
	$(PY) -m bench

clean:
	rm -rf $(VENV) build *.egg-info

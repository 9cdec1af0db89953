# Two commands do all set-up on a fresh machine:
#   make demo   create .venv, install deploykit, build the example model, convert it
#   make test   create .venv, install deploykit with its test extras, run the tests
VENV ?= .venv
PYTHON ?= python3
TORCH ?= torch==2.14.1 torchvision==0.29.1
PY := $(VENV)/bin/python
DEMO := examples/resnet18

.PHONY: demo test test-slow install clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) $(DEMO)/build_model.py $(DEMO)/model.pt2
	$(VENV)/bin/deploykit convert $(DEMO)/model.pt2 -o $(DEMO)/out --batch 1:4:8 --force

# One pytest worker a core; a test module's tests stay on one worker (its module-scoped bundles are made once).
# make test leaves the tests marked slow (whole-model conversions, libtorch builds) to make test-slow; CI runs both.
PYTEST := $(PY) -m pytest -q -n auto --dist loadscope

test: install
	$(PYTEST) -m "not slow"

test-slow: install
	$(PYTEST) -m slow

clean:
	rm -rf $(VENV) $(DEMO)/model.pt2 $(DEMO)/out

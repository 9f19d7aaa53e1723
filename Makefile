# GPU Portal — two commands on a fresh machine: `make run` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install run test lint bench system-deps services clean

install: $(VENV)/.installed

$(VENV)/.installed: requirements.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -r requirements.lock
	touch $@

# Debian packages the full test suite drives for real (Chromium, Slurm, munge, promtool, compose validator).
system-deps:
	bash scripts/install-system-deps.sh

services: install
	$(BIN)/python bin/devservices.py up

run: install
	$(BIN)/python bin/run_dev.py

test: install services
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check .

bench: install services
	$(BIN)/python bench/run_all.py

clean:
	-$(BIN)/python bin/devservices.py down
	rm -rf var staticfiles

# trainplan: `make book` builds the runbook, `make test` runs the tests.
# Both create .venv and install requirements.txt when missing or changed.

PYTHON   ?= python3
VENV     := .venv
BIN      := $(VENV)/bin
STAMP    := $(VENV)/.installed
SCENARIO ?= llama-13b-32xh100
export PYTHONHASHSEED := 0
export MPLBACKEND := Agg

.PHONY: book test notebooks bench-search clean lint system-deps

$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -r requirements.txt
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $(STAMP)

## book: execute the notebooks for SCENARIO with papermill, then build the HTML strictly
book: $(STAMP)
	$(BIN)/python -m trainplan.book --scenario $(SCENARIO)
	$(BIN)/jupyter-book build . --all --builder html -n -W --keep-going
	@echo "runbook: $(CURDIR)/_build/html/index.html"

## system-deps: Slurm and munge for the launch tests (Debian; apt-get runs only when missing)
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
system-deps:
	@if ! command -v sbatch >/dev/null || ! test -x /usr/sbin/slurmctld \
	    || ! test -x /usr/sbin/slurmd || ! test -x /usr/sbin/munged; then \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install \
	    -y -qq --no-install-recommends slurm-wlm munge >/dev/null; fi

## test: unit, property and CLI tests, then nbval over the committed notebooks
test: system-deps $(STAMP)
	$(BIN)/python -m pytest -q -n 2 tests
	$(BIN)/python -m pytest -q --nbval --nbval-sanitize-with tests/nbval_sanitize.cfg notebooks

## notebooks: re-execute the committed notebooks in place (default scenario) after a library change
notebooks: $(STAMP)
	$(BIN)/python -m trainplan.book --in-place

## bench-search: time the full strategy search (figure quoted in the README)
bench-search: $(STAMP)
	$(BIN)/python bench/search_speed.py

lint: $(STAMP)
	$(BIN)/ruff check lib tests bench

clean:
	rm -rf _build book/_generated

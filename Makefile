# trainplan: `make book` builds the runbook, `make test` runs the tests.
# Both create .venv and install requirements.txt when missing or changed.

PYTHON   ?= python3
VENV     := .venv
BIN      := $(VENV)/bin
STAMP    := $(VENV)/.installed
DEFAULT_SCENARIO := llama-13b-32xh100
SCENARIO ?= $(DEFAULT_SCENARIO)
SCENARIOS := $(sort $(basename $(notdir $(wildcard data/scenarios/*.yaml))))
export PYTHONHASHSEED := 0
export MPLBACKEND := Agg

.PHONY: book book-all pdf lab bench-book browser test test-scenarios notebooks bench-search clean \
        lint system-deps snap validate fault-matrix wheels

$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "installing requirements.txt into $(VENV) (the first time takes about two minutes)"
	$(BIN)/python -m pip install --disable-pip-version-check --progress-bar off -r requirements.txt
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $(STAMP)

## book: execute the notebooks for SCENARIO with papermill, build the HTML strictly into
## _build/SCENARIO/html, print its six pages to _build/SCENARIO/pdf/trainplan-runbook-SCENARIO.pdf
## where Chromium is installed (`make browser` installs Debian's; the HTML needs none)
book: $(STAMP)
	@$(BIN)/python -m trainplan.runbook.build --scenario $(SCENARIO)
	@$(BIN)/python -m trainplan.runbook.site --scenario $(SCENARIO)
	@if command -v chromium >/dev/null; then \
	  $(BIN)/python -m trainplan.runbook.pdf --scenario $(SCENARIO); else echo "PDF skipped: no \
	  chromium here; 'make browser' installs Debian's (root or sudo), then 'make pdf \
	  SCENARIO=$(SCENARIO)'"; fi

## book-all: `make book` for every scenario in data/scenarios/, each into _build/<scenario>/;
## the default last, so that book/_generated/ holds its notebooks afterwards
book-all: $(STAMP)
	@for s in $(filter-out $(DEFAULT_SCENARIO),$(SCENARIOS)) $(DEFAULT_SCENARIO); do \
	  $(MAKE) --no-print-directory book SCENARIO=$$s || exit 1; done

## pdf: print SCENARIO's six runbook pages, from its last `make book`, with headless Chromium
pdf: browser $(STAMP)
	$(BIN)/python -m trainplan.runbook.pdf --scenario $(SCENARIO)

## lab: JupyterLab on a scratch copy of the notebooks with SCENARIO's parameters, in
## _build/lab/ (the committed notebooks, which nbval compares, stay as they are); on a remote
## machine: make lab LAB_ARGS="--no-browser --ip=0.0.0.0" and open the printed URL
lab: $(STAMP)
	@test -x $(BIN)/jupyter-lab || $(BIN)/python -m pip install --quiet \
	  --disable-pip-version-check -r requirements-lab.txt
	@rm -rf _build/lab && mkdir -p _build/lab && for nb in notebooks/*.ipynb; do \
	  $(BIN)/papermill --prepare-only -k python3 -p scenario $(SCENARIO) --cwd notebooks \
	    "$$nb" "_build/lab/$$(basename $$nb)" 2>/dev/null || exit 1; done
	$(BIN)/jupyter-lab --notebook-dir=_build/lab $(if $(SUDO),,--allow-root) $(LAB_ARGS)

## bench-book: time `make book` for the default scenario (figure quoted in the README)
bench-book: browser $(STAMP)
	$(BIN)/python tools/book_speed.py

## system-deps: Slurm and munge for the launch tests, Chromium for the book (Debian; apt-get
## runs only when missing)
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
system-deps: browser
	@if ! command -v sbatch >/dev/null || ! test -x /usr/sbin/slurmctld \
	    || ! test -x /usr/sbin/slurmd || ! test -x /usr/sbin/munged; then \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install \
	    -y -qq --no-install-recommends slurm-wlm munge >/dev/null; fi

## browser: Debian's chromium, headless, for the PDF and the browser test (no downloaded browsers)
browser:
	@if ! command -v chromium >/dev/null; then \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install \
	    -y -qq --no-install-recommends chromium >/dev/null; fi

## test: unit, property and CLI tests, then nbval over the committed notebooks
test: system-deps $(STAMP)
	$(BIN)/python -m pytest -q -n 2 tests
	$(BIN)/python -m pytest -q --nbval --nbval-sanitize-with tests/nbval_sanitize.cfg notebooks

## test-scenarios: build every scenario (about a minute each on two cores), then check that
## each prints six pages named by it and fits its boxes on the first screen (make test checks
## the default scenario's; the others' are skipped there unless built at this version)
test-scenarios: browser book-all
	$(BIN)/python -m pytest -q tests/book/test_print.py

## snap: a git-archive of HEAD's code and specs in .snap/ (ignored), for device calls to carry,
## with the record files the committed calibrations list (`trainplan calibrate --committed`)
snap: $(STAMP)
	rm -rf .snap && mkdir .snap && git archive HEAD lib data/suites data/hardware data/models \
	  data/clusters data/scenarios $$($(BIN)/python tools/calibration_sources.py) \
	  | tar -x -C .snap && git rev-parse HEAD > .snap/COMMIT

## wheels: the Python packages the GPU machines lack, for a device call to carry: they have
## torch 2.11 and no package index. Downloads torchao (fp8 training; the version
## requirements.txt pins, one abi3 wheel for CPython >= 3.10 on x86-64) into .whl/ (ignored).
## On the device: carry .whl, then
##   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
##   export PYTHONPATH=$$PWD/lib:/tmp/site
TORCHAO := $(shell sed -n 's/^\(torchao==[^ ]*\).*/\1/p' requirements.txt)
wheels: $(STAMP)
	$(BIN)/python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_28_x86_64 -d .whl $(TORCHAO)
	@ls .whl

## notebooks: re-execute the committed notebooks in place (default scenario) after a library change
notebooks: $(STAMP)
	$(BIN)/python -m trainplan.runbook.build --in-place

## validate: rerun the proof on this machine's GPUs: microbenchmarks -> calibration ->
## predictions -> measurements -> compare (VALIDATE_OUT, not OUT: the device sets $OUT)
GPUS         ?= 4
SUITE        ?= data/suites/proxy-4gpu.yaml
VALIDATE_OUT ?= out/validate-$(shell date -u +%Y%m%dT%H%M%SZ)
BUDGET_S     ?= 530
validate: $(STAMP)
	NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
	  $(BIN)/python -m trainplan.cli validate --gpus $(GPUS) --suite $(SUITE) \
	  --out $(VALIDATE_OUT) --budget-s $(BUDGET_S) $(VALIDATE_ARGS)

## fault-matrix: run tests/faults and write page 5's evidence table
fault-matrix: $(STAMP)
	$(BIN)/python -m trainplan.resilience.fault_matrix

## bench-search: time the full strategy search (figure quoted in the README)
bench-search: $(STAMP)
	$(BIN)/python tools/search_speed.py

lint: $(STAMP)
	$(BIN)/ruff check lib tests bench

clean:
	rm -rf _build book/_generated

# Every target sets up what it needs first, so each works on a fresh clone.
PYTHON ?= python3
# torch goes in first and alone: the pinned 2.13.0 is a CPU build where a local wheel exists, and any
# looser requirement would pull several GB of CUDA packages. On a laptop with no local wheel, e.g.
#   make setup TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo lint format test test-unit bench docs docs-figures lock clean

setup: $(STAMP)

$(STAMP): requirements.txt
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info[:2] >= (3, 10) else "gpu-cluster needs Python 3.10+: make setup PYTHON=python3.11")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check $(TORCH_SPEC)
	$(BIN)/pip install --quiet --disable-pip-version-check -r requirements.txt
	touch $@

# make demo BIND=127.0.0.20 SSH_PORT=2300 MASTER_PORT=29600: node-0's loopback address, its SSH port and
# the rendezvous port, where the defaults (127.0.0.10, 2222, 29500) are taken on this machine.
demo: setup
	PATH="$(CURDIR)/$(BIN):$$PATH" BIND="$(BIND)" SSH_PORT="$(SSH_PORT)" MASTER_PORT="$(MASTER_PORT)" bash scripts/demo.sh

# ruff (format and lint) checks the code and the tests; mypy the code (the tests assert on what they get,
# unannotated). A folder with no Python file (scripts/ holds only shell) or none at all is skipped.
CODE_PATHS ?= $(foreach d,infra remote node harness examples bench scripts dashboard,$(if $(wildcard $(d)/*.py),$(d))) \
	deploy.py fabfile.py
LINT_PATHS ?= $(CODE_PATHS) tests
# All three run, so one pass shows every finding; any of them failing fails the target.
lint: setup
	@status=0; \
	$(BIN)/ruff format --check $(LINT_PATHS) || status=1; \
	$(BIN)/ruff check $(LINT_PATHS) || status=1; \
	$(BIN)/mypy $(CODE_PATHS) || status=1; \
	exit $$status

# Rewrites the files: the formatter, then ruff's safe fixes (import order, pyupgrade).
format: setup
	$(BIN)/ruff format $(LINT_PATHS)
	$(BIN)/ruff check --fix $(LINT_PATHS)

# tests/unit: pure logic (command building and parsing, the watchdog's rules, moto, Pulumi's mocks), no
# cluster, no SSH server, no torchrun, no deploy.py or fab; in one process, under a minute.
test-unit: setup
	$(BIN)/python -m pytest tests/unit

# The whole suite: tests/unit and tests/integration (real local clusters, stock sshd, torchrun, the CLIs
# as a user runs them). The OpenSSH tests' node users need a Python with torch outside any private home:
# built once (cached). The suite runs on TEST_WORKERS processes (pytest-xdist): most of its time is spent
# waiting on real SSH servers, rendezvous and timeouts, not computing. A module that shares one cluster
# runs whole on one worker (tests/conftest.py). `make test TEST_WORKERS=0` runs it in one process.
# PYTHONDONTWRITEBYTECODE cleared: the suite starts fab and deploy.py hundreds of times, each compiling
# the project's modules again where no bytecode may be written (0.08 s of CPU a fab, measured).
TEST_WORKERS ?= 3
test: setup lint
	-$(BIN)/python -m tests.support.openssh build-python
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup)

bench: setup
	$(BIN)/python -m bench

# The docs site from docs/ into site/ (mkdocs.yml): --strict fails on a broken link or anchor, a page
# left out of the nav or any other warning. Offline: no web fonts, no CDN (theme.font is false).
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# The pictures in docs/img/, drawn again: the architecture from the package imports, and a launch
# timeline and the dashboard from a real 2-node local run (minutes; the dashboard needs /usr/bin/chromium).
docs-figures: setup
	PYTHONPATH=$(CURDIR) $(BIN)/python scripts/docs_figures.py

lock: setup
	$(BIN)/pip install --quiet -r requirements.in
	( echo '# Pinned by `make lock` from requirements.in (torch==2.13.0 is installed first by `make setup`).'; \
	  echo 'torch==2.13.0'; $(BIN)/pip freeze --exclude torch ) > requirements.txt

clean:
	rm -rf $(VENV) .pytest_cache site

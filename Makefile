# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# A CPU build of this torch lies on this project's machines; installing it first keeps set-up fast.
# pyproject.toml keeps a range (torch>=2.4) so users get the build their platform wants.
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test system-packages lint typecheck pytest clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_PIN)"
	$(BIN)/python -m pip install --quiet -e ".[agent,dev,torchao,hf,lightning]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/quantwatch demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

# The Debian binaries the suite runs for real: installed when missing (as root with apt-get), else make stops here
# and prints the command that installs them.
system-packages:
	.ci/system-packages

# One pytest worker per core, each taking whole test files, so that a module's fixtures (one demo run serving many
# assertions) are built once.
PYTEST_WORKERS ?= 2
pytest: system-packages $(STAMP)
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile

test: system-packages lint typecheck pytest

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache

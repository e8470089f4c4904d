# One-command entry points. `make demo` runs the main job offline; `make docs` builds the documentation
# site into site/; `make test` runs the static checks
# (`make lint`: ruff's lint and format check, and mypy, configured in pyproject.toml), then the tests.
# Both create .venv and install pflkit with constraints.txt (torch 2.13.0, the CPU build here);
# elsewhere, `pip install -e .` accepts any recent torch.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install demo lint docs test

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

install: $(BIN)/python
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[test,docs,flower,tensorboard,ray]"

# the digits demo (the default experiment) with the papers' five repetitions: mean ± std over seeds
demo: install
	$(BIN)/pflkit run 'seeds=[0,1,2,3,4]'

lint: install
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy

# the documentation site into site/ (docs/, mkdocs.yml; the reference pages generated from the code)
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

test: lint
	$(BIN)/python -m pytest -q

# Two entry points: `make demo` trains the tiny MoE on the embedded corpus,
# `make test` runs the whole suite. Both set up .venv on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch that lies on disk on the development machines; pinned
# first so that the package's `torch>=2.11` does not pull a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test setup clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_PIN)
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/ferry data prepare --embedded stdlib --output data/stdlib
	$(BIN)/ferry train configs/tiny.yaml

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) runs data .pytest_cache

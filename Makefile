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

# The held-out set: the standard-library text after the 6 MB the demo trains on, in its tokenizer.
demo: $(STAMP)
	$(BIN)/ferry data prepare --embedded stdlib --output data/stdlib
	$(BIN)/ferry data prepare --embedded stdlib --skip-bytes 6000000 --max-bytes 400000 \
		--tokenizer data/stdlib/tokenizer.json --output data/stdlib-held-out
	$(BIN)/ferry train configs/tiny.yaml 'eval.sources=[{name: held_out, path: data/stdlib-held-out}]' eval.interval=100

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) runs data .pytest_cache

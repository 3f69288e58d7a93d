# Two entry points: `make demo` trains the tiny MoE on the embedded corpus,
# `make test` runs the whole suite. Both set up .venv on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch that lies on disk on the development machines; pinned
# first so that the package's `torch>=2.11` does not pull a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo pipeline test check setup clean

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

# The stage chain of configs/pipelines/tiny.yaml. Its datasets share one tokenizer: the demo's BPE plus the
# chat tokens, which the conversation set (prepared first) adds. The largest-digit task gives SFT a warm-start
# set, DPO its preference pairs and GRPO its prompts (and held-out pairs and prompts for their evaluation).
PIPELINE_DATA := data/pipeline
pipeline: $(STAMP)
	$(BIN)/ferry data prepare --embedded stdlib --output data/stdlib
	$(BIN)/ferry data prepare --chat --embedded stdlib-chat --max-bytes 1200000 --seq-len 512 \
		--tokenizer data/stdlib/tokenizer.json --output $(PIPELINE_DATA)/chat
	$(BIN)/ferry data prepare --chat --embedded stdlib-chat --skip-bytes 1200000 --max-bytes 200000 --seq-len 512 \
		--tokenizer data/stdlib/tokenizer.json --output $(PIPELINE_DATA)/chat-held-out
	$(BIN)/ferry data prepare --chat --embedded stdlib-chat --max-bytes 1200000 --seq-len 128 \
		--tokenizer data/stdlib/tokenizer.json --output $(PIPELINE_DATA)/chat-128
	$(BIN)/ferry data prepare --embedded stdlib --tokenizer $(PIPELINE_DATA)/chat/tokenizer.json \
		--output $(PIPELINE_DATA)/text
	$(BIN)/ferry data prepare --embedded stdlib --skip-bytes 6000000 --max-bytes 400000 \
		--tokenizer $(PIPELINE_DATA)/chat/tokenizer.json --output $(PIPELINE_DATA)/text-held-out
	$(BIN)/ferry data prepare --chat --embedded largest --seq-len 512 \
		--tokenizer $(PIPELINE_DATA)/chat/tokenizer.json --output $(PIPELINE_DATA)/largest-chat
	$(BIN)/ferry data prepare --preferences --embedded largest --tokenizer $(PIPELINE_DATA)/chat/tokenizer.json \
		--output $(PIPELINE_DATA)/largest-pairs
	$(BIN)/ferry data prepare --preferences --embedded largest-held-out \
		--tokenizer $(PIPELINE_DATA)/chat/tokenizer.json --output $(PIPELINE_DATA)/largest-pairs-held-out
	$(BIN)/ferry data prepare --prompts --embedded largest --tokenizer $(PIPELINE_DATA)/chat/tokenizer.json \
		--output $(PIPELINE_DATA)/largest-prompts
	$(BIN)/ferry data prepare --prompts --embedded largest-held-out \
		--tokenizer $(PIPELINE_DATA)/chat/tokenizer.json --output $(PIPELINE_DATA)/largest-prompts-held-out
	$(BIN)/ferry pipeline run configs/pipelines/tiny.yaml --dir runs/pipeline

test: $(STAMP)
	$(BIN)/python -m pytest -q

# The formatter, the linter and the type checker, as CI runs them before the suite (their settings: pyproject.toml).
check: $(STAMP)
	$(BIN)/ruff format --check ferry tests benchmarks
	$(BIN)/ruff check ferry tests benchmarks
	$(BIN)/mypy ferry

clean:
	rm -rf $(VENV) runs data .pytest_cache .mypy_cache .ruff_cache

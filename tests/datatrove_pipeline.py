"""The test pipeline of `tests/test_datatrove.py`, run as a process of its own, as a user runs a datatrove script:
datatrove's executors import Ray when it is installed, which puts Ray's own copies of libraries first on the
importing process's path; the test process stays clear of that.

    python tests/datatrove_pipeline.py CORPUS WORK OUTPUT TOKENIZER

Reads CORPUS's JSON lines (plain and gzip) with datatrove's `JsonlReader`, keeps the documents `keeps` keeps,
tokenises them in 2 tasks with `TokenPartsWriter` (shards of 700 tokens) and joins them into OUTPUT."""

import sys
from pathlib import Path

from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.filters import LambdaFilter
from datatrove.pipeline.readers import JsonlReader

from ferry.data.datatrove_step import DatasetJoiner, TokenPartsWriter


def keeps(text: str) -> bool:
    return "expert" in text


def _keeps_document(document) -> bool:
    return keeps(document.text)


def run(corpus: Path, work: Path, output: Path, tokenizer: str) -> None:
    tokenising = LocalPipelineExecutor(
        [
            JsonlReader(str(corpus), glob_pattern="*.jsonl*"),
            LambdaFilter(_keeps_document),
            TokenPartsWriter(work / "parts", tokenizer=tokenizer, shard_tokens=700),
        ],
        tasks=2,
        workers=2,
        logging_dir=str(work / "logs-tokenise"),
    )
    LocalPipelineExecutor(
        [DatasetJoiner(work / "parts", output)],
        tasks=1,
        logging_dir=str(work / "logs-join"),
        depends=tokenising,
    ).run()


if __name__ == "__main__":
    run(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4])

"""Throughput of `ferry data prepare` with 1 and N workers against Hugging Face `tokenizers` in one process.

    python benchmarks/data_prepare.py [--mb 300] [--files 24] [--workers 2] [--zstd] [--dir DIR]

The corpus is generated here, deterministically: paragraphs of the embedded corpus (the standard
library's documentation and sources) drawn by a seeded generator into documents of 1-12 paragraphs
under a numbered heading, written as `--files` JSON-lines files (`{"text": ...}`) of `--mb` MB in all; with
`--zstd`, each file compressed as independent zstd frames of 4 MiB of lines each (as `pzstd` writes them).
`--files 1` measures one large file shared among the workers (`ferry.data.splitting`: ranges of whole lines,
or of whole frames).
A byte-level BPE tokenizer (8,192 tokens) is trained once on the first 4 MB of it and saved; every run
below tokenises with that file.

    anchor       the tokenizer through `tokenizers`' own `Tokenizer.encode_batch` (batches of 1,024
                 documents, its thread pool on every core) in one process, reading the same JSON
                 lines: no shards, no digests, nothing written
    in-process   `ferry data prepare` without --workers (the prepare process encodes, on tokenizers'
                 threads)
    workers=1..N `ferry data prepare --workers k`: k spawned processes, one core each

Each prepare writes the whole dataset (shards, sha256 and xxh3 digests, manifest). The scaling
ratio is (workers=N MB/s) / (workers=1 MB/s); the datasets of every worker count are checked to be
identical. MB are 10^6 bytes of the JSON-lines files. The 1-minute load average is printed before
and after, and beside each figure the cores it ran on on average (CPU seconds of the process and its
workers over the wall time): a machine shared with other work lowers the ratio, and where the kernel
shares the CPU fairly between sessions (Linux's autogroup), two workers get no more than this session's
share while another session is busy. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import zstandard

from ferry.data import PrepareSpec, prepare_dataset
from ferry.data.corpus import embedded_documents
from ferry.data.splitting import zstd_frames
from ferry.data.tokenizer import BPETokenizer

_VOCAB = 8192


def generate_corpus(directory: Path, total_mb: int, files: int, seed: int = 0) -> int:
    """Write the corpus; its size in bytes."""
    paragraphs = [
        paragraph
        for document in embedded_documents("stdlib", max_bytes=12_000_000)
        for paragraph in document.text.split("\n\n")
        if len(paragraph) > 40
    ]
    rng = np.random.default_rng(seed)
    per_file = total_mb * 1_000_000 // files
    directory.mkdir(parents=True)
    total = 0
    for index in range(files):
        with open(directory / f"corpus-{index:03d}.jsonl", "w", encoding="utf-8") as out:
            written = 0
            while written < per_file:
                chosen = rng.integers(0, len(paragraphs), size=int(rng.integers(1, 13)))
                text = f"Section {int(rng.integers(0, 1_000_000))}\n\n" + "\n\n".join(paragraphs[i] for i in chosen)
                line = json.dumps({"text": text}, ensure_ascii=False) + "\n"
                written += len(line.encode("utf-8"))
                out.write(line)
        total += written
    return total


def compress_frames(path: Path, frame_bytes: int = 4 << 20) -> Path:
    """`path` rewritten as `path.zst` of independent frames of whole lines, about `frame_bytes` of text each."""
    compressor = zstandard.ZstdCompressor(level=3)
    target = path.with_name(path.name + ".zst")
    with open(path, "rb") as source, open(target, "wb") as out:
        while lines := source.readlines(frame_bytes):
            out.write(compressor.compress(b"".join(lines)))
    path.unlink()
    return target


def text_bytes(path: Path) -> int:
    """The bytes of JSON lines a corpus file holds: its size, or its frames' content sizes for zstd."""
    if path.suffix != ".zst":
        return path.stat().st_size
    return sum(content for _, content in zstd_frames(path))


def open_lines(path: Path):
    """A text reader of a JSON-lines file, plain or zstd of several frames."""
    if path.suffix != ".zst":
        return open(path, encoding="utf-8")
    reader = zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), read_across_frames=True, closefd=True)
    return io.TextIOWrapper(reader, encoding="utf-8")


def train_tokenizer(corpus: Path, path: Path) -> None:
    first = sorted(corpus.iterdir())[0]
    texts, size = [], 0
    with open_lines(first) as handle:
        for line in handle:
            texts.append(json.loads(line)["text"])
            size += len(line)
            if size > 4_000_000:
                break
    path.write_text(BPETokenizer.train(texts, _VOCAB).to_json(), encoding="utf-8")


def anchor(corpus: Path, tokenizer_path: Path) -> tuple[float, int]:
    """Seconds and tokens of `tokenizers` alone: read, parse, encode_batch; nothing written."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    tokenizer.encode_special_tokens = True  # as ferry encodes: text spelling a special token stays text
    tokens = 0
    start = time.perf_counter()
    for path in sorted(corpus.iterdir()):
        with open_lines(path) as handle:
            batch = []
            for line in handle:
                batch.append(json.loads(line)["text"])
                if len(batch) == 1024:
                    tokens += sum(len(encoding.ids) for encoding in tokenizer.encode_batch(batch))
                    batch = []
            tokens += sum(len(encoding.ids) for encoding in tokenizer.encode_batch(batch))
    return time.perf_counter() - start, tokens


def prepare(corpus: Path, tokenizer_path: Path, output: Path, workers: int | None) -> tuple[float, dict]:
    spec = PrepareSpec(inputs=[str(corpus)], tokenizer=str(tokenizer_path))
    start = time.perf_counter()
    result = prepare_dataset(spec, output, workers=workers)
    return time.perf_counter() - start, result.manifest


def cpu_seconds() -> float:
    """CPU time of this process (every thread) and of the worker processes it has had: those are forked by
    multiprocessing's forkserver, a child of this process that reaps them (its children's time in procfs)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    total = usage.ru_utime + usage.ru_stime
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == os.getpid() and b"forkserver" in (stat.parent / "cmdline").read_bytes():
                total += sum(int(value) for value in fields[11:15]) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            continue  # a process that ended while it was read
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=300, help="corpus size in MB (10^6 bytes)")
    parser.add_argument("--files", type=int, default=24, help="JSON-lines files the corpus is written as")
    parser.add_argument("--workers", type=int, default=2, help="the most workers measured")
    parser.add_argument("--zstd", action="store_true", help="write the files as zstd of several frames")
    parser.add_argument("--dir", default=None, help="work directory (default: a temporary one, removed)")
    args = parser.parse_args()
    work = Path(args.dir or tempfile.mkdtemp(prefix="ferry-data-prepare-"))
    load_before = os.getloadavg()[0]
    try:
        corpus = work / "corpus"
        if not corpus.is_dir():
            generate_corpus(corpus, args.mb, args.files)
            if args.zstd:
                for path in sorted(corpus.iterdir()):
                    compress_frames(path)
        size = sum(text_bytes(path) for path in corpus.iterdir())
        tokenizer_path = work / "tokenizer.json"
        if not tokenizer_path.is_file():
            train_tokenizer(corpus, tokenizer_path)
        kind = "zstd JSON-lines (several frames)" if args.zstd else "JSON-lines"
        print(
            f"corpus: {size / 1e6:.0f} MB in {args.files} {kind} files, BPE {_VOCAB:,} tokens, "
            f"{os.cpu_count()} cores, load average {load_before:.2f}"
        )
        rows = {}
        cores = {}
        used = cpu_seconds()
        seconds, tokens = anchor(corpus, tokenizer_path)
        rows["anchor"] = (seconds, tokens)
        cores["anchor"], used = (cpu_seconds() - used) / seconds, cpu_seconds()
        runs = [("in-process", None)] + [(f"workers={count}", count) for count in range(1, args.workers + 1)]
        manifests = {}
        for name, workers in runs:
            output = work / f"dataset-{name}"
            shutil.rmtree(output, ignore_errors=True)
            seconds, manifest = prepare(corpus, tokenizer_path, output, workers)
            rows[name] = (seconds, manifest["total_tokens"])
            cores[name], used = (cpu_seconds() - used) / seconds, cpu_seconds()
            manifests[name] = {key: manifest[key] for key in ("shards", "tokenizer", "total_tokens", "source_hashes")}
            shutil.rmtree(output)
        identical = all(manifest == manifests["workers=1"] for manifest in manifests.values())
        for name, (seconds, tokens) in rows.items():
            print(
                f"{name:>12}: {size / 1e6 / seconds:7.2f} MB/s  {tokens / seconds / 1e6:6.2f} M tokens/s  "
                f"({seconds:.1f} s on {cores[name]:.2f} cores)"
            )
        one, most = rows["workers=1"][0], rows[f"workers={args.workers}"][0]
        scaling = one / most
        load_after = os.getloadavg()[0]
        print(
            f"workers={args.workers} vs workers=1: {scaling:.2f}x; workers={args.workers} vs anchor: "
            f"{rows['anchor'][0] / most:.2f}x; datasets identical for every worker count: {identical}; "
            f"load average after {load_after:.2f}"
        )
        result = {
            "corpus_mb": round(size / 1e6, 1),
            "cores": os.cpu_count(),
            **{f"{name}_mb_s": round(size / 1e6 / seconds, 3) for name, (seconds, _) in rows.items()},
            **{f"{name}_tokens_s": round(tokens / seconds) for name, (seconds, tokens) in rows.items()},
            **{f"{name}_cores": round(used, 2) for name, used in cores.items()},
            "scaling": round(scaling, 3),
            "vs_anchor": round(rows["anchor"][0] / most, 3),
            "identical": identical,
            "load_before": round(load_before, 2),
            "load_after": round(load_after, 2),
        }
        print(json.dumps(result))
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Start-up cost of a run over a set of many shards: what `MixedLoader` costs to build, against a whole-set read.

Writes a synthetic set (`write_synthetic_dataset` cut into `--shard-tokens` shards; 10,000 by default) and times,
in one process:

- the whole-set read: every file of the set hashed against its manifest (`verify_files`, what a run did before it
  started, whatever the set's size),
- the loader built as a run builds it (`data.verify_upfront` at its default: a set this large is checked shard by
  shard as each is first read), and its first global batch (the shards it touches checked then),
- the loader built with the whole set checked up front (`data.verify_upfront` above its size: what a small set
  gets), which is the whole-set read plus opening every shard's header.

Each figure is the best of `--repeats` (the files in the page cache after the first), in seconds, with the ratio
to the whole-set read: a ratio, not a time, is what carries from one machine to another.

    python benchmarks/data_startup.py --shards 10000 --shard-tokens 64
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from ferry.data import DataConfig, MixedLoader
from ferry.data.manifest import MANIFEST_NAME
from ferry.data.synthetic import write_synthetic_dataset
from ferry.data.verification import verify_files


def best_of(repeats: int, work) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=10_000)
    parser.add_argument("--shard-tokens", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write the set (default: a temporary directory)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        path = Path(args.dir or scratch) / "set"
        started = time.perf_counter()
        if not (path / MANIFEST_NAME).is_file():
            write_synthetic_dataset(path, 0, 512, args.shards * args.shard_tokens, 1.1, shard_tokens=args.shard_tokens)
        written_s = time.perf_counter() - started
        manifest = json.loads((path / MANIFEST_NAME).read_text())
        size = sum((path / entry["file"]).stat().st_size for entry in manifest["shards"])
        source = {"name": "set", "path": str(path)}
        lazy = DataConfig.model_validate({"sources": [source], "seq_len": args.seq_len})
        upfront = DataConfig.model_validate({"sources": [source], "seq_len": args.seq_len, "verify_upfront": 1 << 50})

        def whole_read() -> None:
            verify_files(path, json.loads((path / MANIFEST_NAME).read_text()), "set", "xxh3_128")

        def first_batch() -> None:
            loader = MixedLoader(lazy, seed=0, global_batch=args.global_batch)
            loader.global_batch_at(loader.new_cursor())

        whole_s = best_of(args.repeats, whole_read)
        lazy_s = best_of(args.repeats, lambda: MixedLoader(lazy, seed=0, global_batch=args.global_batch))
        first_s = best_of(args.repeats, first_batch)
        upfront_s = best_of(args.repeats, lambda: MixedLoader(upfront, seed=0, global_batch=args.global_batch))

    print(
        f"{len(manifest['shards']):,} shards of {args.shard_tokens:,} tokens ({size / 2**20:.1f} MiB), written in "
        f"{written_s:.1f} s; best of {args.repeats}, seconds (ratio to the whole-set read)"
    )
    rows = [
        ("whole-set read (every file hashed)", whole_s),
        ("loader start, checked shard by shard (default)", lazy_s),
        (f"  and its first batch of {args.global_batch} windows", first_s),
        ("loader start, whole set checked up front", upfront_s),
    ]
    for label, seconds in rows:
        print(f"  {label:<48} {seconds:8.3f} s  ({seconds / whole_s:5.2f}x)")


if __name__ == "__main__":
    main()

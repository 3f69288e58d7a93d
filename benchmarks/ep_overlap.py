"""Expert-parallel exchanges in one piece against chunked ones in flight while the experts compute, against the
rowwise exchange, and against FarSkip wiring (the combine in flight during the next block's attention), on CPU ranks.

For each shape and rank count, `ferry train` runs `parallel.ep_overlap: none`, then `chunked` with 2 and 4 parts,
then `parallel.ep_dispatch: rowwise`, then `model.skip: farskip` with one exchange and with 2 parts (a different
model: its step time is comparable, its losses are not), on the same synthetic tokens (`ferry/data/synthetic.py`)
and the same seed; each reports the medians, over the steps after the warm-up, of the step time, the time blocked
in the MoE exchanges (`ep_wait_s`, the exposed part), the time they were in flight (`ep_comm_s`) and the
overlapped share, and its step time against `none`'s (below 1: faster). Whatever the sign: overlap costs a gather
and a scatter of the rows and more, smaller messages, and only pays where an exchange takes long enough to hide
computation behind.

Shapes: `tiny` (the demo's model, `configs/tiny.yaml`) and `mid` (dim 512, 4 layers, 32 experts of width 512,
top-4, sequences of 256). Ranks: 2 and 4 gloo processes, one thread each (on a 2-core machine, 4 ranks share
the cores: their figures say what the exchange costs when ranks contend, not what 4 machines would do).

    python benchmarks/ep_overlap.py [--shapes tiny,mid] [--ranks 2,4] [--steps 12] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ferry_runs import train_records  # noqa: E402

from ferry.data.synthetic import write_synthetic_dataset  # noqa: E402

WARMUP_STEPS = 4
SHAPES = {
    "tiny": {"vocab": 4096, "seq_len": 128, "global_batch": 16, "overrides": []},
    "mid": {
        "vocab": 4096,
        "seq_len": 256,
        "global_batch": 16,
        "overrides": [
            "model.dim=512",
            "model.n_layers=4",
            "model.n_heads=8",
            "model.n_kv_heads=8",
            "model.dense_layers=0",
            "model.moe.num_experts=32",
            "model.moe.top_k=4",
            "model.moe.expert_ffn_dim=512",
            "model.max_seq_len=256",
        ],
    },
}
MODES = {
    "none": ["parallel.ep_overlap=none"],
    "chunked2": ["parallel.ep_overlap=chunked", "parallel.ep_chunks=2"],
    "chunked4": ["parallel.ep_overlap=chunked", "parallel.ep_chunks=4"],
    "rowwise": ["parallel.ep_dispatch=rowwise"],
    "farskip": ["model.skip=farskip"],
    "farskip-chunked2": ["model.skip=farskip", "parallel.ep_overlap=chunked", "parallel.ep_chunks=2"],
}


def run(shape: str, ranks: int, mode: str, steps: int, data: Path, root: Path) -> dict:
    spec = SHAPES[shape]
    run_dir = root / f"{shape}-{ranks}-{mode}"
    command = [
        sys.executable,
        "-m",
        "ferry",
        "train",
        str(REPO / "configs" / "tiny.yaml"),
        "--nproc",
        str(ranks),
        f"data.sources=[{{name: synthetic, path: {data}}}]",
        f"data.seq_len={spec['seq_len']}",
        f"model.vocab_size={spec['vocab']}",
        f"train.global_batch={spec['global_batch']}",
        f"train.micro_batch={spec['global_batch'] // ranks}",
        f"train.steps={steps}",
        "train.log_every=1000",
        f"parallel.ep={ranks}",
        "checkpoint.enabled=false",
        "metrics.sinks.prometheus.enabled=false",
        f"run.dir={run_dir}",
        *spec["overrides"],
        *MODES[mode],
    ]
    records = train_records(command, run_dir, WARMUP_STEPS, REPO)
    if isinstance(records, str):
        return {"failed": records}

    def median(key: str) -> float:
        return statistics.median(record[key] or 0.0 for record in records)

    return {key: median(key) for key in ("step_s", "ep_wait_s", "ep_comm_s", "ep_overlap_share", "tokens_per_s")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="tiny,mid")
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="ferry-ep-overlap-") as root:
        data = Path(root) / "data"
        tokens = args.steps * max(spec["global_batch"] * spec["seq_len"] for spec in SHAPES.values()) + 1
        write_synthetic_dataset(data, 20261204, max(spec["vocab"] for spec in SHAPES.values()), tokens, 1.1)
        for shape in args.shapes.split(","):
            for ranks in (int(r) for r in args.ranks.split(",")):
                figures = {mode: run(shape, ranks, mode, args.steps, data, Path(root)) for mode in MODES}
                base = figures["none"].get("step_s")
                for figure in figures.values():
                    if "failed" not in figure and base:
                        figure["step_vs_none"] = figure["step_s"] / base
                results[f"{shape}/{ranks}"] = figures
                if not args.json:
                    print(f"{shape}, {ranks} ranks")
                    for mode, figure in figures.items():
                        if "failed" in figure:
                            print(f"  {mode:<16} FAILED: {figure['failed']}")
                            continue
                        print(
                            f"  {mode:<16} step {1000 * figure['step_s']:7.1f} ms "
                            f"({figure['step_vs_none']:.2f}x none)  "
                            f"EP in flight {1000 * figure['ep_comm_s']:6.1f} ms, "
                            f"exposed {1000 * figure['ep_wait_s']:6.1f} ms, overlapped {figure['ep_overlap_share']:.0%}"
                        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()

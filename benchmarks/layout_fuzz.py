"""Draw layout combinations and check each against the same computation on one process.

    python benchmarks/layout_fuzz.py [--budget 60m | --count N] [--seed S] [--report DIR] [--dir DIR]
    python benchmarks/layout_fuzz.py --only "world=2 parallel=ep-zero recompute=full"

Each combination is refused by `ferry train`'s own checks (naming the setting), or trained for a few steps on
`world` local ranks and compared step by step with its one-process oracle, then resumed from its checkpoint in
another drawn layout and compared again (`ferry/portability/fuzz/`). Every outcome is a JSON line in
REPORT/outcomes.jsonl (default runs/layout-fuzz); the summary (counts, refusal messages, the commands that
reproduce each failure) is printed and written to REPORT/summary.txt. The runs themselves go to a scratch
directory under --dir, removed at the end unless a combination diverged or crashed: then it is kept, with the
base config, datasets and parents its commands name. Draws are a function of (seed, index): a failure replays
from them or from its `--only` line.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from scratch import DIR_HELP, scratch_dir

from ferry.portability.fuzz.data import prepare_fuzz_data
from ferry.portability.fuzz.report import append, summary
from ferry.portability.fuzz.runner import Fuzzer
from ferry.portability.fuzz.space import draw, named


def budget_seconds(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600}
    return float(text[:-1]) * units[text[-1]] if text[-1] in units else float(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default=None, help="stop drawing after this long: 90s, 60m, 1h")
    parser.add_argument("--count", type=int, default=None, help="draw this many combinations")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default=None, help="one combination, as a report names it (axis=value ...)")
    parser.add_argument("--report", default="runs/layout-fuzz", help="where outcomes.jsonl and summary.txt go")
    parser.add_argument("--dir", default=None, help=DIR_HELP)
    args = parser.parse_args()
    report = Path(args.report)
    report.mkdir(parents=True, exist_ok=True)
    (report / "outcomes.jsonl").write_text("")
    outcomes = []

    def failed() -> bool:
        """Whether a combination diverged or crashed: its commands need the scratch directory kept."""
        return any(outcome.verdict in ("diverged", "crashed") for outcome in outcomes)

    with scratch_dir(args.dir, "layout-fuzz-", keep=failed) as work:
        fuzzer = Fuzzer(work, prepare_fuzz_data(work))
        began = time.perf_counter()
        deadline = began + budget_seconds(args.budget) if args.budget else None
        index = 0
        while True:
            if args.only:
                combination = named(args.only)
            elif (args.count is not None and index >= args.count) or (deadline and time.perf_counter() > deadline):
                break
            else:
                combination = draw(args.seed, index)
            outcome = fuzzer.judge(combination, draw(args.seed + 1, index))
            append(report / "outcomes.jsonl", outcome)
            outcomes.append(outcome)
            print(f"{index:>4} {outcome.verdict:<8} {combination.describe()}", flush=True)
            index += 1
            if args.only:
                break
        text = summary(outcomes, time.perf_counter() - began, args.seed)
        if failed():
            text += f"\nthe runs, datasets and parents the commands above name are kept in {work}"
        (report / "summary.txt").write_text(text + "\n")
        print(text)


if __name__ == "__main__":
    main()

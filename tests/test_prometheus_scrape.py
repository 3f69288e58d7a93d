"""A real Prometheus (Debian's package, which `.ci/run` installs) scrapes a running ferry job's exporter, and every
query of the Grafana dashboard returns data from it: one run per family of rows (next-token training with the
opt-in figures, a pipeline, context parallelism, DPO, GRPO), each held up by its last step until Prometheus has
scraped it (`train_holding_exporter`). `promtool check metrics` accepts what the exporter serves."""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from distributed_training import train_holding_exporter, train_run
from prometheus_binaries import binary
from test_dashboard import substituted

from ferry.comm.spawn import free_port, run_on_ranks
from ferry.data import PrepareSpec, prepare_dataset
from ferry.metrics.dashboard import expression
from ferry.metrics.dashboard_panels import ROWS

SCRAPE_INTERVAL = "250ms"
# what a run of a family leaves empty on its rows, and why (each is asserted empty, so the list stays true)
LEFT_EMPTY = {"ferry_tracker_failures": "reported only by runs with metrics.trackers, which need a tracker's service"}


def wait_for(condition, what: str, deadline_s: float = 90.0):
    """Poll `condition` until it returns something true (a guard against a hang, not a measurement)."""
    waited = 0.0
    while not (value := condition()):
        if waited > deadline_s:
            raise TimeoutError(f"{what} did not happen within {deadline_s:.0f} s")
        time.sleep(0.1)
        waited += 0.1
    return value


class Prometheus:
    """A Prometheus server on loopback, in its own directory, scraping `127.0.0.1:exporter_port` as job `ferry`."""

    def __init__(self, root: Path):
        self.exporter_port, self.port = free_port(), free_port()
        config = root / "prometheus.yml"
        config.write_text(
            json.dumps(
                {
                    "global": {"scrape_interval": SCRAPE_INTERVAL, "scrape_timeout": SCRAPE_INTERVAL},
                    "scrape_configs": [
                        {"job_name": "ferry", "static_configs": [{"targets": [f"127.0.0.1:{self.exporter_port}"]}]}
                    ],
                }
            )
        )
        self.log = (root / "prometheus.log").open("w")
        self.process = subprocess.Popen(
            [
                binary("prometheus"),
                f"--config.file={config}",
                f"--storage.tsdb.path={root / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        wait_for(self._ready, "prometheus ready")

    def _ready(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"prometheus exited with {self.process.returncode}; see {self.log.name}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def query(self, promql: str) -> list[dict]:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=10) as response:
            answer = json.loads(response.read())
        assert answer["status"] == "success", answer
        return answer["data"]["result"]

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)
        self.log.close()


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    server = Prometheus(tmp_path_factory.mktemp("prometheus"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def records(tmp_path_factory, stdlib_dataset) -> dict[str, Path]:
    """The largest-digit task as chat turns (the parent's data), preference pairs and prompts, with held-out
    pairs and prompts, in the test tokenizer with the chat tokens."""
    root = tmp_path_factory.mktemp("task")
    views = {
        "chat": {"chat": True, "seq_len": 64},
        "pairs": {"records": "preferences"},
        "prompts": {"records": "prompts"},
    }
    for name, flags in [*views.items(), ("pairs-held-out", views["pairs"]), ("prompts-held-out", views["prompts"])]:
        split = "largest-held-out" if name.endswith("held-out") else "largest"
        spec = PrepareSpec(
            embedded=split, tokenizer=str(stdlib_dataset / "tokenizer.json"), embedded_max_bytes=20_000, **flags
        )
        prepare_dataset(spec, root / name)
    return {name: root / name for name in [*views, "pairs-held-out", "prompts-held-out"]}


def family_run(family: str, stdlib_dataset: Path, records: dict[str, Path], tmp_path: Path) -> tuple[int, list[str]]:
    """The ranks and overrides of a run whose records fill the rows of `family`."""
    if family == "lm":
        held_out = f"eval.sources=[{{name: held_out, path: {stdlib_dataset}}}]"
        return 2, [
            "parallel.ep=2",
            held_out,
            "eval.interval=1",
            "eval.batches=1",
            "model.mtp.depth=1",
            "optim.name=muon",
        ] + [
            "optim.muon.qk_clip=5",
            "metrics.attn_max_logit=true",
        ]
    if family == "pipeline":
        return 2, ["parallel.pp=2", "train.micro_batch=2"]
    if family == "context":
        return 2, ["parallel.cp=2"]
    chat = ["model.vocab_size=576", "data.seq_len=64"]
    parent = tmp_path / "parent"
    run_on_ranks(train_run, 1, str(records["chat"]), str(parent), *chat, "train.steps=1")
    data, held_out = ("pairs", "pairs-held-out") if family == "dpo" else ("prompts", "prompts-held-out")
    return 1, [
        *chat,
        f"train.objective={family}",
        f"init_from={parent / 'checkpoints'}",
        f"data.sources=[{{name: {data}, path: {records[data]}}}]",
        f"eval.sources=[{{name: held_out, path: {records[held_out]}}}]",
        "eval.interval=1",
        "eval.batches=1",
    ]


@pytest.mark.parametrize("family", ["lm", "pipeline", "context", "dpo", "grpo"])
def test_every_dashboard_query_returns_data_from_a_scraped_run(prometheus, stdlib_dataset, records, tmp_path, family):
    ranks, overrides = family_run(family, stdlib_dataset, records, tmp_path)
    exporter = ["metrics.sinks.prometheus.enabled=true", f"metrics.sinks.prometheus.port={prometheus.exporter_port}"]
    gate = tmp_path / "gate"
    gate.mkdir()
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["ranks"] = run_on_ranks(
                train_holding_exporter,
                ranks,
                str(stdlib_dataset),
                str(tmp_path / "run"),
                str(gate),
                "train.steps=3",
                *exporter,
                *overrides,
            )
        except BaseException as error:  # surfaced below, in the test's thread
            outcome["error"] = error

    trainer = threading.Thread(target=run)
    trainer.start()
    try:
        wait_for(lambda: (gate / "served").exists() or "error" in outcome, f"the {family} run's last step", 300)
        assert "error" not in outcome, outcome.get("error")
        scraped = lambda: prometheus.query('ferry_step{job="ferry", run="test"} == 3')  # noqa: E731
        wait_for(scraped, "a scrape of the last step")
        assert prometheus.query('up{job="ferry"} == 1')
        # the heatmap's layer, as Grafana offers it (none where no step routed a token: a GRPO step whose groups all
        # had equal rewards trains nothing; the GRPO rows do not ask for it)
        layers = prometheus.query('group by (layer) (ferry_moe_expert_tokens{job="ferry"})')
        layer = layers[0]["metric"]["layer"] if layers else "none"
        with urllib.request.urlopen(f"http://127.0.0.1:{prometheus.exporter_port}/metrics", timeout=10) as served:
            exposition = served.read()
        wrong = []
        for row in (row for row in ROWS if row.family == family):
            for panel in row.panels:
                for query in panel.queries:
                    promql = substituted(expression(query), layer)
                    if bool(prometheus.query(promql)) == (query.metric in LEFT_EMPTY):
                        wrong.append(f"{panel.title!r}: {promql}")
        assert not wrong, f"{family} run: without data, or listed as left empty and with data: {wrong}"
    finally:
        (gate / "release").touch()
        trainer.join(timeout=300)
    assert "error" not in outcome, outcome.get("error")
    checked = subprocess.run([binary("promtool"), "check", "metrics"], input=exposition, capture_output=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr

"""Surviving failures: supervised restarts, hang detection, faults injected on purpose, Young/Daly, goodput."""

from __future__ import annotations

import json
import math
import shutil
import time

import pytest
import torch
import yaml
from conftest import REPO, TINY_RUN

from ferry.checkpoint import list_checkpoints
from ferry.cli.main import main
from ferry.train import Trainer
from ferry.train.resilience import core as resilience_module
from ferry.train.resilience.config import FaultConfig
from ferry.train.resilience.core import Resilience, restarted_by_torchrun
from ferry.train.resilience.restarts import (
    CAUSES_DIR,
    EVENTS_NAME,
    append_event,
    goodput,
    read_events,
    restarts,
    settle_run_record,
    write_cause,
)
from ferry.train.resilience.watchdog import Watchdog
from ferry.train.resilience.young_daly import AutoInterval, daly_interval_s, young_interval_s


def test_young_and_daly_intervals_match_hand_calculations():
    # C = 60 s, M = 3 h: sqrt(2 * 60 * 10800) = 1138.4 s; Daly: 1138.4 * (1 + sqrt(1/360)/3 + 1/3240) - 60
    assert young_interval_s(60, 3 * 3600) == pytest.approx(1138.42, abs=0.01)
    assert daly_interval_s(60, 3 * 3600) == pytest.approx(1098.77, abs=0.01)
    assert daly_interval_s(60, 3 * 3600) == pytest.approx(
        math.sqrt(2 * 60 * 10800) * (1 + math.sqrt(60 / 21600) / 3 + (60 / 21600) / 9) - 60
    )
    assert daly_interval_s(7200, 3000) == 3000  # a save longer than 2M: checkpoint once per MTBF


def test_the_auto_interval_saves_first_at_its_first_step_then_every_daly_interval_in_steps():
    auto = AutoInterval(job_mtbf_s=3 * 3600, first_step=10)
    assert not auto.due(9, None) and auto.due(10, None)
    assert not auto.due(12, 3) and auto.due(13, 3), "resumed at step 3: the first save comes 10 steps later"
    for _ in range(10):
        auto.observe_step(2.0)
    auto.observe_save(60.0, auto.median_step_s())
    assert auto.interval_s == pytest.approx(1098.77, abs=0.01) and auto.interval_steps == 549
    assert not auto.due(10 + 548, 10) and auto.due(10 + 549, 10)


def test_the_watchdog_timeout_follows_the_median_step_with_a_floor_and_allowances():
    config = FaultConfig(hang_multiple=10, hang_floor_s=5, hang_first_step_s=100, hang_checkpoint_s=50)
    watchdog = Watchdog(config, rank=0, on_hang=lambda phase, message, waiting: None)
    assert watchdog.timeout_s() == 105  # floor + first step
    watchdog.beat(1, 1.5)
    assert watchdog.timeout_s() == 15, "during the warm-up: 10 x the slowest step so far, above the floor"
    for step in range(2, 10):
        watchdog.beat(step, 2.0)
    assert watchdog.timeout_s() == 20  # 10 x median 2.0 s after the warm-up steps
    watchdog.phase("checkpoint save")
    assert watchdog.timeout_s() == 70
    assert Watchdog(FaultConfig(hang_timeout_s=3, hang_first_step_s=0), 0, print).timeout_s() == 3


def test_a_long_save_restarts_the_watchdogs_clock(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("ferry.train.resilience.watchdog.time.monotonic", lambda: clock[0])
    watchdog = Watchdog(FaultConfig(hang_timeout_s=2, hang_first_step_s=0, hang_checkpoint_s=100), 0, print)
    watchdog.start(0)
    watchdog.stop()
    watchdog.beat(1, 0.5)
    watchdog.phase("checkpoint save")
    clock[0] += 30  # a 30 s save: within the checkpoint allowance
    assert watchdog.overdue() is None
    watchdog.touch()
    watchdog.phase("between steps")
    clock[0] += 1.5
    assert watchdog.overdue() is None, "the save's time is not charged to the next step"
    clock[0] += 1.0
    assert "stuck in between steps of step 2" in watchdog.overdue()


def test_two_faults_at_one_step_fire_one_per_attempt(tmp_path):
    from ferry.train.resilience.config import FaultSpec
    from ferry.train.resilience.faults import FaultInjector, InjectedFault

    specs = [FaultSpec(step=5, kind="raise"), FaultSpec(step=5, kind="raise")]
    for attempt in range(2):
        with pytest.raises(InjectedFault, match=f"injected fault {attempt} "):
            FaultInjector(specs, 0, 1, tmp_path).at_step_start(5, on_hang=lambda: None)
    FaultInjector(specs, 0, 1, tmp_path).at_step_start(5, on_hang=lambda: None)  # both spent


@pytest.fixture
def config_file(stdlib_dataset, tmp_path):
    raw = json.loads(json.dumps(TINY_RUN))
    raw["data"]["sources"] = [{"name": "stdlib", "path": str(stdlib_dataset)}]
    raw["train"].update(steps=12, log_every=4)
    raw["checkpoint"] = {"interval": 2, "keep": 10}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def _losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_ranks_survive_a_kill_and_a_hang_with_losses_bitwise_equal(config_file, tmp_path):
    """Saves in the foreground, so that the step-2 and step-6 checkpoints are published before the faults strike
    whatever the load (a background writer still busy at the kill would leave nothing to resume from: that case is
    `test_a_kill_while_the_background_writers_run_...`'s)."""
    common = [config_file, "--nproc", "2", "parallel.ep=2", "checkpoint.async_save=false"]
    assert main(["train", *common, f"run.dir={tmp_path / 'straight'}"]) == 0
    faults = "fault.inject=[{step: 4, rank: 1, kind: kill}, {step: 8, rank: 0, kind: hang}]"
    drilled = tmp_path / "drilled"
    code = main(
        [
            "train",
            *common,
            "--max-restarts",
            "3",
            f"run.dir={drilled}",
            faults,
            "fault.hang_timeout_s=3",
            "fault.hang_first_step_s=30",
        ]
    )
    assert code == 0
    assert _losses(drilled) == _losses(tmp_path / "straight")
    record = json.loads((drilled / "run.json").read_text())
    first, second = record["restarts"]
    assert "rank 1 was killed (SIGKILL)" in first["cause"] and first["failed_at_step"] == 3
    assert (first["resumed_from_step"], first["steps_lost"]) == (2, 1) and first["restart_latency_s"] > 0
    assert "hang" in second["cause"] and "a hang (injected fault)" in second["cause"]
    assert second["cause"].startswith("rank 0 at step 8"), second["cause"]  # not rank 1, which waited for it
    assert second["resumed_from_step"] == 6
    good = record["goodput"]
    assert good["restarts"] == 2 and good["lost_steps"] == 2 and 0 < good["goodput"] < 1
    assert good["restarting_s"] > 0 and good["saving_s"] > 0


@pytest.mark.parametrize("killed", [[1], [0, 1]], ids=["one-rank", "all-ranks"])
def test_a_kill_while_the_background_writers_run_restarts_from_the_newest_complete_checkpoint(
    config_file, tmp_path, killed
):
    """Two ranks save in the background (`async_save: auto`); SIGKILL strikes from the writer thread of one rank,
    or of every rank, once its files are written: nothing of step 4 is published, the restart removes the
    unfinished save, resumes from step 2 and ends where the uninterrupted run does."""
    common = [config_file, "--nproc", "2", "parallel.ep=2", "optim.zero=true", "train.steps=8"]
    assert main(["train", *common, f"run.dir={tmp_path / 'straight'}"]) == 0
    faults = ", ".join(f"{{step: 4, rank: {rank}, kind: kill_during_save}}" for rank in killed)
    drilled = tmp_path / "drilled"
    assert main(["train", *common, "--max-restarts", "2", f"run.dir={drilled}", f"fault.inject=[{faults}]"]) == 0
    assert _losses(drilled) == _losses(tmp_path / "straight")
    record = json.loads((drilled / "run.json").read_text())
    assert record["checkpoint_async"]["on"] is True
    (restart,) = record["restarts"]
    assert restart["resumed_from_step"] == 2
    assert restart["removed_unfinished_saves"] == [str(drilled / "checkpoints" / ".step-00000004.partial")]
    final, expected = _final_tensors(drilled), _final_tensors(tmp_path / "straight")
    assert final.keys() == expected.keys() and all(torch.equal(final[key], expected[key]) for key in expected)


def _final_tensors(run_dir) -> dict:
    """Every tensor of the run's last checkpoint, by file and name."""
    from safetensors.torch import load_file

    final = list_checkpoints(run_dir / "checkpoints")[-1]
    return {
        (path.name, name): tensor
        for path in sorted(final.glob("*.safetensors"))
        for name, tensor in load_file(path).items()
    }


def test_a_kill_during_a_save_and_a_corrupt_checkpoint_fall_back_to_the_previous_valid_one(config_file, tmp_path):
    assert main(["train", config_file, f"run.dir={tmp_path / 'straight'}"]) == 0
    faults = (
        "fault.inject=[{step: 4, kind: kill_during_save}, {step: 6, kind: corrupt_checkpoint}, {step: 7, kind: raise}]"
    )
    drilled = tmp_path / "drilled"
    assert main(["train", config_file, "--max-restarts", "2", f"run.dir={drilled}", faults]) == 0
    assert _losses(drilled) == _losses(tmp_path / "straight")
    first, second = json.loads((drilled / "run.json").read_text())["restarts"]
    assert first["resumed_from_step"] == 2
    assert first["removed_unfinished_saves"] == [str(drilled / "checkpoints" / ".step-00000004.partial")]
    assert second["resumed_from_step"] == 4, "the damaged step-6 checkpoint must not be loaded"
    assert second["skipped_checkpoints"] == [str(drilled / "checkpoints" / "step-00000006")]


def test_a_deterministic_crash_stops_after_the_no_progress_budget(config_file, tmp_path, capsys):
    run_dir = tmp_path / "run"
    fault = "fault.inject=[{step: 5, kind: raise, once: false}]"
    code = main(["train", config_file, "--max-restarts", "10", f"run.dir={run_dir}", fault])
    err = capsys.readouterr().err
    assert code == 1
    assert "giving up: 3 attempt(s) in a row trained no step beyond step 4" in err
    # the first failure followed progress; two restarts without progress spend the budget of 2; not ten restarts
    assert sum(1 for event in read_events(run_dir) if event["event"] == "failure") == 4
    # run.json has the last word of the supervisor, not the last attempt's (which could not know of its failure)
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "failed" and "3 attempt(s) in a row trained no step beyond step 4" in record["gave_up"]
    # four failures listed, three of them restarted: the supervisor gave up on the fourth
    assert len(record["restarts"]) == 4 and record["goodput"]["restarts"] == 3
    assert all("injected fault 0 (raise) at step 5" in row["cause"] for row in record["restarts"])
    # every restart resumed from step 4, though none of them trained a step; the last failure had no restart
    assert [row["resumed_from_step"] for row in record["restarts"]] == [4, 4, 4, None]
    assert [row["steps_lost"] for row in record["restarts"]] == [0, 0, 0, None]
    assert all(row["restart_latency_s"] > 0 for row in record["restarts"][:3])
    assert record["goodput"]["loading_s"] > 0 and record["goodput"]["restarting_s"] > 0
    assert not list((run_dir / CAUSES_DIR).glob("*.json"))


def test_a_supervisor_that_gives_up_after_a_sigkill_completes_the_run_record(tmp_path, monkeypatch, capsys):
    """The last attempt was killed outright: its run.json still says `running`, with no restarts."""
    from ferry.launch import supervisor
    from ferry.launch.local import Outcome

    run_dir = tmp_path / "run"
    attempts = []

    def killed_at_step_3(nproc, argv):
        now = time.time()
        if not attempts:
            run_dir.mkdir()
            append_event(run_dir, {"event": "start", "at_unix": now, "step": 0, "loading_s": 0.0})
        else:  # what a restarted attempt's rank 0 records as it begins
            append_event(run_dir, {"event": "restored", "at_unix": now, "step": 2, "verify_s": 0.1, "restore_s": 0.2})
        attempts.append(argv)
        (run_dir / "run.json").write_text(json.dumps({"status": "running", "name": "test", "restarts": []}))
        steps = range(1, 3) if len(attempts) == 1 else range(3, 3)
        with (run_dir / "metrics.jsonl").open("a") as handle:
            for step in steps:
                handle.write(
                    json.dumps({"step": step, "loss": 1.0, "step_s": 0.01, "checkpoint.blocked_s": 0.0}) + "\n"
                )
        return Outcome(exit_codes={0: -9}, failed_at_unix=now)

    monkeypatch.setattr(supervisor, "run_ranks", killed_at_step_3)
    code = supervisor.supervise(1, ["train", "x.yaml"], run_dir, run_dir / "checkpoints", 1, 2)
    assert code == 1 and len(attempts) == 2
    assert "giving up: the restart budget (--max-restarts 1) is spent" in capsys.readouterr().err
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "failed" and record["name"] == "test" and record["finished_at"]
    assert "the restart budget (--max-restarts 1) is spent" in record["gave_up"]
    assert record["error"] == "rank 0 was killed (SIGKILL)"
    first, second = record["restarts"]
    assert "rank 0 was killed (SIGKILL)" in first["cause"] and first["failed_at_step"] == 2
    assert (first["resumed_from_step"], first["steps_lost"]) == (2, 0) and second["resumed_from_step"] is None
    good = record["goodput"]
    assert good["restarts"] == 1 and good["productive_s"] == pytest.approx(0.02)  # --max-restarts 1: one restart
    assert good["loading_s"] == pytest.approx(0.3)


def test_settling_a_run_that_died_before_writing_its_record_still_leaves_one(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    append_event(run_dir, {"event": "start", "at_unix": 100.0, "step": 0, "loading_s": 0.0})
    append_event(
        run_dir, {"event": "failure", "at_unix": 101.0, "failed_at_step": 0, "causes": [], "exit_codes": {"0": 1}}
    )
    content = settle_run_record(run_dir, "the restart budget (--max-restarts 0) is spent", now=102.0)
    assert json.loads((run_dir / "run.json").read_text()) == content
    assert content["status"] == "failed" and content["error"] == "rank 0 exited with code 1"
    assert content["restarts"][0]["resumed_from_step"] is None and content["goodput"]["wall_s"] == 2.0


def test_a_restart_that_fails_again_before_its_first_step_still_says_where_it_resumed():
    events = [
        {"event": "start", "at_unix": 100.0, "step": 0, "loading_s": 0.0},
        {"event": "failure", "at_unix": 110.0, "failed_at_step": 7, "causes": [], "exit_codes": {"1": -9}},
        {
            "event": "restored",
            "at_unix": 113.0,
            "step": 6,
            "verify_s": 1.0,
            "restore_s": 0.5,
            "skipped": ["step-00000008"],
            "removed_unfinished_saves": [],
        },
        # that attempt died before its first step; the next one restored nothing before it died
        {"event": "failure", "at_unix": 114.0, "failed_at_step": 6, "causes": [], "exit_codes": {"0": 1}},
        {"event": "failure", "at_unix": 120.0, "failed_at_step": 6, "causes": [], "exit_codes": {"0": 1}},
        {"event": "restored", "at_unix": 124.0, "step": 4, "verify_s": 2.0, "restore_s": 0.5},
        {"event": "resumed", "at_unix": 124.5, "step": 4},
    ]
    rows = restarts(events)
    assert [row["resumed_from_step"] for row in rows] == [6, None, 4]
    assert [row["steps_lost"] for row in rows] == [1, None, 2]
    assert [row["restart_latency_s"] for row in rows] == [pytest.approx(3.0), None, pytest.approx(4.0)]
    assert rows[0]["skipped_checkpoints"] == ["step-00000008"]
    good = goodput(events, [{"step": step, "step_s": 1.0} for step in range(1, 11)], now=130.0)
    assert good["restarts"] == 3 and good["lost_steps"] == 3
    assert good["loading_s"] == pytest.approx(4.0) and good["restarting_s"] == pytest.approx(3.0 + 6.0 + 4.0)


def test_poisoned_gradients_roll_back_when_asked_and_are_skipped_otherwise(config_file, tmp_path):
    assert main(["train", config_file, f"run.dir={tmp_path / 'straight'}"]) == 0
    nan = "fault.inject=[{step: 5, kind: nan}]"
    rolled = tmp_path / "rolled"
    assert (
        main(["train", config_file, "--max-restarts", "1", f"run.dir={rolled}", nan, "fault.on_nonfinite=raise"]) == 0
    )
    assert _losses(rolled) == _losses(tmp_path / "straight")
    assert "NonFiniteGradients" in json.loads((rolled / "run.json").read_text())["restarts"][0]["cause"]
    skipped = tmp_path / "skipped"
    assert main(["train", config_file, f"run.dir={skipped}", nan]) == 0
    records = [json.loads(line) for line in (skipped / "metrics.jsonl").read_text().splitlines()]
    assert records[4]["skipped_steps"] == 1 and math.isnan(records[4]["grad_norm"])


def test_poisoned_gradients_under_fsdp_roll_back_too(config_file, tmp_path):
    common = [config_file, "--nproc", "2", "parallel.mode=fsdp", "train.steps=10"]
    assert main(["train", *common, f"run.dir={tmp_path / 'straight'}"]) == 0
    rolled = tmp_path / "rolled"
    assert (
        main(
            [
                "train",
                *common,
                "--max-restarts",
                "1",
                f"run.dir={rolled}",
                "fault.on_nonfinite=raise",
                "fault.hang_timeout_s=20",
                "fault.inject=[{step: 5, rank: 1, kind: nan}]",
            ]
        )
        == 0
    )
    assert _losses(rolled) == _losses(tmp_path / "straight")
    assert "NonFiniteGradients" in json.loads((rolled / "run.json").read_text())["restarts"][0]["cause"]


def test_an_auto_interval_is_computed_from_the_measured_save_and_written_into_the_metrics(make_config, tmp_path):
    run_dir = tmp_path / "run"
    config = make_config(
        "train.steps=40",
        "checkpoint.interval=auto",
        "checkpoint.auto_first_step=3",
        "checkpoint.keep=40",
        "fault.mtbf_hours_per_device=0.00005",
        run_dir=run_dir,
    )
    Trainer(config).fit()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[1]["checkpoint_interval_steps"] is None and records[2]["checkpoint.blocked_s"] > 0
    intervals = [record["checkpoint_interval_steps"] for record in records[2:]]
    assert all(isinstance(steps, int) and steps >= 1 for steps in intervals)
    saves = [record for record in records if record["checkpoint.blocked_s"] > 0]
    assert saves[0]["step"] == 3 and len(saves) >= 2
    for save, following in zip(saves, saves[1:]):  # each save comes the interval computed at the one before
        assert following["step"] - save["step"] == save["checkpoint_interval_steps"]
    interval = json.loads((run_dir / "run.json").read_text())["checkpoint_interval"]
    assert interval["mode"] == "auto (Daly)" and interval["job_mtbf_hours"] == pytest.approx(0.00005)
    assert interval["interval_s"] == pytest.approx(daly_interval_s(interval["last_save_cost_s"], 0.18))


def test_after_a_restart_an_auto_interval_saves_again(config_file, tmp_path):
    run_dir = tmp_path / "run"
    code = main(
        [
            "train",
            config_file,
            "--max-restarts",
            "1",
            f"run.dir={run_dir}",
            "train.steps=30",
            "checkpoint.interval=auto",
            "checkpoint.auto_first_step=3",
            "checkpoint.keep=40",
            "fault.mtbf_hours_per_device=0.00005",
            "fault.inject=[{step: 9, kind: raise}]",
        ]
    )
    assert code == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (restart,) = json.loads((run_dir / "run.json").read_text())["restarts"]
    resumed = restart["resumed_from_step"]
    saves_after = [r["step"] for r in records if r["step"] > resumed and r["checkpoint.blocked_s"] > 0]
    assert saves_after and saves_after[0] == resumed + 3
    assert all(r["checkpoint_interval_steps"] for r in records if r["step"] >= resumed + 3)


def test_two_ranks_agree_on_the_auto_interval(config_file, tmp_path):
    run_dir = tmp_path / "run"
    code = main(
        [
            "train",
            config_file,
            "--nproc",
            "2",
            "parallel.ep=2",
            f"run.dir={run_dir}",
            "train.steps=24",
            "checkpoint.interval=auto",
            "checkpoint.auto_first_step=3",
            "checkpoint.keep=40",
            "fault.mtbf_hours_per_device=0.00002",
            "fault.hang_timeout_s=20",
        ]
    )
    assert code == 0
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "completed" and record["checkpoint_interval"]["interval_steps"] >= 1
    # the ranks `--nproc` starts run with the CPU profile's allocator preset
    assert record["hardware"]["host_allocator"]["applied"] and record["hardware"]["host_allocator"]["mallopt"]


def test_a_restart_before_the_first_save_of_a_run_resumed_from_elsewhere_resumes_that_checkpoint_again(
    config_file, tmp_path
):
    donor = tmp_path / "donor"
    assert main(["train", config_file, f"run.dir={donor}", "train.steps=6"]) == 0
    run_dir = tmp_path / "run"
    donor_checkpoint = donor / "checkpoints" / "step-00000006"
    assert (
        main(
            [
                "train",
                config_file,
                "--max-restarts",
                "1",
                f"run.dir={run_dir}",
                f"resume={donor_checkpoint}",
                "checkpoint.interval=0",
                "fault.inject=[{step: 9, kind: raise}]",
            ]
        )
        == 0
    )
    record = json.loads((run_dir / "run.json").read_text())
    assert record["resumed_from"]["checkpoint"] == str(donor_checkpoint)
    assert record["restarts"][0]["resumed_from_step"] == 6


def test_a_run_restarted_by_torchrun_resumes_its_newest_checkpoint_and_records_the_restart(
    make_config, tmp_path, monkeypatch
):
    run_dir = tmp_path / "run"
    Trainer(make_config("train.steps=8", "checkpoint.interval=2", run_dir=run_dir)).fit(stop_at=5)
    shutil.rmtree(run_dir / "checkpoints" / "step-00000005")  # as if the job died after step 5, before saving it
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    Trainer(make_config("train.steps=8", "checkpoint.interval=2", run_dir=run_dir)).fit()
    record = json.loads((run_dir / "run.json").read_text())
    assert record["resumed_from"]["step"] == 4 and record["status"] == "completed"
    (restart,) = record["restarts"]
    assert restart["by"] == "torchrun" and restart["failed_at_step"] == 5 and restart["steps_lost"] == 1
    assert [event["event"] for event in read_events(run_dir)] == ["start", "failure", "restored", "resumed"]
    assert (run_dir / EVENTS_NAME).exists()


def test_a_restart_counted_by_another_nodes_agent_is_agreed_over_the_ranks_and_recorded(
    make_config, tmp_path, monkeypatch
):
    """torchrun's agent on node 1 counted the restart (its rank was killed); node 0's did not. Rank 0 learns
    the count from the agreement, records the failure with its own report and names the silent rank."""
    run_dir = tmp_path / "run"
    config = make_config("train.steps=8", run_dir=run_dir)
    run_dir.mkdir()
    append_event(run_dir, {"event": "start", "at_unix": time.time() - 5, "step": 0, "loading_s": 0.0})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "step_s": 0.1}) + "\n" for s in range(1, 6)))
    write_cause(run_dir, 0, 6, "forward", "RuntimeError: Connection closed by peer")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("GROUP_RANK", "0")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    monkeypatch.setattr(resilience_module.dist, "is_initialized", lambda: True)  # as in a two-node job
    monkeypatch.setattr(resilience_module, "_agreed", {})
    offered = []

    def agree(values):  # the all-reduce (maximum): node 1's agent counted one restart
        offered.append(list(values))
        return [max(value, other) for value, other in zip(values, [0.0, 1.0])]

    assert restarted_by_torchrun(agree)
    node0 = Resilience(config, 0, 2, time.time())
    node0.agree = agree
    node0.note_agent_restart()
    node0.note_agent_restart()  # asked twice: still one collective, one failure
    assert offered == [[0.0, 0.0]], "one all-reduce, with this node's count at its place"
    failure = read_events(run_dir)[-1]
    assert failure["event"] == "failure" and failure["by"] == "torchrun" and failure["failed_at_step"] == 5
    assert failure["restart_count"] == 1 and failure["silent_ranks"] == [1]
    assert sum(1 for event in read_events(run_dir) if event["event"] == "failure") == 1
    assert not list((run_dir / CAUSES_DIR).glob("*.json")), "the cause went into the record"
    node0.begin(4, {"verify_s": 0.1, "restore_s": 0.2, "skipped": [], "removed_unfinished_saves": []}, None, print)
    node0.watchdog.stop()
    (row,) = restarts(read_events(run_dir))
    assert row["cause"].startswith("rank 1 left no report (killed outright, or stopped by the launcher); then rank 0")
    assert (row["resumed_from_step"], row["steps_lost"]) == (4, 1) and row["restart_latency_s"] >= 0


def test_a_start_that_is_no_restart_drops_the_causes_an_unrecorded_failure_left(make_config, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_cause(run_dir, 1, 3, "backward", "RuntimeError: from a crash nobody recorded")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    Resilience(make_config(run_dir=run_dir), 0, 1, time.time()).note_agent_restart()
    assert not list((run_dir / CAUSES_DIR).glob("*.json"))
    assert read_events(run_dir) == []


def test_a_checkpoint_fault_under_an_auto_interval_fires_at_the_first_save_at_or_after_its_step(
    make_config, tmp_path, capsys
):
    from ferry.checkpoint import CheckpointError, verify_checkpoint

    run_dir = tmp_path / "run"
    config = make_config(
        "train.steps=8",
        "checkpoint.interval=auto",
        "checkpoint.auto_first_step=4",
        "checkpoint.keep=40",
        "fault.inject=[{step: 3, kind: corrupt_checkpoint}]",
        run_dir=run_dir,
    )
    Trainer(config).fit()
    assert (
        "fault.inject.0 (corrupt_checkpoint at step 3 on rank 0) fires at the first checkpoint save at or after"
        in capsys.readouterr().out
    )
    saved = sorted(path.name for path in (run_dir / "checkpoints").glob("step-*"))
    assert saved[0] == "step-00000004", saved
    with pytest.raises(CheckpointError):
        verify_checkpoint(run_dir / "checkpoints" / "step-00000004")
    for later in saved[1:]:
        verify_checkpoint(run_dir / "checkpoints" / later)  # fired once: the later saves are intact
    resumed = make_config(
        "train.steps=10",
        "checkpoint.interval=auto",
        "checkpoint.auto_first_step=4",
        "checkpoint.keep=40",
        "fault.inject=[{step: 3, kind: corrupt_checkpoint}]",
        "resume=latest",
        run_dir=run_dir,
    )
    Trainer(resumed).fit()
    assert "fault.inject.0" not in capsys.readouterr().out  # spent: a resumed run does not announce it again


def test_which_save_an_auto_interval_checkpoint_fault_fires_at(make_config, tmp_path):
    faults = (
        "fault.inject=[{step: 3, kind: corrupt_checkpoint}, {step: 5, kind: corrupt_checkpoint}, "
        "{step: 6, kind: kill_during_save, once: false}]"
    )
    # the checkpoint hook asks the fault injector, with the step it last saved at and whether its interval is fixed
    injector = Resilience(make_config("train.steps=20", "checkpoint.interval=auto", faults), 0, 1, time.time()).injector
    last_save_step = 0
    assert injector.save_fault_step("corrupt_checkpoint", 2, last_save_step, fixed_interval=False) is None
    assert injector.save_fault_step("corrupt_checkpoint", 10, last_save_step, fixed_interval=False) == 3, (
        "one corruption per save, the earliest first"
    )
    (tmp_path / "run" / ".faults" / "fired").mkdir(parents=True)
    (tmp_path / "run" / ".faults" / "fired" / "fault-0").write_text("fired")
    assert injector.save_fault_step("corrupt_checkpoint", 10, last_save_step, fixed_interval=False) == 5, (
        "a once fault not yet fired waits for a save"
    )
    assert injector.save_fault_step("kill_during_save", 10, last_save_step, fixed_interval=False) == 6
    last_save_step = 10
    assert injector.save_fault_step("kill_during_save", 14, last_save_step, fixed_interval=False) is None, (
        "an every-attempt fault fires once per attempt"
    )
    fixed = Resilience(make_config("train.steps=20", "checkpoint.interval=3", faults.replace("5", "9")), 0, 1, 0.0)
    assert fixed.injector.save_fault_step("kill_during_save", 6, last_save_step, fixed_interval=True) == 6, (
        "a fixed interval: the fault of the save's own step"
    )


@pytest.mark.parametrize(
    "override, culprit",
    [
        ("fault.inject=[{step: 2, kind: explode}]", "fault.inject.0.kind"),
        ("fault.inject=[{step: 99, kind: kill}]", "fault: inject.0.step 99 is past the run's last step (12)"),
        ("fault.inject=[{step: 2, rank: 5, kind: kill}]", "fault.inject.0.rank: 5 is not a rank of this job"),
        ("fault.mtbf_hours_per_device=-1", "fault.mtbf_hours_per_device"),
        ("checkpoint.interval=-3", "checkpoint.interval"),
        ("fault.hang_timeout_s=soon", "fault.hang_timeout_s"),
        ("fault.hang_timeout_s=0", "fault.hang_timeout_s"),
        ("fault.mtbf_hours_per_device=.inf", "fault.mtbf_hours_per_device"),
        ("fault.inject=[{step: 5, kind: corrupt_checkpoint}]", "a corrupt_checkpoint fault at step 5 never fires"),
    ],
)
def test_bad_fault_input_exits_2_naming_the_key(override, culprit, config_file, tmp_path, capsys):
    code = main(["train", config_file, f"run.dir={tmp_path / 'run'}", override])
    err = capsys.readouterr().err
    assert code == 2, err
    assert culprit in err


def test_a_negative_restart_budget_is_refused(config_file, tmp_path, capsys):
    assert main(["train", config_file, "--max-restarts", "-1", f"run.dir={tmp_path / 'run'}"]) == 2
    assert "--max-restarts must be 0 or more" in capsys.readouterr().err


def test_draws_are_a_function_of_the_seed_and_checkpoint_faults_fall_on_checkpoints():
    from ferry.portability.drill import draw_faults

    assert draw_faults(4, 3, 30, 2, 3) == draw_faults(4, 3, 30, 2, 3)
    for seed in range(100):
        for count in (1, 4, 11):  # 11 faults in 12 steps: every step taken by some fault
            schedule = draw_faults(seed, count, 12, 2, 3)
            assert len({(fault["step"], fault["kind"]) for fault in schedule}) == count
            for fault in schedule:
                assert 2 <= fault["step"] <= 12 and fault["rank"] in (0, 1, "all")
                assert fault["rank"] != "all" or fault["kind"] == "kill_during_save"
                if fault["kind"] == "kill_during_save":
                    assert fault["step"] % 3 == 0 and fault["step"] < 12
                if fault["kind"] == "corrupt_checkpoint":
                    assert fault["step"] % 3 == 0 and 6 <= fault["step"] < 12


def test_a_drawn_corrupt_checkpoint_is_followed_by_a_failure_before_the_next_save():
    """A corrupt checkpoint is read only by a restart while it is the newest: the issue's draw (seed 0, 60 steps,
    a save every 6) corrupted step 30 and failed next at step 40, after step 36 had saved, so nothing read it."""
    from ferry.portability.drill import draw_faults, injections

    schedule = draw_faults(0, 3, 60, 2, 6)
    assert schedule[1] == {
        "step": 30,
        "rank": 1,
        "kind": "corrupt_checkpoint",
        "followed_by": {"step": 31, "rank": 1, "kind": "raise"},
    }
    assert injections(schedule, 2) == [
        {"step": 28, "rank": 0, "kind": "nan"},
        {"step": 30, "rank": 1, "kind": "corrupt_checkpoint"},
        {"step": 40, "rank": 1, "kind": "raise"},
        {"step": 31, "rank": 1, "kind": "raise"},
    ], "the drawn faults keep their indices in fault.inject; the follow-ups come after them"
    for seed in range(100):
        schedule = draw_faults(seed, 4, 12, 2, 3)
        for fault in schedule:
            if fault["kind"] != "corrupt_checkpoint":
                assert "followed_by" not in fault
                continue
            failing = [
                other
                for other in schedule
                if other["kind"] != "corrupt_checkpoint" and fault["step"] < other["step"] <= min(fault["step"] + 3, 12)
            ]
            assert bool(failing) != ("followed_by" in fault), (seed, schedule)


def test_a_drawn_kill_of_every_rank_during_a_save_is_injected_on_each_of_them():
    """On several ranks half the drawn kills during a save strike every rank; fault i stays fault.inject.i (on rank
    0), the other ranks' copies come last."""
    from ferry.portability.drill import _fault_name, draw_faults, injections

    drawn = [(seed, draw_faults(seed, 4, 12, 4, 3)) for seed in range(200)]
    every = [(seed, fault) for seed, schedule in drawn for fault in schedule if fault["rank"] == "all"]
    single = [
        fault
        for _, schedule in drawn
        for fault in schedule
        if fault["kind"] == "kill_during_save" and fault["rank"] != "all"
    ]
    assert every and single, "both kinds of kill during a save are drawn"
    seed, fault = every[0]
    schedule = dict(drawn)[seed]
    inject = injections(schedule, 4)
    index = schedule.index(fault)
    assert inject[index] == {"step": fault["step"], "rank": 0, "kind": "kill_during_save"}
    copies = [
        other
        for other in inject[len(schedule) :]
        if other["kind"] == "kill_during_save" and other["step"] == fault["step"]
    ]
    assert copies == [{"step": fault["step"], "rank": rank, "kind": "kill_during_save"} for rank in (1, 2, 3)]
    assert _fault_name(fault) == f"kill_during_save on every rank at step {fault['step']}"
    assert all(fault["rank"] == 0 for fault in draw_faults(7, 4, 12, 1, 3) if fault["kind"] == "kill_during_save")


def test_a_fault_is_exercised_only_as_far_as_the_jobs_records_show(config_file, tmp_path):
    """The accounting of a drill, fed with a real supervised job: the corruption of step 4 is read by the
    restart after step 4 (refused, back to step 2); that of step 6 is never read, because the next failure
    comes after step 8 had saved, so it must be named as not exercised and not counted."""
    from ferry.portability.drill import fault_outcomes, summary_lines

    schedule = [
        {"step": 4, "rank": 0, "kind": "corrupt_checkpoint"},
        {"step": 5, "rank": 0, "kind": "raise"},
        {"step": 6, "rank": 0, "kind": "corrupt_checkpoint"},
        {"step": 10, "rank": 0, "kind": "kill_during_save"},
    ]
    run_dir = tmp_path / "run"
    faults = "fault.inject=" + json.dumps(schedule)
    assert main(["train", config_file, "--max-restarts", "2", f"run.dir={run_dir}", faults]) == 0
    judged = fault_outcomes(run_dir, schedule)
    assert [fault["exercised"] for fault in judged] == [True, True, False, True], judged
    assert judged[0]["outcome"] == "the restart after step 4 refused step-00000004 and resumed from step 2"
    assert judged[1]["outcome"] == "the job failed after step 4 and resumed from step 2"
    assert judged[2]["outcome"] == (
        "no restart read step-00000006: the first after it (after step 9) resumed from the newer step 8"
    )
    assert judged[3]["outcome"] == (
        "the save was cut short; the restart after step 9 removed .step-00000010.partial and resumed from step 8"
    )
    record = json.loads((run_dir / "run.json").read_text())
    lines = summary_lines(
        {
            "passed": True,
            "faults": judged,
            "restarts": record["restarts"],
            "losses_compared": 12,
            "tensors_compared": 60,
            "differing_steps": [],
            "differing_tensors": [],
        }
    )
    assert lines[0] == "ferry: drill PASS: 3 fault(s) exercised, 2 restart(s); 1 fault(s) NOT exercised, not counted"
    assert lines[4] == (
        "  corrupt_checkpoint on rank 0 at step 6: NOT exercised — no restart read step-00000006: the first after it "
        "(after step 9) resumed from the newer step 8"
    )


def test_a_drill_makes_a_restart_read_the_checkpoint_it_corrupts(config_file, tmp_path, capsys):
    """Seed 56 draws one fault, a corruption of step 10 of 12: without the raise that follows it, the job would
    finish without reading it (the issue); with it, the restart refuses it and falls back to step 8."""
    work = tmp_path / "drill"
    code = main(["drill", config_file, "--faults", "1", "--seed", "56", "--dir", str(work)])
    out = capsys.readouterr().out
    record = json.loads((work / "drill.json").read_text())
    assert code == 0 and record["passed"], out
    (fault,) = record["faults"]
    assert (fault["kind"], fault["step"], fault["followed_by"]) == (
        "corrupt_checkpoint",
        10,
        {"step": 11, "rank": 0, "kind": "raise"},
    )
    assert fault["exercised"] and record["faults_exercised"] == 1
    assert fault["outcome"] == "the restart after step 10 refused step-00000010 and resumed from step 8"
    (restart,) = record["restarts"]
    assert restart["skipped_checkpoints"] == [str(work / "drilled" / "checkpoints" / "step-00000010")]
    assert "ferry: drill PASS: 1 fault(s) exercised, 1 restart(s)\n" in out
    assert (
        "  corrupt_checkpoint on rank 0 at step 10 (then raise at step 11, so that a restart reads it): exercised — "
        "the restart after step 10 refused step-00000010 and resumed from step 8\n"
    ) in out


@pytest.mark.parametrize(
    "argv, culprit",
    [(["--faults", "12"], "has room for 11 faults"), (["--max-restarts", "-1"], "--max-restarts must be 0 or more")],
)
def test_bad_drill_input_is_refused_before_anything_runs(argv, culprit, config_file, tmp_path, capsys):
    assert main(["drill", config_file, *argv, "--dir", str(tmp_path / "drill")]) == 2
    assert culprit in capsys.readouterr().err and not (tmp_path / "drill").exists()


def test_a_drill_with_three_faults_on_two_ranks_ends_bitwise_equal(config_file, tmp_path, capsys):
    work = tmp_path / "drill"
    code = main(
        [
            "drill",
            config_file,
            "train.steps=30",
            "parallel.ep=2",
            "--nproc",
            "2",
            "--faults",
            "3",
            "--seed",
            "57",
            "--dir",
            str(work),
        ]
    )
    record = json.loads((work / "drill.json").read_text())
    assert code == 0 and record["passed"], capsys.readouterr().out
    assert [fault["kind"] for fault in record["faults"]] == ["raise", "corrupt_checkpoint", "nan"]
    assert record["differing_steps"] == [] and record["differing_tensors"] == [] and record["tensors_compared"] > 50
    assert len(record["restarts"]) == 2 and record["goodput"]["restarts"] == 2
    assert record["restarts"][1]["skipped_checkpoints"][0].endswith("step-00000004"), "the corrupt one is skipped"
    assert record["restarts"][1]["resumed_from_step"] == 2
    assert [fault["exercised"] for fault in record["faults"]] == [True, True, True], record["faults"]
    assert "followed_by" not in record["faults"][1], "the poisoned gradients at step 5 make a restart read step 4"
    out = capsys.readouterr().out
    assert "drill PASS" in out
    assert "drill PASS: 3 fault(s) exercised, 2 restart(s)\n" in out


def test_a_hang_while_loading_a_checkpoint_is_caught_and_named(stdlib_dataset, tmp_path):
    """The watchdog watches from the start of the run: a checkpoint load that never returns ends the rank
    with the hang exit code and a cause naming the load (a real process: the watchdog ends it)."""
    import subprocess
    import sys

    from ferry.train.resilience.restarts import collect_causes
    from ferry.train.resilience.watchdog import HANG_EXIT_CODE

    script = tmp_path / "hang_in_load.py"
    script.write_text(
        "import sys, time\n"
        f"sys.path.insert(0, {str(REPO / 'tests')!r})\n"
        "import ferry.train.trainer as trainer\n"
        "import ferry.train.restore as restore\n"
        "from conftest import tiny_config\n"
        "restore.find_resume_point = lambda *args, **kwargs: time.sleep(600)\n"
        f"config = tiny_config({str(stdlib_dataset)!r}, {str(tmp_path / 'run')!r}, 'resume=latest',\n"
        "    'fault.hang_timeout_s=1', 'fault.hang_first_step_s=0', 'fault.hang_checkpoint_s=1')\n"
        "trainer.Trainer(config).fit()\n",
        encoding="utf-8",
    )
    started = time.monotonic()
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert result.returncode == HANG_EXIT_CODE, result.stderr[-2000:]
    assert time.monotonic() - started < 60
    assert "stuck in checkpoint load" in result.stderr
    causes = collect_causes(tmp_path / "run")
    assert any("checkpoint load" in str(cause) for cause in causes), causes


def test_a_long_initial_draw_after_a_resume_from_nothing_is_not_taken_for_a_hang(stdlib_dataset, tmp_path):
    """A run asked to resume draws its weights only once it has found no checkpoint, inside the window the
    watchdog gives the load: the draw tells it after each parameter that it is moving (a real process: a
    watchdog that fired would end it). Here each of the 17 draws takes 0.2 s against a 2 s limit, 3.4 s in all."""
    import subprocess
    import sys

    script = tmp_path / "slow_draw.py"
    script.write_text(
        "import sys, time\n"
        f"sys.path.insert(0, {str(REPO / 'tests')!r})\n"
        "import ferry.model.transformer as transformer\n"
        "from ferry.train import Trainer\n"
        "from conftest import tiny_config\n"
        "draw = transformer.truncated_normal_\n"
        "transformer.truncated_normal_ = lambda *args, **kwargs: (time.sleep(0.2), draw(*args, **kwargs))[1]\n"
        f"config = tiny_config({str(stdlib_dataset)!r}, {str(tmp_path / 'run')!r}, 'resume=latest', 'train.steps=2',\n"
        "    'fault.hang_timeout_s=2', 'fault.hang_first_step_s=0', 'fault.hang_checkpoint_s=0')\n"
        "Trainer(config).fit()\n",
        encoding="utf-8",
    )
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["status"] == "completed" and record["initial_weights_xxh3"] is not None


def test_a_hung_rank_that_waited_in_a_collective_is_named_after_the_one_it_waited_for(tmp_path, monkeypatch):
    from contextlib import nullcontext
    from types import SimpleNamespace

    import torch

    from ferry.comm import CommStats
    from ferry.comm.collectives import Collectives, waiting_in
    from ferry.train.resilience.restarts import collect_causes, write_cause

    # a gloo group's Collectives, as far as `timed` reads it (one rank: no link tier)
    gloo = SimpleNamespace(device=torch.device("cpu"), region=lambda name: nullcontext(), stats=CommStats(), tier=None)
    gloo.record = lambda op, sent, seconds: Collectives.record(gloo, op, sent, seconds)
    with Collectives.timed(gloo, "all_to_all", 64):
        assert waiting_in() == "all_to_all"
        watchdog = Watchdog(FaultConfig(hang_timeout_s=1, hang_first_step_s=0), 0, print)
        monkeypatch.setattr(watchdog, "_last", time.monotonic() - 5)
        assert watchdog.overdue().endswith("of step 1, waiting in all_to_all for its peers")
    assert waiting_in() is None and gloo.stats.ops["all_to_all"].bytes == 64
    monkeypatch.setattr(time, "time", lambda: 100.0)
    write_cause(tmp_path, 1, 5, "forward", "hang: ... waiting in all_to_all", waiting_in="all_to_all")
    monkeypatch.setattr(time, "time", lambda: 100.1)  # the rank that hung itself fired a moment later
    write_cause(tmp_path, 0, 5, "a hang (injected fault)", "hang: ...")
    assert [cause["rank"] for cause in collect_causes(tmp_path)] == [0, 1]

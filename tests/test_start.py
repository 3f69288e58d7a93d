"""Where a run starts is decided once, by the assembly's `decide_start`, with the torchrun agents' restart counts
agreed in it; the model's deferred draw and the resume both read that decision."""

from __future__ import annotations

import ferry.train.assembly as assembly
from ferry.train import Trainer


def test_the_start_is_decided_once_and_read_by_the_draw_and_the_resume(make_config, monkeypatch, tmp_path):
    decided = []
    original = assembly.decide_start

    def counted(job):
        decided.append(original(job))
        return decided[-1]

    monkeypatch.setattr(assembly, "decide_start", counted)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    trainer = Trainer(make_config("train.steps=2", "resume=latest", run_dir=tmp_path / "run"))
    (start,) = decided
    assert (start.resume, start.restart_counts, start.restarted_by_agent) == ("latest", (), False)
    assert trainer.parts.start is start and trainer.parts.model.draw_deferred, "nothing drawn before the resume"
    trainer.fit()
    assert len(decided) == 1
    fresh = Trainer(make_config("train.steps=2", run_dir=tmp_path / "fresh"))
    assert fresh.parts.start.resume is None and not fresh.parts.model.draw_deferred


def test_a_job_torchrun_restarted_resumes_its_own_newest_checkpoint(make_config, monkeypatch, tmp_path):
    run_dir = tmp_path / "run"
    Trainer(make_config("train.steps=4", "checkpoint.interval=2", run_dir=run_dir)).fit(stop_at=2)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setattr("ferry.train.resilience.core._agreed", {})
    start = Trainer(make_config("train.steps=4", "checkpoint.interval=2", run_dir=run_dir)).parts.start
    assert start.restarted_by_agent and start.resume == "latest" and start.restart_counts == (1,)

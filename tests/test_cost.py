"""`ferry cost`: the arithmetic against a hand calculation, the outputs, refusals and the scaling view."""

from __future__ import annotations

import json

import pytest

from ferry.cli.main import main
from ferry.platform.hardware import load_profile
from ferry.portability.bench.cost import default_assumptions


def record(
    tokens_per_s_per_device=10_000.0,
    profile="h200",
    device="cuda",
    nproc=1,
    ep=1,
    comm_s=0.0,
    compute_s=1.0,
    suite="olmoe-1b-7b",
    input_digest="i" * 64,
    workload_digest="w" * 64,
):
    return {
        "kind": "ferry-bench",
        "version": 1,
        "suite": suite,
        "suite_digest": "s" * 64,
        "input_digest": input_digest,
        "workload_digest": workload_digest,
        "weights_digest": "x" * 32,
        "device": device,
        "nproc": nproc,
        "overrides": [],
        "layout": {"world_size": nproc, "ep_degree": ep, "mode": "ep" if nproc > 1 else "single"},
        "tokens_per_s_per_device": tokens_per_s_per_device,
        "tokens_per_s": tokens_per_s_per_device * nproc,
        "step_s": compute_s + comm_s,
        "compute_s": compute_s,
        "comm_s": comm_s,
        "comm_compute_ratio": comm_s / compute_s,
        "kernels": {"policy": "auto"},
        "hardware": {"profile": profile, "price_per_device_hour_usd": load_profile(profile).price_per_device_hour_usd},
    }


def write(tmp_path, name, content):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(content))
    return str(path)


def cost(tmp_path, *argv):
    return main(["cost", *argv, "--out", str(tmp_path / "out")])


def test_the_defaults_are_the_cited_ones_and_the_h200_profile_holds_its_prices():
    values, sources = default_assumptions()
    assert values == {
        "tokens": 7.1e12,
        "devices": 128,
        "depreciation_years": 5,
        "pue": 1.58,
        "electricity_usd_per_kwh": 0.0806,
        "utilization": 0.8,
        "system_share": 0.23,
    }
    assert all(len(source) > 40 for source in sources.values())
    h200 = load_profile("h200")
    assert (h200.price_per_device_hour_usd, h200.purchase_price_usd, h200.power_kw) == (4.59, 32000, 1.275)


def test_rent_own_breakeven_and_time_to_train_match_a_hand_calculation(tmp_path):
    assert cost(tmp_path, write(tmp_path, "h200", record())) == 0
    row = json.loads((tmp_path / "out" / "cost.json").read_text())["records"][0]
    # 10,000 tokens/s per device = 3.6e7 tokens per device-hour; H200 rents at $4.59 an hour
    assert row["usd_per_million_tokens_rent"] == pytest.approx(4.59 / 36.0)  # 0.1275
    capex_hour = 32000 * 1.23 / (5 * 8760)  # $0.898630 per device-hour
    energy_hour = 1.275 * 1.58 * 0.0806  # $0.162369 per device-hour
    assert row["capex_usd_per_device_hour"] == pytest.approx(0.898630, rel=1e-5)
    assert row["energy_usd_per_device_hour"] == pytest.approx(0.162369, rel=1e-5)
    assert row["usd_per_million_tokens_own"] == pytest.approx((capex_hour / 0.8 + energy_hour) / 36.0)  # 0.035713
    assert row["usd_per_million_tokens_own"] == pytest.approx(0.035713, rel=1e-4)
    assert row["breakeven_utilization"] == pytest.approx(capex_hour / (4.59 - energy_hour))
    assert row["breakeven_utilization"] == pytest.approx(0.202960, rel=1e-4)
    assert row["days_to_train"] == pytest.approx(7.1e12 / 3.6e7 / 128 / 24)  # 64.2 days
    assert row["cost_to_train_rent_usd"] == pytest.approx(7.1e12 / 3.6e7 * 4.59)  # $905,250
    names = {path.name for path in (tmp_path / "out").iterdir()}
    assert names == {"cost.json", "cost.md", "usd_per_million_tokens.png", "rent_vs_own.png"}


def test_overrides_of_price_budget_and_ownership_change_exactly_their_terms(tmp_path):
    path = write(tmp_path, "h200", record())
    assert (
        cost(
            tmp_path,
            path,
            "--price",
            "h200=2.0",
            "--tokens",
            "1e12",
            "--devices",
            "64",
            "--own",
            "utilization=0.5",
            "--own",
            "pue=1.1",
            "--own",
            "purchase_price_usd.h200=40000",
        )
        == 0
    )
    data = json.loads((tmp_path / "out" / "cost.json").read_text())
    row = data["records"][0]
    capex_hour = 40000 * 1.23 / (5 * 8760)
    energy_hour = 1.275 * 1.1 * 0.0806
    assert row["usd_per_million_tokens_rent"] == pytest.approx(2.0 / 36.0)
    assert row["usd_per_million_tokens_own"] == pytest.approx((capex_hour / 0.5 + energy_hour) / 36.0)
    assert row["days_to_train"] == pytest.approx(1e12 / 3.6e7 / 64 / 24)
    assert data["sources"]["utilization"] == "given with --own" and data["sources"]["tokens"] == "given with --tokens"


def test_owning_that_never_pays_says_so(tmp_path):
    assert cost(tmp_path, write(tmp_path, "h200", record()), "--price", "h200=0.1") == 0
    row = json.loads((tmp_path / "out" / "cost.json").read_text())["records"][0]
    assert row["breakeven_utilization"] is None  # energy alone (0.16 $/h) costs more than renting
    assert "never (energy costs more than rent)" in (tmp_path / "out" / "cost.md").read_text()


def test_records_of_other_suites_or_inputs_are_refused(tmp_path, capsys):
    a = write(tmp_path, "a", record())
    b = write(tmp_path, "b", record(suite="moe-tiny"))
    c = write(tmp_path, "c", record(input_digest="j" * 64))
    assert cost(tmp_path, a, b) == 2
    assert "differ in their suite (suite" in capsys.readouterr().err
    assert cost(tmp_path, a, c) == 2
    assert "differ in their input values" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "argv, culprit",
    [
        (["--own", "uptime=0.9"], "unknown key 'uptime'"),
        (["--own", "utilization=1.5"], "utilization"),
        (["--price", "h900=2"], "unknown hardware profile 'h900'"),
        (["--price", "h200=-1"], "cannot be negative"),
        (["--own", "power_kw.h200=0"], "must be positive"),
    ],
)
def test_bad_cost_options_exit_2(argv, culprit, tmp_path, capsys):
    assert cost(tmp_path, write(tmp_path, "a", record()), *argv) == 2
    assert culprit in capsys.readouterr().err


def test_a_file_that_is_not_a_record_is_refused(tmp_path, capsys):
    assert cost(tmp_path, write(tmp_path, "other", {"kind": "something"})) == 2
    assert "is not a `ferry bench` record" in capsys.readouterr().err


def test_a_cpu_record_is_flagged_loudly(tmp_path, capsys):
    assert cost(tmp_path, write(tmp_path, "cpu", record(profile="cpu", device="cpu"))) == 0
    assert "WARNING" in capsys.readouterr().out and "measured on a CPU" in (tmp_path / "out" / "cost.md").read_text()


AT_REST = {"others_busy_cores": 0.05, "load_1m_max": 0.8, "logical_cores": 2, "under_load": False}
BUSY = {"others_busy_cores": 1.6, "load_1m_max": 4.7, "logical_cores": 2, "under_load": True}


def test_a_record_measured_under_load_is_named_in_a_warning_and_one_at_rest_is_not(tmp_path, capsys):
    busy = write(tmp_path, "busy", {**record(), "conditions": BUSY})
    at_rest = write(tmp_path, "at-rest", {**record(), "conditions": AT_REST})
    older = write(tmp_path, "older", record())  # from a ferry that did not measure the load
    assert cost(tmp_path, busy, at_rest, older) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert (
        f"WARNING: {busy} was measured under load: other processes used 1.6 of 2 cores, load average up to 4.7" in out
    )
    assert f"WARNING: {older}: whether it was measured under load is unknown (load unknown" in out
    assert at_rest not in out
    costed = {row["file"]: row for row in json.loads((tmp_path / "out" / "cost.json").read_text())["records"]}
    assert (costed[busy]["measured"], costed[at_rest]["measured"], costed[older]["measured"]) == (
        "under load",
        "fair",
        "unknown",
    )
    assert f"**WARNING: {busy} was measured under load: other processes" in (tmp_path / "out" / "cost.md").read_text()


def test_the_scaling_view_flags_communication_that_dominates(tmp_path):
    one = write(tmp_path, "one", record(nproc=1, tokens_per_s_per_device=10_000))
    two = write(tmp_path, "two", record(nproc=2, ep=2, tokens_per_s_per_device=9_000, comm_s=0.2))
    eight = write(tmp_path, "eight", record(nproc=8, ep=8, tokens_per_s_per_device=4_000, comm_s=1.5))
    assert cost(tmp_path, one, two, eight) == 0
    scaling = json.loads((tmp_path / "out" / "cost.json").read_text())["scaling"]
    by_size = {row["world_size"]: row for row in scaling}
    assert by_size[2]["per_device_vs_smallest"] == pytest.approx(0.9) and not by_size[2]["communication_dominates"]
    assert by_size[8]["communication_dominates"] and by_size[8]["comm_share_of_step"] == pytest.approx(0.6)
    assert "communication dominates" in (tmp_path / "out" / "cost.md").read_text()


def test_the_scaling_view_is_printed_on_the_console_row_by_row(tmp_path, capsys):
    one = write(tmp_path, "one", record(nproc=1, tokens_per_s_per_device=10_000))
    two = write(tmp_path, "two", record(nproc=2, ep=2, tokens_per_s_per_device=9_000, comm_s=0.2))
    eight = write(tmp_path, "eight", record(nproc=8, ep=8, tokens_per_s_per_device=4_000, comm_s=1.5))
    assert cost(tmp_path, one, two, eight) == 0
    out = capsys.readouterr().out
    assert "Scaling: throughput per device and communication by layout" in out
    rows = [line for line in out.splitlines() if line.count("h200 (cuda)") == 1 and "│" in line]
    cells = [[cell.strip() for cell in line.split("│")[1:-1]] for line in rows]
    assert [cell[1:7] for cell in cells] == [
        ["1", "1", "10,000", "1.00", "0.00", "0.00"],
        ["2", "2", "9,000", "0.90", "0.20", "0.17"],
        ["8", "8", "4,000", "0.40", "1.50", "0.60"],
    ]
    assert [cell[7] for cell in cells] == ["", "", "communication dominates"]


def test_one_layout_prints_no_scaling_table(tmp_path, capsys):
    faster, slower = write(tmp_path, "a", record()), write(tmp_path, "b", record(tokens_per_s_per_device=9e3))
    assert cost(tmp_path, faster, slower) == 0
    assert "Scaling" not in capsys.readouterr().out


def test_records_of_another_workload_are_refused(tmp_path, capsys):
    a = write(tmp_path, "a", record())
    b = write(tmp_path, "b", record(workload_digest="x" * 64))  # say, model.moe.top_k=1 as an override
    assert cost(tmp_path, a, b) == 2
    assert "differ in their workload (model, sequence length, global batch, optimizer)" in capsys.readouterr().err


@pytest.mark.parametrize(
    "change, culprit",
    [
        (lambda r: r.pop("hardware"), "hardware"),
        (lambda r: r.update(tokens_per_s_per_device="fast"), "tokens_per_s_per_device"),
        (lambda r: r.update(tokens_per_s_per_device=None), "tokens_per_s_per_device"),
        (lambda r: r.update(nproc=0), "nproc"),
        (lambda r: r.pop("workload_digest"), "workload_digest"),
        (lambda r: r.pop("weights_digest"), "weights_digest"),
        (lambda r: r.update(weights_digest=None), "weights_digest"),  # an init_from run: not the suite's weights
        (lambda r: r.update(weights_digest=""), "weights_digest"),
        (lambda r: r.update(tokens_per_s_per_device="366"), "tokens_per_s_per_device"),  # not converted
        (lambda r: r.update(tokens_per_s_per_device=True), "tokens_per_s_per_device"),
        (lambda r: r.update(nproc=1.0), "nproc"),
        (lambda r: r.update(conditions={"under_load": "false"}), "conditions.under_load"),  # a truthy string
    ],
)
def test_a_hand_edited_record_is_refused_naming_the_field(change, culprit, tmp_path, capsys):
    edited = record()
    change(edited)
    assert cost(tmp_path, write(tmp_path, "edited", edited)) == 2
    assert culprit in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--price", "h200=nan"], ["--price", "h200=inf"], ["--own", "power_kw.h200=nan"]])
def test_non_finite_prices_are_refused(argv, tmp_path, capsys):
    assert cost(tmp_path, write(tmp_path, "a", record()), *argv) == 2
    assert "is not a finite number" in capsys.readouterr().err


def test_an_out_that_is_a_file_is_refused(tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.write_text("not a directory")
    assert main(["cost", write(tmp_path, "a", record()), "--out", str(taken)]) == 2
    assert "is a file" in capsys.readouterr().err and taken.read_text() == "not a directory"


def test_the_scaling_view_never_mixes_two_vendors_of_one_device_type(tmp_path):
    h100 = write(tmp_path, "h100", record(profile="h100", nproc=1, tokens_per_s_per_device=10_000))
    mi_one = write(tmp_path, "mi1", record(profile="mi300x", nproc=1, tokens_per_s_per_device=5_000))
    mi_eight = write(tmp_path, "mi8", record(profile="mi300x", nproc=8, ep=8, tokens_per_s_per_device=4_500))
    assert cost(tmp_path, h100, mi_one, mi_eight) == 0
    scaling = json.loads((tmp_path / "out" / "cost.json").read_text())["scaling"]
    eight = next(row for row in scaling if row["world_size"] == 8)
    assert eight["device"].startswith("mi300x") and eight["per_device_vs_smallest"] == pytest.approx(0.9)


def test_a_record_without_a_recorded_price_is_costed_at_its_profiles(tmp_path, capsys):
    unpriced = record()
    unpriced["hardware"]["price_per_device_hour_usd"] = None
    assert cost(tmp_path, write(tmp_path, "unpriced", unpriced)) == 0
    row = json.loads((tmp_path / "out" / "cost.json").read_text())["records"][0]
    assert row["rent_usd_per_device_hour"] == load_profile(unpriced["hardware"]["profile"]).price_per_device_hour_usd


@pytest.mark.parametrize("argv", [["--price", "h100=1"], ["--own", "purchase_price_usd.mi300x=1"]])
def test_an_override_for_a_profile_no_record_used_is_refused(argv, tmp_path, capsys):
    assert cost(tmp_path, write(tmp_path, "a", record()), *argv) == 2
    assert "no record was measured on profile" in capsys.readouterr().err

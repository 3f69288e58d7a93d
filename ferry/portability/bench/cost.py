"""`ferry cost`: bench records turned into dollars per million tokens and time to train, rented and owned.

For a record measured at `T` tokens/s per device:

    rented    $/1M tokens = price per device-hour / (T x 3600) x 1e6
    train     device-hours = tokens / (T x 3600); days = device-hours / devices / 24
    owned     capex per device-hour  = purchase x (1 + system share) / (depreciation years x 8760)
              energy per device-hour = power kW x PUE x electricity $/kWh      (paid only while training)
              per productive hour    = capex per device-hour / utilisation + energy per device-hour
              $/1M tokens = per productive hour / (T x 3600) x 1e6
    break-even utilisation = capex per device-hour / (rent - energy per device-hour)

Owning pays from the break-even utilisation up; above 1 it never does, and when the
energy alone costs more than renting it cannot. Time to train assumes the measured
per-device rate holds at `devices` devices: the scaling view says how far that is
from true when records at several world sizes are given.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ferry.config import ConfigError, Section, UserError
from ferry.config.errors import first_problem
from ferry.config.loader import validate
from ferry.platform.hardware import load_profile, profile_names
from ferry.portability.bench.bench import RECORD_KIND, RECORD_VERSION
from ferry.portability.rehearsal.conditions import fairness

DEFAULTS_FILE = Path(__file__).with_name("cost_defaults.yaml")
HOURS_PER_YEAR = 8760.0


class CostAssumptions(Section):
    """Everything the arithmetic assumes beyond the records and the hardware profiles."""

    tokens: float = Field(gt=0, description="token budget to train")
    devices: int = Field(ge=1, description="devices the budget is trained on")
    depreciation_years: float = Field(gt=0)
    pue: float = Field(ge=1.0, description="power usage effectiveness of the data centre")
    electricity_usd_per_kwh: float = Field(ge=0)
    utilization: float = Field(gt=0, le=1, description="share of an owned device's life spent training")
    system_share: float = Field(ge=0, description="the rest of the server, as a share of the accelerator's price")


def default_assumptions() -> tuple[dict[str, Any], dict[str, str]]:
    """(values, sources) of the defaults in cost_defaults.yaml."""
    raw = yaml.safe_load(DEFAULTS_FILE.read_text(encoding="utf-8"))
    return {key: entry["value"] for key, entry in raw.items()}, {key: entry["source"] for key, entry in raw.items()}


@dataclass(frozen=True)
class CostInputs:
    """The assumptions and the per-profile prices and hardware figures in force, after overrides."""

    assumptions: CostAssumptions
    prices: dict[str, float]  # rent per device-hour overrides, by profile
    purchase: dict[str, float]  # purchase price overrides, by profile
    power: dict[str, float]  # kW per device overrides, by profile
    sources: dict[str, str]


def cost_inputs(
    tokens: float | None = None, devices: int | None = None, prices: list[str] = (), own: list[str] = ()
) -> CostInputs:
    """Defaults, then `--tokens`, `--devices`, `--price PROFILE=USD` and `--own KEY=VALUE` over them."""
    values, sources = default_assumptions()
    if tokens is not None:
        values["tokens"], sources["tokens"] = tokens, "given with --tokens"
    if devices is not None:
        values["devices"], sources["devices"] = devices, "given with --devices"
    purchase: dict[str, float] = {}
    power: dict[str, float] = {}
    for item in own:
        key, value = _pair(item, "--own")
        if key.startswith(("purchase_price_usd.", "power_kw.")):
            field, profile = key.split(".", 1)
            _known_profile(profile, f"--own {item}")
            number = _number(value, f"--own {item}")
            if number < 0 or (field == "power_kw" and number == 0):
                raise UserError(f"--own {item}: must be {'positive' if field == 'power_kw' else 'zero or more'}")
            (purchase if field == "purchase_price_usd" else power)[profile] = number
        elif key in CostAssumptions.model_fields and key not in ("tokens", "devices"):
            values[key], sources[key] = _number(value, f"--own {item}"), "given with --own"
        else:
            known = [name for name in CostAssumptions.model_fields if name not in ("tokens", "devices")]
            raise UserError(
                f"--own {item}: unknown key {key!r}; known: {', '.join(known)}, purchase_price_usd.PROFILE, "
                "power_kw.PROFILE"
            )
    rent = {}
    for item in prices:
        profile, value = _pair(item, "--price")
        _known_profile(profile, f"--price {item}")
        rent[profile] = _number(value, f"--price {item}")
        if rent[profile] < 0:
            raise UserError(f"--price {item}: a price cannot be negative")
    try:
        assumptions = validate(CostAssumptions, {**values, "devices": int(values["devices"])})
    except ConfigError as exc:
        raise UserError(f"cost assumptions: {exc}") from None
    return CostInputs(assumptions, rent, purchase, power, sources)


class _Hardware(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    profile: str
    price_per_device_hour_usd: float | None = Field(None, ge=0, allow_inf_nan=False)


class _Conditions(BaseModel):
    """What a record's throughput was measured under (ferry/portability/rehearsal/conditions.py); absent from records of
    a ferry that did not measure it."""

    model_config = ConfigDict(extra="allow", strict=True)

    under_load: bool | None = None
    others_busy_cores: float | None = None
    load_1m_max: float | None = None
    logical_cores: int | None = None


class _Record(BaseModel):
    """The fields of a bench record the cost arithmetic reads, with their types: strict, as the arithmetic
    reads the record's own values (a "366" or a true there is an edit, not a throughput)."""

    model_config = ConfigDict(extra="allow", strict=True)

    suite: str
    suite_digest: str
    input_digest: str
    workload_digest: str
    weights_digest: str = Field(min_length=1, description="a record without it did not start from the suite's seed")
    device: str
    nproc: int = Field(ge=1)
    tokens_per_s_per_device: float = Field(gt=0, allow_inf_nan=False)
    hardware: _Hardware
    layout: dict | None = None
    step_s: float | None = None
    comm_s: float | None = None
    comm_compute_ratio: float | None = None
    conditions: _Conditions | None = None


def read_records(paths: list[str | Path]) -> list[tuple[Path, dict]]:
    """The bench records, each checked to be one, with the fields the arithmetic needs; at least one."""
    if not paths:
        raise UserError("ferry cost needs at least one record written by `ferry bench`")
    records = []
    for path in map(Path, paths):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise UserError(f"record {str(path)!r} cannot be read as JSON: {exc}") from None
        if not isinstance(record, dict) or record.get("kind") != RECORD_KIND:
            raise UserError(f"{str(path)!r} is not a `ferry bench` record")
        if record.get("version") != RECORD_VERSION:
            raise UserError(
                f"record {str(path)!r} is version {record.get('version')!r}; this ferry reads {RECORD_VERSION}"
            )
        try:
            _Record.model_validate(record)
        except ValidationError as exc:
            raise UserError(f"record {str(path)!r}: {first_problem(exc)}") from None
        records.append((path, record))
    return records


def check_comparable(records: list[tuple[Path, dict]]) -> None:
    """Refuse records of different suites, suite definitions, input values or workloads, naming the first one."""
    first_path, first = records[0]
    for path, record in records[1:]:
        for key, what in (
            ("suite", "suite"),
            ("suite_digest", "suite definition"),
            ("input_digest", "input values"),
            ("workload_digest", "workload (model, sequence length, global batch, optimizer)"),
        ):
            if record.get(key) != first.get(key):
                raise UserError(
                    f"{path} and {first_path} differ in their {what} ({key} {str(record.get(key))[:16]} vs "
                    f"{str(first.get(key))[:16]}): records compare only on the same suite, inputs and workload"
                )


def check_overrides_used(records: list[tuple[Path, dict]], inputs: CostInputs) -> None:
    """Refuse a price or hardware figure given for a profile no record was measured on (a typo, h100 for h200):
    it would change nothing and say nothing."""
    measured = sorted({record["hardware"]["profile"] for _, record in records})
    for option, overrides in (("--price", inputs.prices), ("--own", {**inputs.purchase, **inputs.power})):
        unused = sorted(set(overrides) - set(measured))
        if unused:
            raise UserError(
                f"{option}: no record was measured on profile {unused[0]!r}; the records' profiles: "
                f"{', '.join(measured)}"
            )


def cost_record(path: Path, record: dict, inputs: CostInputs) -> dict:
    """Every figure of one record, with the prices it used."""
    assumptions = inputs.assumptions
    profile_name = record["hardware"]["profile"]
    profile = load_profile(profile_name)
    per_device = record["tokens_per_s_per_device"]
    if not per_device or per_device <= 0:
        raise UserError(f"record {path} has no positive tokens_per_s_per_device")
    tokens_per_hour = per_device * 3600.0
    recorded_rent = record["hardware"].get("price_per_device_hour_usd")
    if recorded_rent is None:  # measured where no price was known: the profile's
        recorded_rent = profile.price_per_device_hour_usd
    rent = inputs.prices.get(profile_name, recorded_rent)
    purchase = inputs.purchase.get(profile_name, profile.purchase_price_usd)
    power = inputs.power.get(profile_name, profile.power_kw)
    capex_hour = purchase * (1 + assumptions.system_share) / (assumptions.depreciation_years * HOURS_PER_YEAR)
    energy_hour = power * assumptions.pue * assumptions.electricity_usd_per_kwh
    productive_hour = capex_hour / assumptions.utilization + energy_hour
    device_hours = assumptions.tokens / tokens_per_hour
    breakeven = capex_hour / (rent - energy_hour) if rent > energy_hour else None
    return {
        "file": str(path),
        "label": record_label(record),
        "suite": record["suite"],
        "device": record["device"],
        "nproc": record["nproc"],
        "profile": profile_name,
        "measured_on_cpu": record["device"] == "cpu",
        "measured": fairness(record.get("conditions")),
        "conditions": record.get("conditions"),
        "tokens_per_s_per_device": per_device,
        "rent_usd_per_device_hour": rent,
        "usd_per_million_tokens_rent": rent / tokens_per_hour * 1e6,
        "device_hours": device_hours,
        "days_to_train": device_hours / assumptions.devices / 24.0,
        "cost_to_train_rent_usd": device_hours * rent,
        "purchase_usd_per_device": purchase,
        "power_kw_per_device": power,
        "capex_usd_per_device_hour": capex_hour,
        "energy_usd_per_device_hour": energy_hour,
        "usd_per_million_tokens_own": productive_hour / tokens_per_hour * 1e6,
        "cost_to_train_own_usd": device_hours * productive_hour,
        "breakeven_utilization": breakeven,
    }


def owned_usd_per_million_tokens(costed: dict, utilization: float) -> float:
    """The owned $/1M tokens of a costed record at another utilisation (the rent-versus-own curve)."""
    hour = costed["capex_usd_per_device_hour"] / utilization + costed["energy_usd_per_device_hour"]
    return hour / (costed["tokens_per_s_per_device"] * 3600.0) * 1e6


def scaling_view(records: list[tuple[Path, dict]]) -> list[dict]:
    """Per world size and EP degree: throughput per device against the smallest layout, and communication's
    share; empty unless the records cover more than one layout."""
    rows = []
    for path, record in records:
        layout = record.get("layout") or {}
        device_name = (record.get("environment") or {}).get("device_name") or record["device"]
        rows.append(
            {
                "file": str(path),
                "device": f"{record['hardware']['profile']} ({device_name})",
                "world_size": layout.get("world_size", record["nproc"]),
                "ep_degree": layout.get("ep_degree", 1),
                "tokens_per_s_per_device": record["tokens_per_s_per_device"],
                "comm_compute_ratio": record.get("comm_compute_ratio"),
                "comm_share_of_step": (record.get("comm_s") or 0.0) / record["step_s"]
                if record.get("step_s")
                else None,
            }
        )
    if len({(row["world_size"], row["ep_degree"]) for row in rows}) < 2:
        return []
    rows.sort(key=lambda row: (row["device"], row["world_size"], row["ep_degree"]))
    for row in rows:
        base = min((r for r in rows if r["device"] == row["device"]), key=lambda r: (r["world_size"], r["ep_degree"]))
        row["per_device_vs_smallest"] = row["tokens_per_s_per_device"] / base["tokens_per_s_per_device"]
        ratio = row["comm_compute_ratio"]
        row["communication_dominates"] = ratio is not None and ratio >= 1.0
    return rows


def record_label(record: dict) -> str:
    policy = (record.get("kernels") or {}).get("policy", "?")
    overrides = f" [{' '.join(record['overrides'])}]" if record.get("overrides") else ""
    return f"{record['hardware']['profile']} ({record['device']} x{record['nproc']}, kernels {policy}){overrides}"


def _pair(item: str, option: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key or not value:
        raise UserError(f"{option} {item!r}: write it as KEY=VALUE")
    return key.strip(), value.strip()


def _number(text: str, where: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise UserError(f"{where}: {text!r} is not a number") from None
    if not math.isfinite(value):
        raise UserError(f"{where}: {text!r} is not a finite number")
    return value


def _known_profile(name: str, where: str) -> None:
    if name not in profile_names():
        raise UserError(f"{where}: unknown hardware profile {name!r}; profiles: {', '.join(profile_names())}")

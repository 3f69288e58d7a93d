"""Load a config: YAML file, then dotted overrides, then typed validation.

`ferry train configs/tiny.yaml train.steps=50 kernels.ops."moe.grouped_mm"=portable`
reads the file, sets each dotted key (quoted segments may contain dots, integer
segments index lists) and validates the result against the schema. Every failure
becomes a `ConfigError` whose message names the file or the dotted key.
"""

from __future__ import annotations

import copy
import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from ferry.config.errors import ConfigError, UserError
from ferry.config.refusals import REFUSAL

SectionT = TypeVar("SectionT", bound=BaseModel)


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-3` as a float (YAML 1.2), as anyone writing a learning rate expects."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
    list("-+0123456789."),
)


def _load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_YamlLoader)


def load_config(
    schema: type[SectionT], path: str | Path | None, overrides: list[str] = (), base: dict | None = None
) -> SectionT:
    """Read `path` over `base` (values the file may override), apply `overrides`, validate against `schema`."""
    raw = read_yaml(Path(path)) if path is not None else {}
    raw = _merge(copy.deepcopy(base or {}), raw)
    raw = apply_overrides(raw, overrides)
    return validate(schema, raw)


def validate(schema: type[SectionT], raw: dict[str, Any]) -> SectionT:
    """Validate a plain mapping; on failure raise one `ConfigError` listing every bad key."""
    try:
        return schema.model_validate(raw)
    except ValidationError as exc:
        problems = [_describe(schema, err) for err in exc.errors()]
        raise ConfigError("invalid config:\n  " + "\n  ".join(problems)) from None


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of `raw` with every `dotted.key=value` override set."""
    result = copy.deepcopy(raw)
    for text in overrides:
        keys, value = parse_override(text)
        _set_path(result, keys, value, text)
    return result


def apply_override_mapping(raw: dict[str, Any], overrides: dict[str, Any], origin: str) -> dict[str, Any]:
    """Return a copy of `raw` with each dotted key of `overrides` set to its value, already typed (a mapping
    read from a YAML file, as an environment's `overrides:`); errors name `origin`."""
    result = copy.deepcopy(raw)
    for key, value in overrides.items():
        described = f"{key}: {value!r} in {origin}"
        _set_path(result, _split_dotted(str(key).strip(), described), copy.deepcopy(value), described)
    return result


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split `a.b."c.d"=value` into (["a", "b", "c.d"], parsed value); values are YAML scalars or lists."""
    key_text, sep, value_text = text.partition("=")
    if not sep:
        raise ConfigError(f"override {text!r} has no '=': write it as dotted.key=value")
    keys = _split_dotted(key_text.strip(), text)
    try:
        value = _load_yaml(value_text) if value_text.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({_first_line(exc)})") from None
    return keys, value


def dump_yaml(section: BaseModel) -> str:
    """The resolved config as YAML, in schema order, loadable again by `load_config`."""
    return yaml.safe_dump(section.model_dump(mode="json"), sort_keys=False)


def _merge(into: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Recursive dict update: nested mappings merge, everything else replaces."""
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value
    return into


def read_yaml(path: Path) -> dict[str, Any]:
    """A YAML file's mapping (`{}` for an empty file); a missing or unreadable file is a `ConfigError` naming it."""
    if path.is_dir():
        raise ConfigError(f"config file {str(path)!r} is a directory; give the YAML file")
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {exc}") from None
    try:
        data = _load_yaml(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {_first_line(exc)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections, not {type(data).__name__}")
    return data


def _split_dotted(key_text: str, original: str) -> list[str]:
    keys: list[str] = []
    current = ""
    quoted = False
    for char in key_text:
        if char == '"':
            quoted = not quoted
        elif char == "." and not quoted:
            keys.append(current)
            current = ""
        else:
            current += char
    keys.append(current)
    if quoted or any(not key for key in keys):
        raise ConfigError(f"override {original!r}: malformed key {key_text!r}")
    return keys


def _set_path(root: dict[str, Any], keys: list[str], value: Any, original: str) -> None:
    node: Any = root
    for depth, key in enumerate(keys[:-1]):
        child = _child(node, key, keys[: depth + 1], original)
        if child is None:
            child = {}
            _assign(node, key, child, keys[: depth + 1], original)
        node = child
    _assign(node, keys[-1], value, keys, original)


def _child(node: Any, key: str, path: list[str], original: str) -> Any:
    if isinstance(node, list):
        return node[_list_index(node, key, path, original)]
    if isinstance(node, dict):
        return node.get(key)
    raise ConfigError(f"override {original!r}: {'.'.join(path[:-1])} is a value, not a section")


def _assign(node: Any, key: str, value: Any, path: list[str], original: str) -> None:
    if isinstance(node, list):
        node[_list_index(node, key, path, original)] = value
    elif isinstance(node, dict):
        node[key] = value
    else:
        raise ConfigError(f"override {original!r}: {'.'.join(path[:-1])} is a value, not a section")


def _list_index(node: list, key: str, path: list[str], original: str) -> int:
    if not key.isdigit() or int(key) >= len(node):
        raise ConfigError(f"override {original!r}: {'.'.join(path)} needs a list index below {len(node)}, got {key!r}")
    return int(key)


def _describe(schema: type[BaseModel], err: dict[str, Any]) -> str:
    loc = [str(part) for part in err["loc"]]
    key = ".".join(loc) or "<top level>"
    if err["type"] == "extra_forbidden":
        known = _known_keys(schema, err["loc"][:-1])
        close = difflib.get_close_matches(loc[-1], known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return f"{key}: unknown key{hint} (known here: {', '.join(known)})"
    message = err["msg"]
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    if err["type"] == "missing":
        return f"{key}: required key is missing"
    if err["type"] == REFUSAL:  # a combination refused at its key: the message names the values
        return f"{key}: {message}"
    return f"{key}: {message} (got {err.get('input')!r})"


def _known_keys(schema: type[BaseModel], loc: tuple) -> list[str]:
    """Field names of the section found at `loc`, following nested models, lists and dicts."""
    annotation: Any = schema
    for part in loc:
        annotation = _unwrap(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            field = annotation.model_fields.get(str(part))
            if field is None:
                return []
            annotation = field.annotation
        else:
            args = typing.get_args(annotation)
            annotation = args[-1] if args else None
    annotation = _unwrap(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return list(annotation.model_fields)
    return []


def _unwrap(annotation: Any) -> Any:
    """Strip Optional[...] so that `X | None` is walked as X."""
    args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return annotation


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def validate_named(schema: type[SectionT], values: dict[str, tuple[str, Any]]) -> SectionT:
    """`schema` from values each given under a name of the user's (a command-line flag, a recorded setting):
    `{field: (name, value)}`; a bad value is a `UserError` naming it (`--top-p: ...`)."""
    try:
        return schema.model_validate({field: value for field, (_, value) in values.items()})
    except ValidationError as exc:
        error = exc.errors()[0]
        name = values[error["loc"][0]][0] if error["loc"] and error["loc"][0] in values else schema.__name__
        raise UserError(f"{name}: {error['msg']}") from None

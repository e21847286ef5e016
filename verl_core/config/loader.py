"""Loading a run's config: YAML, dotted overrides, one-line errors, hashing, flattening for trackers.

:func:`load_config` reads a YAML file, applies dotted overrides (``actor.lr=1e-6``) with type
coercion, and validates against :mod:`verl_core.config.schema`. Any problem raises
:class:`ConfigError` whose message names the field path, the value given and what was expected,
before any work starts; a config that runs but probably does not do what its author wants
(:func:`verl_core.config.preflight.advice`) is logged as one warning line per finding.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import logging
import re
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Union

import yaml
from pydantic import BaseModel, ValidationError

from verl_core.config.preflight import advice
from verl_core.config.schema import VerlFlowConfig
from verl_core.errors import ConfigError

log = logging.getLogger(__name__)


def canonical_json(obj: Any) -> str:
    """JSON with sorted keys and no whitespace: the input of every hash."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def config_hash(cfg: VerlFlowConfig) -> str:
    """sha256 of the canonical JSON of the resolved config (:func:`config_dump`)."""
    return hashlib.sha256(canonical_json(config_dump(cfg)).encode()).hexdigest()


def config_dump(cfg: VerlFlowConfig) -> dict[str, Any]:
    """The resolved config as JSON, without ``parent`` when it is unset: a run of its own hashes,
    records and flattens exactly as before the section existed (its run id stays the same)."""
    raw = cfg.model_dump(mode="json")
    if raw.get("parent") is None:
        raw.pop("parent", None)
    return raw


# --------------------------------------------------------------------------------------------------
# Loading and overrides


def load_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> VerlFlowConfig:
    """Read YAML at ``path`` (None: the defaults), apply ``key.sub=value`` overrides, validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {str(e).splitlines()[0]}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(
                f"{path}: expected a mapping of sections at the top, got {type(loaded).__name__}"
            )
        raw = loaded
    for item in overrides:
        apply_override(raw, item)
    cfg = validate_config(raw)
    for line in advice(cfg):
        log.warning(line)
    return cfg


def validate_config(raw: Mapping[str, Any]) -> VerlFlowConfig:
    """Validate a nested dict into the schema, turning pydantic errors into one :class:`ConfigError`."""
    try:
        return VerlFlowConfig.model_validate(dict(raw))
    except ValidationError as e:
        raise ConfigError("; ".join(_describe(err) for err in e.errors())) from None


def with_overrides(cfg: VerlFlowConfig, overrides: Iterable[str]) -> VerlFlowConfig:
    """``cfg`` with dotted overrides applied and validated again."""
    raw = cfg.model_dump(mode="json")
    for item in overrides:
        apply_override(raw, item)
    return validate_config(raw)


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Set ``a.b.c=value`` into the nested dict ``raw``; the value is parsed as YAML scalar/list,
    except for fields typed as strings, which keep the text as given."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {item!r}: expected key.path=value")
    parts = key.split(".")
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {'.'.join(parts[: i + 1])} is not a section")
        node = child
    node[parts[-1]] = _parse_value(text, _field_annotation(parts))


def _parse_value(text: str, annotation: Any) -> Any:
    if annotation is not None and _is_plain_str(annotation):
        return None if text in ("null", "~") and _allows_none(annotation) else text
    try:
        return yaml.safe_load(text) if text.strip() else text
    except yaml.YAMLError:
        return text


def _is_plain_str(annotation: Any) -> bool:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if _is_union(annotation):
        return len(args) == 1 and args[0] is str
    return annotation is str


def _allows_none(annotation: Any) -> bool:
    return _is_union(annotation) and type(None) in typing.get_args(annotation)


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (Union, types.UnionType)


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model behind a field annotation (``Model`` or ``Model | None``)."""
    candidates = typing.get_args(annotation) if _is_union(annotation) else (annotation,)
    for c in candidates:
        if isinstance(c, type) and issubclass(c, BaseModel):
            return c
    return None


def _field_annotation(parts: list[str]) -> Any:
    """Annotation of the field at a dotted path, or None when the path is unknown."""
    model: type[BaseModel] | None = VerlFlowConfig
    annotation: Any = None
    for part in parts:
        if model is None or part not in model.model_fields:
            return None
        annotation = model.model_fields[part].annotation
        model = _section_model(annotation)
    return annotation


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    model: type[BaseModel] | None = VerlFlowConfig
    for part in loc:
        if model is None or part not in model.model_fields:
            return None
        model = _section_model(model.model_fields[part].annotation)
    return model


def _describe(err: Mapping[str, Any]) -> str:
    """One line for one pydantic error: field path, value given, what was expected."""
    loc = tuple(err["loc"])
    path = ".".join(str(p) for p in loc)
    kind = err["type"]
    if kind == "extra_forbidden":
        parent = _model_at(loc[:-1])
        names = list(parent.model_fields) if parent else []
        close = difflib.get_close_matches(str(loc[-1]), names, n=1, cutoff=0.6)
        hint = f" (did you mean '{'.'.join([*map(str, loc[:-1]), close[0]])}'?)" if close else ""
        valid = f"; valid keys here: {', '.join(names)}" if names and not close else ""
        return f"unknown key '{path}'{hint}{valid}"
    if kind == "value_error" and (not path or isinstance(err.get("input"), dict)):
        # model-level cross checks already name their field
        return str(err["msg"]).removeprefix("Value error, ")
    given = err.get("input")
    if any(w in path.lower() for w in _SECRET_WORDS):
        given = "***"  # a secret, or a token pasted where its variable's name belongs (token_env)
    expected = _expected(err)
    return f"{path}: got {given!r}, expected {expected}"


def _expected(err: Mapping[str, Any]) -> str:
    kind, ctx = err["type"], err.get("ctx") or {}
    if kind == "literal_error":
        return f"one of {ctx.get('expected')}"
    if kind in ("float_parsing", "float_type"):
        return "a number"
    if kind in ("int_parsing", "int_type", "int_from_float"):
        return "an integer"
    if kind in ("bool_parsing", "bool_type"):
        return "true or false"
    if kind in ("string_type",):
        return "a string"
    if kind in ("list_type",):
        return "a list"
    if kind in ("model_type", "dict_type", "model_attributes_type"):
        return "a mapping (section)"
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        op = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}[
            kind
        ]
        bound = next(iter(ctx.values()), "?")
        return f"a value {op} {bound}"
    return str(err["msg"]).removeprefix("Value error, ")


def to_yaml(cfg: VerlFlowConfig) -> str:
    """The resolved config as YAML (section order as in the schema)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


# --------------------------------------------------------------------------------------------------
# Flattening for trackers

_SECRET_WORDS = ("password", "secret", "token", "credential", "access_key", "api_key")


def flatten_config(cfg: VerlFlowConfig) -> dict[str, str]:
    """``{"actor.lr": "1e-06", ...}`` with secrets redacted: any key naming a secret (but not a
    ``*_env`` key, which holds the NAME of the variable with the secret), and the user:password part
    of URLs."""
    out: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
            return
        text = json.dumps(value) if isinstance(value, list) else str(value)
        if any(w in prefix.lower() for w in _SECRET_WORDS) and not prefix.endswith("_env"):
            text = "***"
        out[prefix] = redact_url(text)

    walk("", config_dump(cfg))
    return out


def redact_url(text: str) -> str:
    """Replace ``scheme://user:pass@host`` credentials with ``***``."""
    return re.sub(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]+@", r"\g<scheme>***@", text)

"""Loading a run's config: YAML, dotted overrides, one-line errors, flattening for trackers.

:func:`load_config` reads a YAML file, applies dotted overrides (``actor.lr=1e-6``) with type
coercion, and validates against :mod:`verl_core.config.schema`. Any problem raises
:class:`ConfigError` whose message names the field path, the value given and what was expected,
before any work starts; a config that runs but probably does not do what its author wants
(:func:`verl_core.config.preflight.advice`) is logged as one warning line per finding.
"""

from __future__ import annotations

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

from verl_core.config import verl_names, verl_translate
from verl_core.config.preflight import advice
from verl_core.config.schema import VerlFlowConfig, config_dump
from verl_core.errors import ConfigError

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------
# Loading and overrides


def load_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> VerlFlowConfig:
    """Read YAML at ``path`` (None: the defaults), apply ``key.sub=value`` overrides, validate.
    Keys in verl's form are translated (:mod:`.verl_names`), each translation logged in one line."""
    cfg, notes = load_config_notes(path, overrides)
    for line in notes:
        log.info(line)
    return cfg


def load_config_notes(
    path: str | Path | None = None, overrides: Iterable[str] = ()
) -> tuple[VerlFlowConfig, list[str]]:
    """:func:`load_config` and its notes: one line per verl key translated (``verl key X → Y``), and
    which of trainer.total_iterations / trainer.total_epochs ends the run when both are given."""
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
    named = set(_leaf_paths(raw))
    pairs = _verl_leaves(raw) + [_split(item) for item in overrides]
    notes, applied = _apply_pairs(raw, pairs)
    notes += _run_length(named | applied, raw)
    cfg = validate_config(raw)
    for line in advice(cfg):
        log.warning(line)
    return cfg, notes


def validate_config(raw: Mapping[str, Any]) -> VerlFlowConfig:
    """Validate a nested dict into the schema, turning pydantic errors into one :class:`ConfigError`."""
    try:
        return VerlFlowConfig.model_validate(dict(raw))
    except ValidationError as e:
        raise ConfigError("; ".join(_describe(err) for err in e.errors())) from None


def with_overrides(cfg: VerlFlowConfig, overrides: Iterable[str]) -> VerlFlowConfig:
    """``cfg`` with dotted overrides (ours or verl's names) applied and validated again."""
    raw = cfg.model_dump(mode="json")
    for line in _apply_pairs(raw, [_split(item) for item in overrides])[0]:
        log.info(line)
    return validate_config(raw)


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Set ``a.b.c=value`` into the nested dict ``raw``; the value is parsed as YAML scalar/list,
    except for fields typed as strings, which keep the text as given."""
    key, text = _split(item)
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


def _split(item: str) -> tuple[str, str]:
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {item!r}: expected key.path=value")
    return key, text


# --------------------------------------------------------------------------------------------------
# verl's names (verl_core.config.verl_names) and the run's length


def is_our_key(key: str) -> bool:
    """Whether the dotted ``key`` is a field (or section) of the schema."""
    return _field_annotation(key.split(".")) is not None


def _apply_pairs(raw: dict[str, Any], pairs: list[tuple[str, str]]) -> tuple[list[str], set[str]]:
    """Apply ``(key, text)`` pairs, verl's names translated; a dropped or unknown key is an error (all
    of them at once, one per line). Returns the translation lines and our keys set."""
    settings, made, unknown = verl_translate.translate(pairs, is_our_key)
    errors = [t.line().replace("verl key ", "", 1) for t in made if t.dropped]
    for key in unknown:  # a path through a field that is no section: the override's own error
        parts = key.split(".")
        if any(is_our_key(".".join(parts[:i])) for i in range(1, len(parts))):
            apply_override(raw, f"{key}={dict(pairs)[key]}")
    errors += [unknown_key_message(key) for key in unknown]
    if errors:
        raise ConfigError("\n".join(errors))
    for key, text in settings:
        apply_override(raw, f"{key}={text}")
    return [t.line() for t in made], {key for key, _ in settings}


def _leaf_paths(node: Mapping[str, Any], prefix: str = "") -> list[str]:
    out: list[str] = []
    for k, v in node.items():
        path = f"{prefix}{k}"
        out += _leaf_paths(v, path + ".") if isinstance(v, dict) else [path]
    return out


def _verl_leaves(raw: dict[str, Any], prefix: str = "") -> list[tuple[str, str]]:
    """Remove from ``raw`` the leaves that are not our keys (verl's names, or unknown) and return them
    as ``(dotted key, value text)``, to be translated as overrides are."""
    out: list[tuple[str, str]] = []
    for k in list(raw):
        path, v = f"{prefix}{k}", raw[k]
        if is_our_key(path):
            if isinstance(v, dict) and _section_model(_field_annotation(path.split("."))) is not None:
                out += _verl_leaves(v, path + ".")
            continue
        del raw[k]
        out += _flat(v, path)
    return out


def _flat(value: Any, path: str) -> list[tuple[str, str]]:
    if isinstance(value, dict):
        return [pair for k, v in value.items() for pair in _flat(v, f"{path}.{k}")]
    return [(path, value if isinstance(value, str) else json.dumps(value))]


def _run_length(named: set[str], raw: Mapping[str, Any]) -> list[str]:
    """trainer.total_epochs alone is refused: verl-flow's run length is trainer.total_iterations (a
    default of 20), which epochs only cap; both given: one line says how they combine."""
    if "trainer.total_epochs" not in named:
        return []
    trainer = raw.get("trainer", {})
    if "trainer.total_iterations" not in named:
        raise ConfigError(
            f"trainer.total_epochs={trainer.get('total_epochs')} alone does not set the run's length here: "
            "set trainer.total_iterations too (verl's length is total_epochs x the batches per epoch, "
            "rows // data.train_batch_size; verl-flow from-verl computes it when it can read the train files)"
        )
    return [
        f"trainer.total_iterations={trainer.get('total_iterations')} and trainer.total_epochs="
        f"{trainer.get('total_epochs')} are both given: the run stops at whichever comes first (as verl "
        "with total_training_steps)"
    ]


def _what_becomes(verl_key: str) -> str:
    why = verl_names.DROPPED.get(verl_key) or verl_names.DROPPED.get(verl_key + ".")
    if why:
        return f"verl-flow has no such key: {why}"
    if verl_key in verl_names.RENAMED:
        return f"here it is {verl_names.RENAMED[verl_key]}"
    return "verl-flow translates it, see verl-flow config show"


def unknown_key_message(key: str) -> str:
    """``unknown key 'PATH'`` at the first level the schema does not have, with a suggestion that
    never crosses a known confusion (:func:`.verl_translate.suggest`): our key at that level, else a verl
    key of the translation table; without one, the valid keys there."""
    parts = key.split(".")
    model: type[BaseModel] | None = VerlFlowConfig
    depth = 0
    while depth < len(parts) and model is not None and parts[depth] in model.model_fields:
        model = _section_model(model.model_fields[parts[depth]].annotation)
        depth += 1
    here = parts[: depth + 1]
    verl_only = depth == 0 and any(k.startswith(parts[0] + ".") for k in verl_translate.known_verl_keys())
    path = key if verl_only else ".".join(here)
    names = list(model.model_fields) if model is not None else []
    ours = [".".join([*here[:-1], n]) for n in names]
    close = verl_translate.suggest(path, ours)
    if close is not None:
        return f"unknown key '{path}' (did you mean '{close}'?)"
    known = verl_translate.known_verl_keys()
    close = next(
        filter(None, (verl_translate.suggest(f, known) for f in verl_translate.verl_forms(key))), None
    )
    if close is not None:
        return f"unknown key '{path}' (did you mean verl's '{close}'? {_what_becomes(close)})"
    valid = f"; valid keys here: {', '.join(names)}" if names and not verl_only else ""
    where = "; not in verl-flow's table of verl names (docs/coming_from_verl.md)" if verl_only else ""
    return f"unknown key '{path}'{where}{valid}"


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


def _describe(err: Mapping[str, Any]) -> str:
    """One line for one pydantic error: field path, value given, what was expected."""
    loc = tuple(err["loc"])
    path = ".".join(str(p) for p in loc)
    kind = err["type"]
    if kind == "extra_forbidden":
        return unknown_key_message(path)
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

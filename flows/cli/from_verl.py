"""``verl-flow from-verl SCRIPT|- [-o OUT.yaml]``: a verl launch command as a verl-flow config.

Reads a shell script that runs ``python3 -m verl.trainer.main_ppo`` with Hydra overrides (lines joined
at a trailing backslash, ``VAR=...`` / ``export VAR=...`` assignments and ``$VAR``, ``${VAR}``,
``${VAR:-default}`` references expanded from the script, then the environment), or the bare overrides
(``-`` reads stdin). Each verl key goes through the alias table (:mod:`verl_core.config.verl_names`);
verl's defaults that differ from ours (:data:`VERL_DEFAULTS`) and what verl's trainer implies
(:data:`IMPLIED`) are added. The YAML holds the settings only (our defaults fill the rest); the table
names each verl key, what it became, or why it was dropped. Skipped: other commands of the script,
``$(...)``, Hydra's ``--config-name`` / ``~key`` / ``hydra.*``, the script's ``$@``; each is listed.

verl's run length (``trainer.total_epochs`` × batches per epoch, each of ``data.train_batch_size``
prompts, the last partial one dropped) is computed from the row count of the training files when
they can be read; otherwise the table says to set ``trainer.total_iterations``.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from rich.table import Table
from rich.text import Text

from verl_core.config.loader import (
    apply_override,
    is_our_key,
    load_config_notes,
    unknown_key_message,
    validate_config,
)
from verl_core.config.verl_translate import Translation, translate
from verl_core.errors import ConfigError

# verl's defaults (its ppo_trainer.yaml) where ours differ and the difference changes the run (the
# machine's size, trainer.n_gpus_per_node, is not: it is where the converted config runs)
VERL_DEFAULTS: dict[str, str] = {
    "algorithm.adv_estimator": "gae",
    "actor_rollout_ref.rollout.n": "1",
    "data.train_batch_size": "1024",
    "data.max_prompt_length": "512",
    "data.max_response_length": "512",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "256",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "16384",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": "16384",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": "16384",
    "critic.ppo_max_token_len_per_gpu": "32768",
    "trainer.save_freq": "-1",
    "trainer.test_freq": "-1",
    "trainer.total_epochs": "30",
    "trainer.project_name": "verl_examples",
    "trainer.experiment_name": "gsm8k",
}

# what verl's PPO trainer does that verl-flow has a setting for: (our key, value, why)
IMPLIED: tuple[tuple[str, str, str], ...] = (
    ("sft.enable", "false", "verl's main_ppo has no SFT warm-up"),
    ("data.source", "parquet", "verl reads Parquet rows in its schema (prompt messages, reward_model)"),
)

_MODULE = re.compile(r"verl\.trainer\.main_ppo\b")
_VAR = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)")
_ASSIGN = re.compile(r"^[A-Za-z_]\w*=")


@dataclass
class Launch:
    """A verl launch command read: the overrides in order, and what was skipped (with why)."""

    overrides: list[tuple[str, str]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def parse_launch(text: str, environ: dict[str, str] | None = None) -> Launch:
    """The overrides of a verl launch script, or of bare ``key=value`` overrides."""
    env = dict(os.environ if environ is None else environ)
    out = Launch()
    lines = re.sub(r"\\\r?\n", " ", text).splitlines()
    has_command = any(_MODULE.search(line) for line in lines)
    for raw in lines:
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if "$(" in line or "`" in line:
            out.skipped.append(f"{_short(line)}: command substitution is not run")
            line = re.sub(r"\$\([^)]*\)|`[^`]*`", "", line)
        try:
            tokens = shlex.split(_expand(line, env, out), comments=True)
        except ValueError as e:
            out.skipped.append(f"{_short(line)}: not parsed ({e})")
            continue
        words = tokens[1:] if tokens[:1] == ["export"] else tokens
        if words and all(_ASSIGN.match(w) for w in words):  # NAME=value ...: the script's variables
            env.update(w.split("=", 1) for w in words)
            continue
        if has_command and not _MODULE.search(line):
            out.skipped.append(f"{_short(line)}: not verl's trainer command")
            continue
        if has_command:
            start = next(i for i, t in enumerate(tokens) if _MODULE.search(t))
            launcher = [t for t in tokens[:start] if t != "-m" and not re.search(r"python[\d.]*$", t)]
            if launcher:
                out.skipped.append(f"{' '.join(launcher)}: words before the trainer module (not config)")
            tokens = tokens[start + 1 :]
        for token in tokens:
            _take(token, out)
    return out


def _take(token: str, out: Launch) -> None:
    key, sep, value = token.partition("=")
    if token in ("$@", '"$@"', "$*"):
        out.skipped.append(f"{token}: the script's extra arguments (append them to this command's output)")
    elif not sep or "." not in key or key.startswith("-"):
        out.skipped.append(f"{token}: not a key=value override (a Hydra option or a shell word)")
    elif key.startswith("~") or key.startswith("hydra."):
        out.skipped.append(f"{token}: Hydra's own syntax (deletion, hydra.*) has no counterpart")
    else:
        out.overrides.append((key.lstrip("+"), value))


def _expand(text: str, env: dict[str, str], out: Launch) -> str:
    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(3)
        if name in env:
            return env[name]
        if m.group(2) is not None:
            return _expand(m.group(2), env, out)
        out.skipped.append(f"${name}: not set in the script or the environment (kept as written)")
        return m.group(0)

    return _VAR.sub(sub, text.replace("$@", "\0")).replace("\0", "$@")


def _short(line: str) -> str:
    return line if len(line) <= 60 else line[:57] + "..."


# --------------------------------------------------------------------------------------------------
# Conversion


@dataclass
class Row:
    """One line of the table: a verl key, its value, what it became (or why it was dropped)."""

    verl_key: str
    value: str
    became: str
    dropped: bool = False


@dataclass
class Converted:
    """The config's settings (a nested dict for YAML), the table, and what was skipped."""

    settings: dict[str, Any]
    rows: list[Row]
    skipped: list[str]


def convert(launch: Launch) -> Converted:
    """verl's overrides (with verl's differing defaults when not given) → our settings and the table."""
    given = dict(launch.overrides)
    defaults = [(k, v) for k, v in VERL_DEFAULTS.items() if k not in given and not _alias_given(k, given)]
    pairs = defaults + launch.overrides
    settings, made, unknown = translate(pairs, is_our_key)
    by_key = {t.verl_key: t for t in made}
    rows: list[Row] = []
    for key, value in pairs:
        origin = " (verl's default)" if (key, value) in defaults and key not in given else ""
        rows.append(_row(key, value, by_key.get(key), key in unknown, origin))
    for key, value, why in IMPLIED:
        settings.insert(0, (key, value))
        rows.append(Row("", "", f"{key}={value} ({why})"))
    settings, length_row = _run_length(settings)
    rows.append(length_row)
    raw: dict[str, Any] = {}
    for key, value in settings:
        apply_override(raw, f"{key}={value}")
    return Converted(_typed(raw), rows, launch.skipped)


def _typed(raw: dict[str, Any]) -> dict[str, Any]:
    """The settings' scalars with the schema's types (``lr: 1e-6`` is a string to YAML, a float here),
    when they validate; as given otherwise (the command then prints what does not)."""
    try:
        resolved = validate_config(raw).model_dump(mode="json")
    except ConfigError:
        return raw

    def pick(node: dict[str, Any], full: dict[str, Any]) -> dict[str, Any]:
        return {
            k: pick(v, full[k]) if isinstance(v, dict) else v if isinstance(v, list) else full[k]
            for k, v in node.items()
        }

    return pick(raw, resolved)


def _alias_given(verl_key: str, given: dict[str, str]) -> bool:
    """A default of verl is not added when the script sets the same setting under our name."""
    short = verl_key.removeprefix("actor_rollout_ref.")
    return short in given


def _row(key: str, value: str, t: Translation | None, unknown: bool, origin: str) -> Row:
    if unknown:
        return Row(key, value, f"dropped: {unknown_key_message(key)}", dropped=True)
    if t is None:
        return Row(key, value, f"same key{origin}")
    if t.dropped:
        return Row(key, value, f"dropped: {t.note}", dropped=True)
    became = ", ".join(f"{k}={v}" for k, v in t.settings) or "nothing to set"
    return Row(key, value, became + (f" ({t.note})" if t.note else "") + origin)


def _run_length(settings: list[tuple[str, str]]) -> tuple[list[tuple[str, str]], Row]:
    """verl's iterations: total_training_steps when given, else epochs × ⌊rows / train_batch_size⌋."""
    ours = dict(settings)
    epochs = ours.get("trainer.total_epochs", "30")
    if "trainer.total_iterations" in ours:
        return settings, Row("", "", "trainer.total_iterations from verl's total_training_steps")
    files = yaml.safe_load(ours.get("data.train_files", "[]")) or []
    batch = int(ours.get("data.train_batch_size", "1024"))
    try:
        import pyarrow.parquet as pq

        rows = sum(pq.ParquetFile(os.path.expanduser(str(f))).metadata.num_rows for f in files)
    except (OSError, ValueError, ImportError) as e:
        why = f"the training files could not be read ({type(e).__name__})" if files else "no training files"
        return settings, Row(
            "", "", f"set trainer.total_iterations yourself: {why}; verl runs {epochs} x rows // {batch}"
        )
    if not files:
        return settings, Row("", "", "set trainer.total_iterations yourself: no training files")
    iterations = int(epochs) * (rows // batch)
    if iterations < 1:
        return settings, Row(
            "", "", f"set trainer.total_iterations yourself: {rows} rows < one batch of {batch}"
        )
    row = Row(
        "", "", f"trainer.total_iterations={iterations} ({epochs} epochs x {rows} rows // {batch}, as verl)"
    )
    return [*settings, ("trainer.total_iterations", str(iterations))], row


# --------------------------------------------------------------------------------------------------
# The command


def from_verl_cmd(
    script: Annotated[
        str, typer.Argument(help="verl launch script (shell), or - to read overrides from stdin")
    ],
    output: Annotated[
        str | None,
        typer.Option("--output", "-o", help="Write the YAML here (default: stdout, table on stderr)"),
    ] = None,
) -> None:
    """Convert a verl launch command (python3 -m verl.trainer.main_ppo KEY=VALUE ...) to a verl-flow config.

    Prints a table: each verl key, what it became, or why it was dropped."""
    from flows.cli.common import err, fail, out, print_table

    text = sys.stdin.read() if script == "-" else _read(script)
    converted = convert(parse_launch(text))
    header = f"# converted by verl-flow from-verl from {script if script != '-' else 'stdin'}\n"
    body = header + yaml.safe_dump(converted.settings, sort_keys=False)
    if output:
        Path(output).write_text(body)
    else:
        sys.stdout.write(body)
    table = Table("verl key", "value", "verl-flow", title="from verl")
    for r in converted.rows:
        cells = (Text(r.verl_key), Text(r.value), Text(r.became))
        table.add_row(*cells, style="yellow" if r.dropped else None)
    console = out if output else err
    if output:
        print_table(table)
    else:
        console.print(table)
    for line in converted.skipped:
        console.print(f"skipped: {line}", markup=False, highlight=False)
    try:
        _check(body, output)
    except ConfigError as e:
        console.print("the converted config does not load yet:", markup=False, highlight=False)
        fail(e, 2, one_line=False)
    if output:
        console.print(f"run it: verl-flow run {output}", markup=False, highlight=False)


def _check(body: str, output: str | None) -> None:
    """Load the converted config as ``verl-flow run`` would (the run-length rule included)."""
    import tempfile

    if output:
        load_config_notes(output)
        return
    with tempfile.TemporaryDirectory() as d:
        path = Path(d, "converted.yaml")
        path.write_text(body)
        load_config_notes(path)


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as e:
        from flows.cli.common import fail

        fail(f"{path}: {e.strerror}", 1)

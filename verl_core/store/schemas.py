"""The pyarrow schema of every tabular artifact kind: the contract between stages.

A stage writes a table as one of these kinds; the store refuses a table that does not match, and a
reader checks the file it reads against the same schema. Token ids are ``list<int32>``, per-token
floats ``list<float32>``, masks ``list<int8>``. Register a new kind here (one place to read them all).

A field registered as optional (``register_schema(..., optional=...)``) was added to its kind after
files of it were written: a file without it still reads (the reader finds no such column), and a
table written without it gets a column of nulls. Every other field is required, exactly typed.
"""

from __future__ import annotations

import pyarrow as pa

from verl_core.errors import ArtifactSchemaError

_SCHEMAS: dict[str, pa.Schema] = {}
_OPTIONAL: dict[str, frozenset[str]] = {}

TOKEN_IDS = pa.list_(pa.int32())
TOKEN_FLOATS = pa.list_(pa.float32())
TOKEN_MASK = pa.list_(pa.int8())


def register_schema(kind: str, schema: pa.Schema, optional: tuple[str, ...] = ()) -> pa.Schema:
    """Register ``schema`` under ``kind``, its fields ``optional`` (module doc) nullable; registering
    the same kind twice with another schema fails."""
    old = _SCHEMAS.get(kind)
    if old is not None and not (old.equals(schema) and _OPTIONAL[kind] == frozenset(optional)):
        raise ValueError(f"artifact kind {kind!r} is already registered with another schema")
    unknown = sorted(set(optional) - set(schema.names))
    if unknown:
        raise ValueError(f"artifact kind {kind!r}: optional field(s) {', '.join(unknown)} not in its schema")
    _SCHEMAS[kind] = schema
    _OPTIONAL[kind] = frozenset(optional)
    return schema


def get_schema(kind: str) -> pa.Schema:
    """The registered schema of ``kind``; the error lists the known kinds."""
    try:
        return _SCHEMAS[kind]
    except KeyError:
        raise ArtifactSchemaError(
            f"unknown artifact kind {kind!r}; known kinds: {', '.join(sorted(_SCHEMAS))}"
        ) from None


def artifact_kinds() -> list[str]:
    """All registered kinds, sorted."""
    return sorted(_SCHEMAS)


def conform(table: pa.Table, kind: str, where: str) -> pa.Table:
    """Return ``table`` with exactly the schema of ``kind`` (columns reordered, safe casts only), or
    raise :class:`ArtifactSchemaError` naming ``where``, the field and what was expected."""
    schema = get_schema(kind)
    for name in sorted(_OPTIONAL[kind] - set(table.column_names)):  # a column of nulls
        table = table.append_column(schema.field(name), pa.nulls(table.num_rows, schema.field(name).type))
    names = set(table.column_names)
    missing = [f.name for f in schema if f.name not in names]
    extra = sorted(names - set(schema.names))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing field(s) {', '.join(missing)}")
        if extra:
            parts.append(f"unexpected field(s) {', '.join(extra)}")
        raise ArtifactSchemaError(f"{where}: table is not a {kind!r} artifact: {'; '.join(parts)}")
    table = table.select(schema.names)
    for field in schema:
        got = table.schema.field(field.name).type
        if got.equals(field.type):
            continue
        try:
            col = table.column(field.name).cast(field.type, safe=True)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            raise ArtifactSchemaError(
                f"{where}: field {field.name!r} of a {kind!r} artifact has type {got}, expected {field.type}"
            ) from None
        table = table.set_column(table.schema.get_field_index(field.name), field, col)
    return table.cast(schema)


def check_schema(actual: pa.Schema, kind: str, where: str) -> None:
    """Raise :class:`ArtifactSchemaError` unless a file's schema is exactly the kind's schema, or that
    schema without some of its optional fields."""
    expected = get_schema(kind)
    if actual.remove_metadata().equals(expected.remove_metadata()):
        return
    absent = [f.name for f in expected if f.name not in actual.names and f.name in _OPTIONAL[kind]]
    if absent:
        without = pa.schema([f for f in expected if f.name not in absent])
        if actual.remove_metadata().equals(without.remove_metadata()):
            return
    for field in expected:
        idx = actual.get_field_index(field.name)
        if idx < 0 and field.name in _OPTIONAL[kind]:
            continue
        if idx < 0:
            raise ArtifactSchemaError(f"{where}: {kind!r} artifact lacks field {field.name!r}")
        if not actual.field(idx).type.equals(field.type):
            raise ArtifactSchemaError(
                f"{where}: field {field.name!r} has type {actual.field(idx).type}, expected {field.type}"
            )
    extra = sorted(set(actual.names) - set(expected.names))
    raise ArtifactSchemaError(f"{where}: {kind!r} artifact has unexpected field(s) {', '.join(extra)}")


# --------------------------------------------------------------------------------------------------
# Kinds. verl's prompt schema is kept exactly, so verl users' parquet files work as-is.

CHAT_MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
# verl's extra_info of a prompt row (its gsm8k preprocessing writes these four)
EXTRA_INFO = pa.struct(
    [("split", pa.string()), ("index", pa.int64()), ("answer", pa.string()), ("question", pa.string())]
)

register_schema(
    "prompts",
    pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", CHAT_MESSAGES),
            ("ability", pa.string()),
            ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
            ("extra_info", EXTRA_INFO),
        ]
    ),
)

register_schema(
    "sft",
    pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", CHAT_MESSAGES),
            ("response", pa.string()),
            ("index", pa.int64()),
        ]
    ),
)

register_schema(
    "metrics",
    pa.schema([("step", pa.int64()), ("name", pa.string()), ("value", pa.float64())]),
)

# Tokenized data (template_pack stage). ``index`` is ``extra_info.index`` of the prompt row it came
# from; ``prompt_text`` the rendered chat prompt (generation prompt included); ``extra_info`` the prompt
# row's, carried to the rollouts (a custom reward function gets it, as in verl; optional: files
# written before it have none).
register_schema(
    "prompt_tokens",
    pa.schema(
        [
            ("index", pa.int64()),
            ("data_source", pa.string()),
            ("ability", pa.string()),
            ("prompt", CHAT_MESSAGES),
            ("prompt_text", pa.string()),
            ("ground_truth", pa.string()),
            ("input_ids", TOKEN_IDS),
            ("extra_info", EXTRA_INFO),
        ]
    ),
    optional=("extra_info",),
)

# SFT sequences: prompt ids then response ids + end-of-turn id; loss_mask is 1 on the response part.
register_schema(
    "sft_tokens",
    pa.schema(
        [
            ("index", pa.int64()),
            ("data_source", pa.string()),
            ("input_ids", TOKEN_IDS),
            ("loss_mask", TOKEN_MASK),
            ("prompt_length", pa.int32()),
        ]
    ),
)

# Rollouts of one RL iteration (rollout stage): one row per sample, ordered by (group_id,
# sample_index). ``group_id`` is the prompt's position in the iteration's batch (GRPO groups);
# ``prompt_index`` the prompt row's ``index`` in the prompt set. ``logprobs`` are the engine's
# behaviour log-probs of the response tokens (see verl_core.rollout.base).
# Multi-turn rows (verl_core.rollout.multi_turn): ``response_ids`` are all segments, model and tool;
# ``loss_mask`` is 1 on model tokens, 0 on tool tokens (logprobs 0 there); ``turns`` the segments in
# order (their ids concatenate to ``response_ids``; tool segments list the calls they answer);
# ``response_text`` is the last model turn's text (what the reward scores); ``response_length``
# counts model tokens only (tool tokens are not the policy's: response-length metrics exclude them).
# Single-turn rows have null ``loss_mask`` (every response token is the model's) and null ``turns``.
# ``extra_info``: the prompt row's (``prompt_tokens``; optional, null where the prompts had none).
TOOL_CALLS = pa.list_(
    pa.struct(
        [
            ("name", pa.string()),
            ("arguments", pa.string()),
            ("result", pa.string()),
            ("error", pa.string()),
            ("latency_s", pa.float64()),
        ]
    )
)
TURNS = pa.list_(
    pa.struct([("role", pa.string()), ("text", pa.string()), ("ids", TOKEN_IDS), ("calls", TOOL_CALLS)])
)
register_schema(
    "rollouts",
    pa.schema(
        [
            ("iteration", pa.int64()),
            ("group_id", pa.int64()),
            ("sample_index", pa.int32()),
            ("prompt_index", pa.int64()),
            ("data_source", pa.string()),
            ("ground_truth", pa.string()),
            ("prompt_text", pa.string()),
            ("prompt_ids", TOKEN_IDS),
            ("response_ids", TOKEN_IDS),
            ("response_text", pa.string()),
            ("logprobs", TOKEN_FLOATS),
            ("finish_reason", pa.string()),
            ("prompt_length", pa.int32()),
            ("response_length", pa.int32()),
            ("policy_version", pa.int64()),
            ("is_baseline", pa.bool_()),
            ("loss_mask", TOKEN_MASK),
            ("turns", TURNS),
            ("extra_info", EXTRA_INFO),
        ]
    ),
    optional=("extra_info",),
)

# Rewards of one iteration (reward stage): row i scores row i of the rollouts table.
# ``components``: each scorer's weighted contribution (name → value); ``extracted_answer`` is null
# when no answer could be extracted; ``correct`` is the accuracy flag.
register_schema(
    "rewards",
    pa.schema(
        [
            ("group_id", pa.int64()),
            ("sample_index", pa.int32()),
            ("score", pa.float32()),
            ("components", pa.map_(pa.string(), pa.float32())),
            ("extracted_answer", pa.string()),
            ("correct", pa.bool_()),
        ]
    ),
)

# Dynamic sampling's decision on one generation batch (reward stage iter-XXXX/reward/gen-K), row i ↔
# row i of its rewards: the filter metric's value and whether the row trains (its group's samples
# disagree and the iteration still wanted a group); dropped rows stay in the artifacts, marked.
register_schema(
    "group_filter",
    pa.schema(
        [
            ("group_id", pa.int64()),
            ("sample_index", pa.int32()),
            ("value", pa.float32()),
            ("kept", pa.bool_()),
        ]
    ),
)

# Per-sample results of one PPO update (ppo_update stage), row i ↔ row i of the rollouts table:
# the outcome score and the per-response-token advantages, returns and KL (empty without KL), and
# the trainer's recomputed log-probs π_old of the response tokens (optional: older files have none).
register_schema(
    "update",
    pa.schema(
        [
            ("group_id", pa.int64()),
            ("sample_index", pa.int32()),
            ("score", pa.float32()),
            ("advantages", TOKEN_FLOATS),
            ("returns", TOKEN_FLOATS),
            ("kl", TOKEN_FLOATS),
            ("old_log_probs", TOKEN_FLOATS),
        ]
    ),
    optional=("old_log_probs",),
)

# Rescore comparison (``rescore/NAME/report``, verl_core.reward.compare): one row per rescored table
# (``source``: the original stage and file, e.g. ``iter-0003/reward``, ``iter-0003/val/sampled``,
# ``eval/export-iter-0002/greedy``; ``split``: train | val | val/sampled | eval/greedy | eval/sampled;
# ``iteration`` -1 for eval), old vs new mean score and accuracy, the agreement rate of the correct
# flags and their confusion (tt: correct in both, tf: old only, ft: new only, ff: neither).
register_schema(
    "reward_comparison",
    pa.schema(
        [
            ("source", pa.string()),
            ("split", pa.string()),
            ("iteration", pa.int64()),
            ("rows", pa.int64()),
            ("score_old_mean", pa.float64()),
            ("score_new_mean", pa.float64()),
            ("accuracy_old", pa.float64()),
            ("accuracy_new", pa.float64()),
            ("agreement", pa.float64()),
            ("tt", pa.int64()),
            ("tf", pa.int64()),
            ("ft", pa.int64()),
            ("ff", pa.int64()),
            ("scores_changed", pa.int64()),
        ]
    ),
)

# The samples where old and new rewards disagree most (flipped correct flag first, then |new - old|),
# a few per rescored table; ``source``/``split``/``iteration`` as in "reward_comparison".
register_schema(
    "reward_disagreements",
    pa.schema(
        [
            ("source", pa.string()),
            ("split", pa.string()),
            ("iteration", pa.int64()),
            ("group_id", pa.int64()),
            ("sample_index", pa.int32()),
            ("data_source", pa.string()),
            ("prompt_text", pa.string()),
            ("response_text", pa.string()),
            ("ground_truth", pa.string()),
            ("score_old", pa.float32()),
            ("score_new", pa.float32()),
            ("correct_old", pa.bool_()),
            ("correct_new", pa.bool_()),
            ("extracted_old", pa.string()),
            ("extracted_new", pa.string()),
            ("abs_diff", pa.float32()),
        ]
    ),
)

# The gate's paired results (``gate`` stage): one row per held-out prompt, both policies' greedy
# correctness on it (``champion_correct`` null when there is no champion yet).
register_schema(
    "gate_pairs",
    pa.schema(
        [
            ("prompt_index", pa.int64()),
            ("data_source", pa.string()),
            ("prompt_text", pa.string()),
            ("champion_correct", pa.bool_()),
            ("challenger_correct", pa.bool_()),
        ]
    ),
)

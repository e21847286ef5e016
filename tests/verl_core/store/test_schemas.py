"""Optional fields of an artifact kind (verl_core.store.schemas): the rollouts' ``extra_info``, added
after rollouts files were written, must not make those files unreadable."""

from __future__ import annotations

import pyarrow as pa
import pytest

from verl_core.errors import ArtifactSchemaError
from verl_core.store.schemas import check_schema, conform, get_schema


def test_a_file_without_an_optional_field_reads_and_a_table_without_it_gets_nulls() -> None:
    schema = get_schema("rollouts")
    old = pa.schema([f for f in schema if f.name != "extra_info"])  # a file written before extra_info
    check_schema(old, "rollouts", "old.parquet")  # accepted
    for kind in ("rollouts", "prompt_tokens"):  # a required field missing still fails
        fields = get_schema(kind)
        without = pa.schema([f for f in fields if f.name not in ("extra_info", "prompt_text")])
        with pytest.raises(ArtifactSchemaError, match="lacks field 'prompt_text'"):
            check_schema(without, kind, "bad.parquet")
    table = conform(old.empty_table(), "rollouts", "t")  # written without it: a column of nulls
    assert table.schema.equals(schema) and table.column("extra_info").null_count == 0  # 0 rows
    one = pa.Table.from_pylist([{"group_id": 1}], schema=old)
    assert conform(one, "rollouts", "t").column("extra_info").to_pylist() == [None]

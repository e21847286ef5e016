"""browse.queries on a real finished run (tests/browse/conftest.py) and on a run "mixed" made here
from its rollouts with rewards cycling 0, 0.5, 1 (three reward levels for the range filters). Every
answer is checked against the Parquet files read directly with pyarrow, found through the committed
manifests."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from browse import derived
from browse.garbled import garbled_reason
from browse.queries import SAMPLE_COLUMNS, TOKEN_COLUMNS, Catalog, SampleFilter
from browse.sql import mismatch_stats
from tests.browse.conftest import BrowseRun
from verl_core.store import ArtifactStore

MIXED = "mixed"


@pytest.fixture(scope="module")
def catalog(browse_run: BrowseRun) -> Catalog:
    store = ArtifactStore(str(browse_run.store))
    if MIXED not in store.list_runs():
        _make_mixed(store, browse_run.run_id)
    return Catalog(str(browse_run.store))


def _make_mixed(store: ArtifactStore, source: str) -> None:
    """Run MIXED: iteration 0's rollouts of ``source`` with rewards cycling 0, 0.5, 1 (correct at 1)."""
    rec = store.read_run_record(source)
    store.write_run_record(MIXED, rec.config, rec.config_hash)
    rollout = store.committed(source, "iter-0000/rollout")
    assert rollout is not None
    rollouts = store.read_table(rollout, "rollouts.parquet")
    w = store.open_stage(MIXED, "iter-0000/rollout", inputs={"prompts": rollout.inputs["prompts"]["uri"]})
    w.write_table("rollouts.parquet", rollouts, "rollouts")
    uri = w.commit()
    n = rollouts.num_rows
    scores = [(i % 3) / 2 for i in range(n)]
    rewards = pa.table(
        {
            "group_id": rollouts.column("group_id"),
            "sample_index": rollouts.column("sample_index"),
            "score": pa.array(scores, pa.float32()),
            "components": pa.array([[("rule", s)] for s in scores], pa.map_(pa.string(), pa.float32())),
            "extracted_answer": pa.array([str(i) if i % 2 else None for i in range(n)]),
            "correct": pa.array([s == 1.0 for s in scores]),
        }
    )
    w = store.open_stage(MIXED, "iter-0000/reward", inputs={"rollout": uri})
    w.write_table("rewards.parquet", rewards, "rewards")
    w.commit()


def _parquet(catalog: Catalog, run_id: str, stage: str, name: str) -> pa.Table:
    manifest = catalog.store.committed(run_id, stage)
    assert manifest is not None
    return catalog.store.read_table(manifest, name)


def _ids(table: pa.Table) -> list[str]:
    pairs = zip(table["group_id"].to_pylist(), table["sample_index"].to_pylist(), strict=True)
    return [f"{g}:{i}" for g, i in pairs]


def _all(catalog: Catalog, run_id: str, key: str, f: SampleFilter, kind: str = "train") -> list[str]:
    page, total = catalog.samples(run_id, kind, key, f, None, 0, 10_000)  # type: ignore[arg-type]
    assert len(page) == total
    return page["sample_id"].tolist()


def test_runs_lists_both_runs_with_status_and_metrics(catalog: Catalog, browse_run: BrowseRun) -> None:
    runs = catalog.runs().set_index("run_id")
    assert {browse_run.run_id, MIXED} <= set(runs.index)
    run = runs.loc[browse_run.run_id]
    assert run["status"] == "finished" and runs.loc[MIXED, "status"] == "running or stopped"  # no report
    assert run["config_hash"] == catalog.store.read_run_record(browse_run.run_id).config_hash
    assert run["link_kind"] == "run" and run["iterations"] == len(catalog.iterations(browse_run.run_id))
    # half_credit scores 1.0 (correct) or 0.5: the last accuracy is a share, the mean reward in [0.5, 1]
    assert 0.0 <= run["accuracy"] <= 1.0 and 0.5 <= run["reward_mean"] <= 1.0


def test_sample_sets_are_the_committed_stages(catalog: Catalog, browse_run: BrowseRun) -> None:
    sets = catalog.sample_sets(browse_run.run_id)
    keys = list(zip(sets["kind"], sets["key"], strict=True))
    assert keys[:2] == [("train", "iter-0000"), ("train", "iter-0001")]  # train first, by iteration
    held_out = {("val", "iter-0001"), ("val", "iter-0001/sampled"), ("eval", "export-iter-0002/greedy")}
    assert held_out <= set(keys)
    train = sets[sets["kind"] == "train"]
    assert train["rows"].tolist() == [16, 16] and train["has_update"].all()  # 4 prompts x rollout.n=4
    for stage, rows in zip(sets["stage"], sets["rows"], strict=True):  # as the manifests count them
        manifest = catalog.store.committed(browse_run.run_id, stage)
        assert manifest is not None and rows in [f.rows for f in manifest.files]


def test_filters_match_the_parquet(catalog: Catalog) -> None:
    rollouts = _parquet(catalog, MIXED, "iter-0000/rollout", "rollouts.parquet")
    rewards = _parquet(catalog, MIXED, "iter-0000/reward", "rewards.parquet")
    assert _all(catalog, MIXED, "iter-0000", SampleFilter(correct=False)) == sorted(
        _ids(rewards.filter(pc.invert(rewards["correct"]))), key=_key
    )
    assert _all(catalog, MIXED, "iter-0000", SampleFilter(reward_min=0.25, reward_max=0.75)) == sorted(
        _ids(rewards.filter(pc.equal(rewards["score"], 0.5))), key=_key
    )
    lengths = rollouts["response_length"].to_pylist()
    mid = sorted(lengths)[len(lengths) // 2]
    want = _ids(rollouts.filter(pc.greater_equal(rollouts["response_length"], mid)))
    assert _all(catalog, MIXED, "iter-0000", SampleFilter(length_min=mid)) == sorted(want, key=_key)
    cut = _ids(rollouts.filter(pc.equal(rollouts["finish_reason"], "length")))
    assert _all(catalog, MIXED, "iter-0000", SampleFilter(truncated=True)) == sorted(cut, key=_key)
    # filters combine with AND: incorrect and truncated
    both = set(_ids(rewards.filter(pc.invert(rewards["correct"])))) & set(cut)
    assert set(_all(catalog, MIXED, "iter-0000", SampleFilter(correct=False, truncated=True))) == both


def test_text_search_is_a_case_insensitive_literal(catalog: Catalog) -> None:
    rollouts = _parquet(catalog, MIXED, "iter-0000/rollout", "rollouts.parquet")
    prompts = catalog.samples(MIXED, "train", "iter-0000", None, None, 0, 100)[0]
    word = prompts["prompt"][0].split()[0]  # e.g. "Start": in this prompt, maybe in others
    found = _all(catalog, MIXED, "iter-0000", SampleFilter(text=word.upper()))
    want = [
        sid
        for sid, p, r in zip(prompts["sample_id"], prompts["prompt"], prompts["response"], strict=True)
        if word.lower() in p.lower() or word.lower() in r.lower()
    ]
    assert found and found == want
    # user text is a parameter, never SQL: quotes and LIKE wildcards match themselves (nothing here)
    assert _all(catalog, MIXED, "iter-0000", SampleFilter(text="'; DROP TABLE x; --")) == []
    assert len(_all(catalog, MIXED, "iter-0000", SampleFilter(text="%"))) < rollouts.num_rows


def test_sort_and_pages_cover_every_row_once(catalog: Catalog) -> None:
    rewards = _parquet(catalog, MIXED, "iter-0000/reward", "rewards.parquet")
    pages = []
    for offset in range(0, rewards.num_rows, 5):
        page, total = catalog.samples(MIXED, "train", "iter-0000", None, [("reward", False)], offset, 5)
        assert total == rewards.num_rows
        pages.append(page)
    scores = [r for p in pages for r in p["reward"]]
    assert scores == sorted(rewards["score"].to_pylist(), reverse=True)
    assert sorted(s for p in pages for s in p["sample_id"]) == sorted(_ids(rewards))
    with pytest.raises(ValueError, match="cannot sort"):
        catalog.samples(MIXED, "train", "iter-0000", None, [("1; DROP TABLE x", True)])


def test_a_sample_row_holds_the_plain_prompt_and_its_update(catalog: Catalog, browse_run: BrowseRun) -> None:
    page, _ = catalog.samples(browse_run.run_id, "train", "iter-0001", None, None, 0, 100)
    assert tuple(page.columns) == SAMPLE_COLUMNS
    rollouts = _parquet(catalog, browse_run.run_id, "iter-0001/rollout", "rollouts.parquet")
    update = _parquet(catalog, browse_run.run_id, "iter-0001/update", "update.parquet")
    row = page.iloc[0]
    rendered = rollouts["prompt_text"][0].as_py()  # the chat template around the user's text
    assert row["prompt"] in rendered and len(row["prompt"]) < len(rendered)
    assert row["response"] == rollouts["response_text"][0].as_py()
    adv = update["advantages"][0].as_py()
    assert row["advantage"] == pytest.approx(sum(adv) / len(adv), rel=1e-5)  # the mean over tokens
    # every row's advantage is its own sample's mean (numpy over the update's lists, matched by key)
    means = {
        sid: sum(a) / len(a) for sid, a in zip(_ids(update), update["advantages"].to_pylist(), strict=True)
    }
    everything, _ = catalog.samples(browse_run.run_id, "train", "iter-0001", None, None, 0, 1000)
    assert everything["advantage"].tolist() == pytest.approx([means[s] for s in everything["sample_id"]])
    assert row["policy_version"] == 1 and not row["is_baseline"]


def test_group_holds_the_n_responses_of_one_prompt(catalog: Catalog, browse_run: BrowseRun) -> None:
    page, _ = catalog.samples(browse_run.run_id, "train", "iter-0000", None, None, 0, 1)
    group = catalog.group(browse_run.run_id, "train", "iter-0000", int(page["prompt_id"][0]))
    assert len(group) == 4  # rollout.n
    assert group["sample_index"].tolist() == [0, 1, 2, 3] and group["prompt"].nunique() == 1


def test_prompt_history_follows_the_prompt_id_across_iterations(
    catalog: Catalog, browse_run: BrowseRun
) -> None:
    first, _ = catalog.samples(browse_run.run_id, "train", "iter-0000", None, None, 0, 1)
    prompt_id = int(first["prompt_id"][0])
    history = catalog.prompt_history(browse_run.run_id, prompt_id)
    want = 0
    for it in (0, 1):
        rollouts = _parquet(catalog, browse_run.run_id, f"iter-{it:04d}/rollout", "rollouts.parquet")
        want += len(rollouts.filter(pc.equal(rollouts["prompt_index"], prompt_id)))
    assert len(history) == want and set(history["prompt_id"]) == {prompt_id}
    text = history["prompt"][0]
    assert len(catalog.prompt_history(browse_run.run_id, text.upper())) >= want  # by text, case ignored


def test_tokens_hold_the_stored_per_token_values(catalog: Catalog, browse_run: BrowseRun) -> None:
    rollouts = _parquet(catalog, browse_run.run_id, "iter-0001/rollout", "rollouts.parquet")
    update = _parquet(catalog, browse_run.run_id, "iter-0001/update", "update.parquet")
    tokens = catalog.tokens(browse_run.run_id, "train", "iter-0001", "1:2")
    i = _ids(rollouts).index("1:2")
    assert tuple(tokens.columns) == TOKEN_COLUMNS
    assert tokens["token_id"].tolist() == rollouts["response_ids"][i].as_py()
    assert tokens["behaviour_logprob"].tolist() == pytest.approx(rollouts["logprobs"][i].as_py())
    assert tokens["advantage"].tolist() == pytest.approx(update["advantages"][i].as_py())
    assert tokens["trainer_logprob"].tolist() == pytest.approx(update["old_log_probs"][i].as_py())
    # same weights sampled and recomputed in float32: they agree to rounding
    assert tokens["mismatch"].abs().max() < 1e-3
    assert tokens["model_token"].all()  # single-turn: every response token is the model's


def test_top_mismatch_ranks_samples_by_largest_token_gap(catalog: Catalog, browse_run: BrowseRun) -> None:
    top = catalog.top_mismatch(browse_run.run_id, "train", "iter-0001", limit=3)
    assert len(top) == 3 and top["max_abs_mismatch"].is_monotonic_decreasing
    first = catalog.tokens(browse_run.run_id, "train", "iter-0001", top["sample_id"][0])
    assert top["max_abs_mismatch"][0] == pytest.approx(first["mismatch"].abs().max(), abs=1e-7)
    assert catalog.top_mismatch(browse_run.run_id, "val", "iter-0001").empty  # no update, no trainer values


def test_top_mismatch_equals_the_reference(catalog: Catalog, browse_run: BrowseRun) -> None:
    # every sample ranked by the background statistics (browse.derived) against
    # browse.sql.mismatch_stats over the Parquet's lists
    run = browse_run.run_id
    got = catalog.top_mismatch(run, "train", "iter-0001", limit=10_000)
    rollouts = _parquet(catalog, run, "iter-0001/rollout", "rollouts.parquet")
    update = _parquet(catalog, run, "iter-0001/update", "update.parquet")
    trainer = dict(zip(_ids(update), update["old_log_probs"].to_pylist(), strict=True))
    want = []
    for sid, behaviour in zip(_ids(rollouts), rollouts["logprobs"].to_pylist(), strict=True):
        mx, mean, arg = mismatch_stats(behaviour, trainer.get(sid))
        if arg >= 0:
            group, index = map(int, sid.split(":"))
            want.append((math.isnan(mx), -mx, group, index, sid, mx, mean, arg))
    want.sort(key=lambda w: w[:4])
    assert got["sample_id"].tolist() == [w[4] for w in want]
    assert got["max_abs_mismatch"].tolist() == pytest.approx([w[5] for w in want], nan_ok=True)
    assert got["mean_abs_mismatch"].tolist() == pytest.approx([w[6] for w in want], nan_ok=True)
    assert got["argmax_position"].tolist() == [w[7] for w in want]


def test_rescore_tables_are_its_report(catalog: Catalog, browse_run: BrowseRun) -> None:
    assert catalog.rescores(browse_run.run_id) == [browse_run.rescore]
    agreement, disagreements = catalog.rescore(browse_run.run_id, browse_run.rescore)
    stage = f"rescore/{browse_run.rescore}/report"
    comparison = _parquet(catalog, browse_run.run_id, stage, "comparison.parquet")
    assert agreement["source"].tolist() == [*comparison["source"].to_pylist(), "all"]
    dis = _parquet(catalog, browse_run.run_id, stage, "disagreements.parquet")
    assert disagreements["score_new"].tolist() == pytest.approx(dis["score_new"].to_pylist())
    assert disagreements["sample_id"].tolist() == _ids(dis)
    # the rule scorer never credits the scratch model: every listed row lost its stored score
    assert len(dis) > 0 and (disagreements["score_new"] < disagreements["score_old"]).all()
    assert disagreements["correct_old"].any() and not disagreements["correct_new"].any()


def test_garbled_flag_is_the_heuristics_on_every_row(catalog: Catalog, browse_run: BrowseRun) -> None:
    run = browse_run.run_id
    page, total = catalog.samples(run, "val", "iter-0001/sampled", None, None, 0, 100)
    flagged = _all(catalog, run, "iter-0001/sampled", SampleFilter(garbled=True), "val")
    clean = _all(catalog, run, "iter-0001/sampled", SampleFilter(garbled=False), "val")
    assert len(flagged) + len(clean) == total
    for _, row in page.iterrows():
        assert row["garbled_reason"] == garbled_reason(row["response"], bool(row["truncated"]))
        assert row["garbled"] == (row["sample_id"] in flagged)
    # after the filter, every row's stored flag (the vectorised pass) is the reference's
    filled, _ = catalog.samples(run, "val", "iter-0001/sampled", None, None, 0, 10_000)
    for _, row in filled.iterrows():
        assert row["garbled_reason"] == garbled_reason(row["response"], bool(row["truncated"]))


def test_garbled_flags_fill_in_the_background(catalog: Catalog, browse_run: BrowseRun) -> None:
    # a set opened and never filtered by garbled: its table's stored flags get filled all the same,
    # each the reference's
    run, key = browse_run.run_id, "export-iter-0002/greedy"
    catalog.samples(run, "eval", key, None, None, 0, 1)
    table = catalog._table(catalog._find(run, "eval", key))
    catalog._derived.wait_garbled(table)
    sql = f"SELECT response, truncated, garbled_reason FROM {table}"
    stored = catalog._db.cursor().execute(sql).fetchall()
    assert stored and all(reason == garbled_reason(text or "", bool(cut)) for text, cut, reason in stored)


def test_garbled_page_comes_before_its_count(
    catalog: Catalog, browse_run: BrowseRun, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the flags not in yet (garbled_ready patched False), a garbled filter asked with count_later
    # flags rows on the fly, 2 then 4, 8, ... at a time here: the page is the one the stored flags
    # give (same rows, order, reasons), its count None while rows were left unseen, exact when all
    # were seen
    run, key, sort = browse_run.run_id, "iter-0001/sampled", [("response_length", False)]
    want = {g: catalog.samples(run, "val", key, SampleFilter(garbled=g), sort, 1, 3) for g in (True, False)}
    monkeypatch.setattr(derived, "EARLY_BLOCK", 2)
    monkeypatch.setattr(derived, "EARLY_ROWS", 10_000)
    monkeypatch.setattr(catalog._derived, "garbled_ready", lambda table: False)
    for garbled, (page, total) in want.items():
        early, count = catalog.samples(run, "val", key, SampleFilter(garbled=garbled), sort, 1, 3, True)
        for col in ("sample_id", "response", "garbled", "garbled_reason"):
            assert early[col].tolist() == page[col].tolist()
        assert list(early.columns) == list(SAMPLE_COLUMNS)
        # None only when rows were left unseen: more than the 1 + 3 matching rows the page needed
        assert count == total or (count is None and total > 4)


def test_config_is_redacted_as_tracking_redacts(catalog: Catalog, browse_run: BrowseRun) -> None:
    rec = catalog.store.read_run_record(browse_run.run_id)
    config = json.loads(json.dumps(rec.config))
    config["tracking"]["uri"] = "http://alice:s3cret@mlflow.example:5000"
    catalog.store.write_run_record("redact", config, rec.config_hash)
    shown = catalog.run_config("redact")
    assert shown["tracking.uri"] == "http://***@mlflow.example:5000"
    assert "s3cret" not in json.dumps(shown)


def test_uncommitted_files_stay_invisible(catalog: Catalog, browse_run: BrowseRun) -> None:
    """A stage written but not committed (no manifest) is not listed: a run still writing shows
    only what it committed."""
    rec = catalog.store.read_run_record(browse_run.run_id)
    catalog.store.write_run_record("writing", rec.config, rec.config_hash)
    attempt = Path(browse_run.store) / "runs" / "writing" / "iter-0000" / "rollout" / "attempt-x"
    attempt.mkdir(parents=True, exist_ok=True)
    rollout = catalog.store.committed(browse_run.run_id, "iter-0000/rollout")
    assert rollout is not None
    (attempt / "rollouts.parquet").write_bytes(catalog.store.read_bytes(rollout, "rollouts.parquet"))
    assert catalog.sample_sets("writing").empty


def _key(sample_id: str) -> tuple[int, int]:
    g, i = sample_id.split(":")
    return int(g), int(i)


def test_an_s3_store_answers_the_same(catalog: Catalog, browse_run: BrowseRun, s3_endpoint: str) -> None:
    """The run copied to a bucket (moto): DuckDB reads its Parquet files through the store's fsspec
    filesystem; the copy's manifests still name the local store in their inputs, which the catalog
    maps back into the bucket."""
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=s3_endpoint)
    if not fs.exists("browse"):
        fs.mkdir("browse")
    run_dir = Path(browse_run.store) / "runs" / browse_run.run_id
    fs.put(str(run_dir), f"browse/store/runs/{browse_run.run_id}", recursive=True)
    remote = Catalog("s3://browse/store", [browse_run.run_id])
    f = SampleFilter(correct=False)
    got, total = remote.samples(browse_run.run_id, "train", "iter-0001", f, [("reward", True)], 0, 100)
    want, want_total = catalog.samples(browse_run.run_id, "train", "iter-0001", f, [("reward", True)], 0, 100)
    assert total == want_total and got["sample_id"].tolist() == want["sample_id"].tolist()
    assert got["prompt"].tolist() == want["prompt"].tolist()  # the prompts file found in the bucket
    assert got["advantage"].tolist() == pytest.approx(want["advantage"].tolist())  # pyarrow over fsspec
    top = remote.top_mismatch(browse_run.run_id, "train", "iter-0001", limit=5)
    assert top.equals(catalog.top_mismatch(browse_run.run_id, "train", "iter-0001", limit=5))
    tokens = remote.tokens(browse_run.run_id, "train", "iter-0001", str(got["sample_id"][0]))
    assert (
        tokens["token"].tolist()
        == catalog.tokens(browse_run.run_id, "train", "iter-0001", str(got["sample_id"][0]))["token"].tolist()
    )

"""Pipeline stages: one file per stage (preprocess, template_pack, sft, rollout, reward, ppo_update,
validate, export, eval, report, snapshot), each a Prefect task taking config sections and artifact
URIs and returning a manifest URI, plus the stage floor :mod:`stages.floor` (stage-location names,
config → verl_core builders, artifact readers/writers, the RL state, logging).

Rule: a stage file imports verl_core and the floor, never another stage file; stages meet only
through artifacts (a stage that needs template_pack's outputs receives its manifest URI). Flows use
the stage tasks and the floor's public names only. ``tests/stages/test_imports.py`` holds the line.
"""

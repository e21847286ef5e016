"""``verl-flow``: run the pipeline, show resolved configs, list and inspect runs.

One module per command group (:mod:`flows.cli.run`: run, replay, rescore, config show;
:mod:`flows.cli.runs`: runs list/show; :mod:`flows.cli.policy`: export, eval; :mod:`flows.cli.serve`:
serve, serve status/stop; :mod:`flows.cli.models`: models, promote, rollback; :mod:`flows.cli.browse`;
:mod:`flows.cli.spmd`: spmd-command, spmd-follow; :mod:`flows.cli.doctor`; :mod:`flows.cli.plan`;
:mod:`flows.cli.from_verl`);
this module builds the app from them. Heavy modules (Prefect, torch, MLflow) are imported only by
the commands that need them. Errors that are the user's to fix (bad config, missing artifact) print
one line and exit 2 (config) or 1 (anything else), without a traceback. A failed ``run`` prints one
line too (stage, iteration, what failed, the log file; ``launcher.run_log``), the traceback goes to
the log file.
"""

from __future__ import annotations

import typer

from flows.cli.browse import browse_cmd
from flows.cli.doctor import doctor
from flows.cli.from_verl import from_verl_cmd
from flows.cli.models import models_cmd, promote_cmd, rollback_cmd
from flows.cli.plan import plan_cmd
from flows.cli.policy import eval_cmd, export_cmd
from flows.cli.run import config_app, replay_cmd, rescore_cmd, run
from flows.cli.runs import runs_app
from flows.cli.serve import serve_app
from flows.cli.spmd import spmd_command, spmd_follow

app = typer.Typer(
    name="verl-flow",
    help="RL post-training (SFT, PPO, GRPO) as a Prefect pipeline of stages with Parquet artifacts.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help texts are plain text: "A:B:" stays "A:B:", not an emoji
)
app.add_typer(config_app, name="config")
app.add_typer(runs_app, name="runs")
app.command("doctor")(doctor)  # versions, pins, store and MLflow reachable
app.command("plan")(plan_cmd)  # memory per process vs the machine, seconds per phase
app.command()(run)
app.command("spmd-command")(spmd_command)
app.command("spmd-follow")(spmd_follow)
app.command("export")(export_cmd)
app.command("eval")(eval_cmd)
app.command("rescore")(rescore_cmd)
app.command("replay")(replay_cmd)
app.add_typer(serve_app, name="serve")  # serve TARGET (= serve start), serve status, serve stop
app.command("from-verl")(from_verl_cmd)  # a verl launch script as a config
app.command("browse")(browse_cmd)  # the rollout browser (web pages over the run's Parquet)
app.command("models")(models_cmd)  # registered versions, champion, decisions
app.command("promote")(promote_cmd)
app.command("rollback")(rollback_cmd)


def main() -> None:
    app()

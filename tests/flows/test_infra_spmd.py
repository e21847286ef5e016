"""Multi-node recipes (infra/k8s/spmd-*, infra/slurm/, infra/spmd-node.sh) and the follower node
(launcher/follow.py, ``verl-flow spmd-follow`` / ``spmd-command``). No cluster here: the manifests are
checked for shape, and their node commands are run with fake ``verl-flow``/``srun``/``scontrol`` on
PATH; what they would launch must be exactly ``verl_core.runtime.launch.torchrun_command`` for the geometry of
node 0's config (one definition). The follower loop runs against an injected runner, and once against
the real torchrun rendezvous (2 nodes × 1 process on this host) with a fake worker."""

from __future__ import annotations

import json
import re
import shlex
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from flows.cli import app
from launcher.follow import FollowError, follow, launch_spec
from verl_core.config import load_config
from verl_core.runtime.launch import (
    FOLLOWER_JOB_URI,
    JOB_INFO_ENV,
    JobInfo,
    LaunchSpec,
    torchrun_command,
    write_job_info,
)

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "infra/k8s"
SLURM = REPO / "infra/slurm/verl-flow-multinode.sbatch"
NODE_SCRIPT = REPO / "infra/spmd-node.sh"
FAKE_WORKER = "tests.flows.spmd_fake_worker"
cli = CliRunner()


# ---------------------------------------------------------------- the command, one definition


def test_torchrun_command_node_0_hosts_followers_join() -> None:
    spec = LaunchSpec(nnodes=2, nproc_per_node=8, rdzv_id="verl-flow", rdzv_endpoint="n0:29400")
    common = [
        "--nnodes",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "n0:29400",
        "--rdzv-id",
        "verl-flow",
    ]
    tail = ["--nproc-per-node", "8", "--max-restarts", "0", "-m", "launcher.spmd", "--job"]
    head = [sys.executable, "-m", "torch.distributed.run", *common, "--rdzv-conf", "is_host=1", *tail]
    follower = [sys.executable, "-m", "torch.distributed.run", *common, "--rdzv-conf", "is_host=0", *tail]
    assert torchrun_command(spec, "s3://b/runs/r/job.json") == [*head, "s3://b/runs/r/job.json"]
    assert torchrun_command(spec, FOLLOWER_JOB_URI) == [*follower, "rendezvous"]


def test_spmd_command_and_follow_dry_run_print_torchrun_command() -> None:
    spec = LaunchSpec(nnodes=2, nproc_per_node=8, rdzv_id="verl-flow", rdzv_endpoint="n0:29400")
    config = [
        "trainer.nnodes=2",
        "trainer.n_gpus_per_node=8",
        "trainer.rdzv_endpoint=n0:29400",
        "actor.strategy=fsdp2",
        "rollout.share_weights=false",
    ]
    shown = cli.invoke(app, ["spmd-command", *config, "--job", "s3://b/job.json"])
    assert shown.exit_code == 0, shown.output
    assert shown.stdout == shlex.join(torchrun_command(spec, "s3://b/job.json")) + "\n"
    geometry = ["--nnodes", "2", "--nproc-per-node", "8", "--rdzv-endpoint", "n0:29400"]
    dry = cli.invoke(app, ["spmd-follow", *geometry, "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert dry.stdout == shlex.join(torchrun_command(spec, FOLLOWER_JOB_URI)) + "\n"
    missing = cli.invoke(app, ["spmd-command", "trainer.nnodes=2", *config[3:]])
    assert missing.exit_code == 2
    assert missing.stderr.strip() == (
        "error: trainer.rdzv_endpoint: required (host:port of node 0) when trainer.nnodes is 2"
    )


# ---------------------------------------------------------------- the follower loop


class FakeTorchrun:
    """Plays torchrun for :func:`follow`: each call takes the next ``(job info or None, exit code)``."""

    def __init__(self, script: list[tuple[JobInfo | None, int]]) -> None:
        self.script = list(script)
        self.calls: list[list[str]] = []

    def __call__(self, argv: list[str], env: Mapping[str, str]) -> int:
        self.calls.append(argv)
        info, rc = self.script.pop(0)
        if info is not None:
            write_job_info(env[JOB_INFO_ENV], info)
        return rc


SPEC = LaunchSpec(nnodes=2, nproc_per_node=4, rdzv_id="verl-flow", rdzv_endpoint="n0:29400")
SFT, RL = JobInfo("sft", final=False), JobInfo("rl_loop", final=True)


def test_follow_retries_until_a_job_and_stops_after_the_final_one() -> None:
    # no job (node 0 not launching yet), SFT, no job (node 0's SFT store closing), the final RL loop;
    # a fifth call would pop from an empty script and fail the test
    fake = FakeTorchrun([(None, 1), (SFT, 0), (None, 1), (RL, 0)])
    result = follow(SPEC, runner=fake, wait_s=60, retry_s=0, log=lambda _: None)
    assert result.jobs == (SFT, RL)
    assert result.idle_attempts == 2
    assert fake.calls == [torchrun_command(SPEC, FOLLOWER_JOB_URI)] * 4


def test_follow_stops_after_max_jobs() -> None:
    fake = FakeTorchrun([(SFT, 0)])  # not final, but one stage flow run holds one job
    assert follow(SPEC, runner=fake, max_jobs=1, retry_s=0, log=lambda _: None).jobs == (SFT,)


def test_follow_fails_naming_the_job_and_stage() -> None:
    fake = FakeTorchrun([(SFT, 0), (RL, 1)])
    with pytest.raises(FollowError) as e:
        follow(SPEC, runner=fake, retry_s=0, log=lambda _: None)
    assert str(e.value) == "SPMD job 2 (stage rl_loop) failed: torchrun exited with code 1"


def test_follow_gives_up_when_no_job_comes() -> None:
    fake = FakeTorchrun([(None, 1)])
    with pytest.raises(FollowError) as e:
        follow(SPEC, runner=fake, wait_s=0, retry_s=0, log=lambda _: None)
    assert str(e.value) == (
        "no SPMD job from n0:29400 (rdzv id verl-flow) within 0 s after job 0; "
        "the last torchrun exited with code 1"
    )


def test_spmd_follow_cli_prints_one_line_on_a_failed_job(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeTorchrun([(RL, 7)])
    monkeypatch.setattr("launcher.follow.run_subprocess", fake)
    geometry = ["--nnodes", "2", "--nproc-per-node", "4", "--rdzv-endpoint", "n0:29400"]
    result = cli.invoke(app, ["spmd-follow", *geometry])
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        "error: SPMD job 1 (stage rl_loop) failed: torchrun exited with code 7"
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_follower_joins_two_jobs_through_the_real_rendezvous(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node 0 (this test) runs two torchrun jobs one after the other, the follower (a thread) one
    torchrun per job under the same rdzv id: it gets both, learns the stages from the worker, and
    stops after the final one. ~4 torchrun starts, 30-60 s on 2 loaded cores."""
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    spec = LaunchSpec(
        nnodes=2, nproc_per_node=1, rdzv_id="test-follow", rdzv_endpoint=f"127.0.0.1:{_free_port()}"
    )
    out: dict[str, object] = {}

    def follower() -> None:
        try:
            out["result"] = follow(spec, module=FAKE_WORKER, wait_s=120, retry_s=0.5, log=lambda _: None)
        except Exception as e:  # reported by the assertion below
            out["error"] = e

    thread = threading.Thread(target=follower)
    thread.start()
    for stage, final in (("sft", False), ("rl_loop", True)):
        job = tmp_path / f"{stage}.json"
        job.write_text(json.dumps({"stage": stage, "final": final}))
        head = subprocess.run(torchrun_command(spec, str(job), module=FAKE_WORKER), timeout=120, check=False)
        assert head.returncode == 0
    thread.join(timeout=120)
    assert "error" not in out, out
    assert out["result"].jobs == (SFT, RL)  # type: ignore[attr-defined]


# ---------------------------------------------------------------- recipes: run their node commands


def _fake_bin(tmp: Path) -> tuple[Path, Path]:
    """A PATH dir whose ``verl-flow`` and ``prefect`` log their argv (a JSON line) to the returned
    file, ``srun`` runs its command (options dropped) as step node 0, ``scontrol`` knows two hosts."""
    bin_dir, capture = tmp / "bin", tmp / "argv.jsonl"
    bin_dir.mkdir()
    logger = f"#!{sys.executable}\nimport json, os, sys\n"
    logger += f"open({str(capture)!r}, 'a').write("
    logger += 'json.dumps([os.path.basename(sys.argv[0]), *sys.argv[1:]]) + "\\n")\n'
    # a real pipeline on node 0 outlives the followers' start; the fake one waits for them (FAKE_FOLLOWERS
    # lines of spmd-follow, 30 s at most): the script's kill of the followers after node 0 is no race
    logger += "import time\nn = int(os.environ.get('FAKE_FOLLOWERS', '0'))\n"
    logger += "for _ in range(300 if sys.argv[1:2] == ['run'] else 0):\n"
    logger += f"    if open({str(capture)!r}).read().count('spmd-follow') >= n: break\n"
    logger += "    time.sleep(0.1)\n"
    scripts = {
        "verl-flow": logger,
        "prefect": logger,
        "srun": '#!/usr/bin/env bash\nwhile [[ "$1" == --* ]]; do shift; done\nSLURM_NODEID=0 exec "$@"\n',
        "scontrol": '#!/usr/bin/env bash\n[[ "$1 $2" == "show hostnames" ]] && printf "gpu-a\\ngpu-b\\n"\n',
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir, capture


def _run(argv: list[str], env: Mapping[str, str], tmp: Path) -> list[list[str]]:
    bin_dir, capture = tmp / "bin", tmp / "argv.jsonl"
    full_env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp), **env}
    done = subprocess.run(
        argv, env=full_env, cwd=REPO, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in capture.read_text().splitlines()] if capture.exists() else []


def _follower_dry_run(follower_argv: list[str]) -> str:
    assert follower_argv[:2] == ["verl-flow", "spmd-follow"], follower_argv
    shown = cli.invoke(app, [*follower_argv[1:], "--dry-run"])
    assert shown.exit_code == 0, shown.output
    return shown.stdout


def _launch_of_node_0(run_argv: list[str]) -> LaunchSpec:
    """The geometry node 0's pipeline launches with: its config's trainer.* fields."""
    assert run_argv[:2] == ["verl-flow", "run"], run_argv
    return launch_spec(load_config(str(REPO / run_argv[2]), run_argv[3:]))


def _env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def _assert_secret_env(container: dict) -> None:
    """The store's endpoint and credentials come from the Secret, no value written in the manifest."""
    aws = {e["name"]: e for e in container["env"] if e["name"].startswith("AWS_")}
    assert set(aws) == {"AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    for name, e in aws.items():
        assert "value" not in e
        assert e["valueFrom"]["secretKeyRef"] == {"name": "verl-flow-s3", "key": name}


def test_k8s_services_give_pod_names_and_the_rendezvous() -> None:
    services = {
        d["metadata"]["name"]: d for d in yaml.safe_load_all((K8S / "spmd-services.yaml").read_text())
    }
    assert set(services) == {"verl-flow-spmd", "verl-flow-rdzv"}
    for svc in services.values():
        assert svc["kind"] == "Service" and svc["spec"]["clusterIP"] == "None"
        assert svc["spec"]["ports"] == [{"name": "rdzv", "port": 29400}]
    assert services["verl-flow-spmd"]["spec"]["selector"] == {"verl-flow/role": "spmd"}
    assert services["verl-flow-rdzv"]["spec"]["selector"] == {
        "verl-flow/role": "spmd",
        "batch.kubernetes.io/job-completion-index": "0",
    }


def test_k8s_indexed_job_shape_and_node_commands(tmp_path: Path) -> None:
    (job,) = yaml.safe_load_all((K8S / "spmd-job.yaml").read_text())
    spec = job["spec"]
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    env = _env_of(container)
    assert (job["kind"], spec["completionMode"]) == ("Job", "Indexed")
    assert spec["completions"] == spec["parallelism"] == int(env["VERL_FLOW_NNODES"]) == 2
    assert spec["backoffLimit"] == 0 and spec["successPolicy"] == {"rules": [{"succeededIndexes": "0"}]}
    assert spec["template"]["metadata"]["labels"] == {"verl-flow/role": "spmd"}
    assert pod["subdomain"] == "verl-flow-spmd"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == env["VERL_FLOW_NPROC_PER_NODE"] == "8"
    assert env["VERL_FLOW_RDZV_ENDPOINT"] == "verl-flow-rdzv:29400"
    _assert_secret_env(container)

    _fake_bin(tmp_path)
    env.pop("VERL_FLOW_WAIT_DNS_S")  # no cluster DNS here
    argvs = [_run(container["command"], {**env, "JOB_COMPLETION_INDEX": i}, tmp_path) for i in ("0", "1")]
    (head,), (_, follower) = argvs[0], argvs[1]  # the log file accumulates: pod 0's line, then pod 1's
    launch = _launch_of_node_0(head)
    assert launch == LaunchSpec(2, 8, "verl-flow", "verl-flow-rdzv:29400")
    assert _follower_dry_run(follower) == shlex.join(torchrun_command(launch, FOLLOWER_JOB_URI)) + "\n"


def test_prefect_work_pool_template_dispatches_an_indexed_job(tmp_path: Path) -> None:
    """Rendered as Prefect's kubernetes worker renders it: pod 0 runs the flow run's command, the
    others follow for one job (one stage flow run = one SPMD job)."""
    from prefect.utilities.templating import apply_values

    template = json.loads((K8S / "spmd-base-job-template.json").read_text())
    props = template["variables"]["properties"]
    values = {k: v["default"] for k, v in props.items() if "default" in v}
    values |= {"name": "rl-loop-abc", "command": "prefect flow-run execute", "env": {}, "labels": {}}
    config = apply_values(template["job_configuration"], values)
    manifest = config["job_manifest"]
    (container,) = manifest["spec"]["template"]["spec"]["containers"]
    assert manifest["spec"]["completionMode"] == "Indexed"
    assert (
        manifest["spec"]["completions"] == manifest["spec"]["parallelism"] == 2
    )  # an int, as Kubernetes wants
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    _assert_secret_env(container)

    _fake_bin(tmp_path)
    argv = [*container["command"], *container["args"].split()]  # the worker splits `args` the same way
    no_dns = [
        argv[0],
        argv[1],
        argv[2].replace("VERL_FLOW_WAIT_DNS_S=120", "VERL_FLOW_WAIT_DNS_S=0"),
        *argv[3:],
    ]
    _run(no_dns, {"JOB_COMPLETION_INDEX": "0"}, tmp_path)
    head, follower = _run(no_dns, {"JOB_COMPLETION_INDEX": "1"}, tmp_path)
    assert head == ["prefect", "flow-run", "execute"]
    assert follower[-2:] == ["--max-jobs", "1"]
    launch = LaunchSpec(2, 8, "verl-flow", "verl-flow-rdzv:29400")  # the flow run's config must say the same
    assert _follower_dry_run(follower) == shlex.join(torchrun_command(launch, FOLLOWER_JOB_URI)) + "\n"


def test_slurm_script_runs_pipeline_on_first_host_and_followers_elsewhere(tmp_path: Path) -> None:
    assert subprocess.run(["bash", "-n", str(SLURM)], check=False).returncode == 0
    assert subprocess.run(["bash", "-n", str(NODE_SCRIPT)], check=False).returncode == 0
    _fake_bin(tmp_path)
    env = {"SLURM_JOB_NODELIST": "gpu-[a-b]", "SLURM_GPUS_PER_NODE": "8", "VERL_FLOW_HOME": str(REPO)}
    env["FAKE_FOLLOWERS"] = "1"  # node 0's fake pipeline lasts until the follower has started
    overrides = ["actor.strategy=fsdp2", "critic.strategy=fsdp2"]
    argvs = _run(["bash", str(SLURM), "configs/gsm8k_ppo.yaml", *overrides], env, tmp_path)
    (head,) = [a for a in argvs if a[1] == "run"]
    (follower,) = [a for a in argvs if a[1] == "spmd-follow"]
    assert head[-2:] == overrides
    launch = _launch_of_node_0(head)
    assert launch == LaunchSpec(2, 8, "verl-flow", "gpu-a:29400")  # node 0 = the first host
    assert _follower_dry_run(follower) == shlex.join(torchrun_command(launch, FOLLOWER_JOB_URI)) + "\n"


def test_recipes_carry_no_credentials() -> None:
    literal = re.compile(r"AWS_(SECRET_ACCESS_KEY|ACCESS_KEY_ID)\s*[:=]\s*[\"']?[A-Za-z0-9/+]{8,}")
    for path in [*K8S.glob("spmd-*"), SLURM, NODE_SCRIPT]:
        assert not literal.search(path.read_text()), path

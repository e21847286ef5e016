"""The whole pipeline at Qwen2.5-0.5B's size (``configs/scale_0.5b_cpu.yaml``): wall time per stage,
peak resident memory of the whole process tree and of each process, then ``verl-flow serve`` on the
export answering one question. A benchmark, not a test (minutes to tens of minutes on 2 CPU cores).

    .venv/bin/python benchmarks/scale_pipeline.py                      # GRPO + reference, vLLM, serve
    .venv/bin/python benchmarks/scale_pipeline.py --kill-resume        # kill -9 in RL iteration 2, resume
    .venv/bin/python benchmarks/scale_pipeline.py --variant ppo_critic # PPO + GAE critic, 2 iterations
    .venv/bin/python benchmarks/scale_pipeline.py --variant lora       # LoRA r=16, 2 iterations
    .venv/bin/python benchmarks/scale_pipeline.py -- actor.lr=2e-5     # any dotted overrides after --

Memory: every 0.5 s the resident set (RSS) of ``verl-flow run`` and all its descendants (the vLLM
engine subprocess and its workers, the temporary Prefect server) is read with psutil; "peak total" is
the largest sum over the tree at one sample (RSS counts a page shared by two processes twice: an upper
bound), plus what the run holds in ``/dev/shm`` (weight-sync staging lives there, in no process's RSS).
Stage times come from the run log's task-completion timestamps (a task's time = its completion minus
the previous task's; the stages run one after another in local mode).

``--kill-resume`` runs the config in a second store under the same run id, SIGKILLs its process group
and every other process of the tree (a preempted machine) once RL iteration 2's rollout is committed
(iteration 1's checkpoint is then committed and iteration 2's update is running), reruns the same
command (a rerun of a run id resumes it) and compares the sha256 of the last checkpoint's policy
weights with the uninterrupted run's (``--reference``: its store; by default this script's GRPO run);
``--seed-stages`` first links that run's committed preprocess/template_pack/SFT stages into the new
store, so that only the RL phase runs again. ``--fresh-reference`` first runs the uninterrupted
reference itself with the same overrides (export and eval off) in ``<root>/<variant>-uninterrupted``
and seeds from it, so that both runs are of the same code:

    .venv/bin/python benchmarks/scale_pipeline.py --kill-resume --fresh-reference -- sft.max_steps=1
Writes ``<root>/<variant>.json``; prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
CONFIG = "configs/scale_0.5b_cpu.yaml"
VERL_FLOW = str(REPO / ".venv" / "bin" / "verl-flow")
RUN_ID = "scale-0.5b"
GIB = 2**30
# Per variant: the overrides on top of the config, with the reason for each knob.
VARIANTS: dict[str, list[str]] = {
    "grpo": [],
    # PPO: a GAE critic (a second 0.5B model) instead of group baselines, the KL loss (and with it the
    # reference) off as in verl's PPO example. In full fine-tuning two 0.5B models with their AdamW
    # moments do not fit this machine beside vLLM (verl-flow plan refuses it); a LoRA r=16 actor fits,
    # the critic staying a full model (SFT off: it would train the adapter alone). Its checkpoint
    # streams the critic's 3.7 GB of moments to the store (before, their bytes copy ran it out of memory)
    "ppo_critic": [
        "algorithm.adv_estimator=gae",
        "critic.enable=true",
        "actor.use_kl_loss=false",
        "model.lora_rank=16",
        "model.lora_alpha=32",
        "actor.lr=1e-4",
        "critic.lr=1e-4",
        "sft.enable=false",
        "trainer.total_iterations=2",
    ],
    # LoRA r=16 on all linear layers: the reference is the base with adapters off (no second copy)
    # (SFT off: a LoRA SFT would train the adapter alone; the variant measures the RL phase)
    "lora": [
        "model.lora_rank=16",
        "model.lora_alpha=32",
        "actor.lr=1e-4",
        "sft.enable=false",
        "trainer.total_iterations=2",
    ],
}
QUESTION = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?"
)


def _role(p: psutil.Process) -> str:
    """A readable name for one process of the tree."""
    try:
        cmd = " ".join(p.cmdline())
        name = p.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "?"
    if cmd.startswith("VLLM::") or name.startswith("VLLM::"):
        return (cmd or name).split()[0]  # vLLM titles its processes: VLLM::EngineCore, VLLM::Worker
    if "verl_core.rollout.vllm_process" in cmd:
        return "vLLM engine host (subprocess)"
    if "vllm.entrypoints" in cmd:
        return "vLLM API server"
    if "prefect" in cmd and "server" in cmd:
        return "Prefect server"
    if "verl-flow" in cmd and " run " in f" {cmd} ":
        return "trainer (verl-flow run)"
    if "verl-flow" in cmd and " serve " in f" {cmd} ":
        return "verl-flow serve"
    if "vllm" in cmd.lower() or "VLLM" in name:
        return f"vLLM ({name})"
    return name


class TreeSampler(threading.Thread):
    """Samples the RSS of ``root`` and its descendants every ``period_s`` until :meth:`stop`."""

    def __init__(self, root: int, period_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.root, self.period_s = root, period_s
        self.peak_total = self.peak_total_shm = 0
        self.per_pid: dict[int, dict[str, Any]] = {}
        self.samples: list[tuple[float, int, int, int]] = []  # (time, tree, trainer, vLLM processes)
        self.shm0 = _shm_used()
        self._done = threading.Event()

    def pids(self) -> list[int]:
        try:
            root = psutil.Process(self.root)
            return [root.pid, *(c.pid for c in root.children(recursive=True))]
        except psutil.NoSuchProcess:
            return []

    def run(self) -> None:
        while not self._done.is_set():
            total = root_rss = vllm_rss = 0
            for pid in self.pids():
                try:
                    p = psutil.Process(pid)
                    rss = p.memory_info().rss
                except psutil.NoSuchProcess:
                    continue
                total += rss
                rec = self.per_pid.setdefault(pid, {"role": "?", "peak_rss": 0})
                role = _role(p)  # again each time: a process may rename itself after it starts
                rec["role"] = role if role != "?" else rec["role"]
                rec["peak_rss"] = max(rec["peak_rss"], rss)
                root_rss += rss if pid == self.root else 0
                vllm_rss += rss if rec["role"].lower().startswith("vllm") else 0
            self.samples.append((time.time(), total, root_rss, vllm_rss))
            self.peak_total = max(self.peak_total, total)
            self.peak_total_shm = max(self.peak_total_shm, total + max(0, _shm_used() - self.shm0))
            self._done.wait(self.period_s)

    def stop(self) -> dict[str, Any]:
        self._done.set()
        self.join()
        procs = sorted(self.per_pid.items(), key=lambda kv: -kv[1]["peak_rss"])
        return {
            "peak_total_rss_gib": self.peak_total / GIB,
            "peak_total_rss_plus_shm_gib": self.peak_total_shm / GIB,
            "processes": [
                {"pid": pid, "role": r["role"], "peak_rss_gib": r["peak_rss"] / GIB}
                for pid, r in procs
                if r["peak_rss"] > 50 * 2**20
            ],
        }


def _shm_used() -> int:
    try:
        return shutil.disk_usage("/dev/shm").used
    except OSError:
        return 0


def _env() -> dict[str, str]:
    quiet = {
        "DO_NOT_TRACK": "1",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    return {**os.environ, **quiet}


def run_pipeline(store: Path, overrides: list[str], kill_when: Path | None = None) -> dict[str, Any]:
    """``verl-flow run CONFIG overrides --run-id RUN_ID`` in ``store``, sampled; with ``kill_when``,
    the run's process group and every other process of its tree get SIGKILL once that path exists."""
    cmd = [VERL_FLOW, "run", CONFIG, f"store.url={store}", *overrides, "--run-id", RUN_ID]
    log = store / f"stdout-{int(time.time())}.log"
    store.mkdir(parents=True, exist_ok=True)
    load_start, t0 = os.getloadavg(), time.monotonic()
    killed: dict[str, Any] | None = None
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        sampler = TreeSampler(proc.pid)
        sampler.start()
        while proc.poll() is None:
            if kill_when is not None and kill_when.exists():
                killed = kill_tree(proc.pid, sampler.pids(), store)
                killed["at_s"] = time.monotonic() - t0
                break
            time.sleep(0.5)
        rc = proc.wait()
    memory = sampler.stop()
    memory["stage_peak"] = stage_memory(sampler.samples, store)
    wall = time.monotonic() - t0
    return {
        "cmd": " ".join(cmd[1:]),
        "rc": rc,
        "killed": killed,
        "wall_s": wall,
        "load_start": load_start,
        "load_end": os.getloadavg(),
        "log": str(log),
        **memory,
    }


def kill_tree(leader: int, pids: list[int], store: Path) -> dict[str, Any]:
    """SIGKILL to ``leader``'s process group (it was started in a session of its own) and to every
    process of its tree (a child that made a session of its own is outside the group), as a
    preempted machine would; says which checkpoints were committed at that moment."""
    ckpts = sorted(p.parent.name for p in (store / "runs" / RUN_ID / "ckpt").glob("iter-*/manifest.json"))
    with contextlib.suppress(ProcessLookupError):
        os.killpg(leader, signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return {"processes": len(pids), "checkpoints_committed": ckpts, "shm_used_gib": _shm_used() / GIB}


def stage_memory(samples: list[tuple[float, int, int, int]], store: Path) -> dict[str, dict[str, float]]:
    """Per task name: the peak RSS of the tree, of the root process and of the vLLM processes
    over the samples taken while it ran (its interval in the run log)."""
    out: dict[str, dict[str, float]] = {}
    for name, start, end in stage_intervals(store):
        inside = [x for x in samples if start <= x[0] <= end]
        if not inside:
            continue
        rec = out.setdefault(name, {"tree_gib": 0.0, "root_gib": 0.0, "vllm_gib": 0.0})
        for key, i in (("tree_gib", 1), ("root_gib", 2), ("vllm_gib", 3)):
            rec[key] = round(max(rec[key], max(x[i] for x in inside) / GIB), 2)
    return out


_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \| \w+ +\| (.*)$")
_DONE = re.compile(r"Task run '(.+)-[0-9a-f]+' - Finished in state Completed")


def stage_times(store: Path) -> dict[str, float]:
    """Seconds per task name (summed over iterations) from the run log(s) under ``store/logs``."""
    times: dict[str, float] = {}
    for name, start, end in stage_intervals(store):
        times[name] = times.get(name, 0.0) + end - start
    return times


def stage_intervals(store: Path) -> list[tuple[str, float, float]]:
    """``(task name, start, end)`` (epoch seconds) of every completed task in the run log(s)."""
    spans: list[tuple[str, float, float]] = []
    for path in sorted((store / "logs" / RUN_ID).glob("*.log")):
        prev = None
        for line in path.read_text(errors="replace").splitlines():
            m = _LINE.match(line)
            if not m:
                continue
            t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            done = _DONE.search(m.group(2))
            if done and prev is not None:
                spans.append((done.group(1), prev, t))
            if done or "Beginning" in m.group(2):
                prev = t
    return spans


def policy_sha256(store: Path, iteration: int) -> str | None:
    """sha256 of ``ckpt/iter-NNNN``'s policy weights, as its manifest records them."""
    manifest = store / "runs" / RUN_ID / "ckpt" / f"iter-{iteration:04d}" / "manifest.json"
    if not manifest.exists():
        return None
    files = json.loads(manifest.read_text())["files"]
    return next((f["sha256"] for f in files if f["name"].endswith("model.safetensors")), None)


def policy_file_sha256(store: Path, iteration: int) -> dict[str, str]:
    """sha256 of every ``*.safetensors`` under ``ckpt/iter-NNNN``, read from the files themselves,
    by path within the stage's attempt folder (``attempt-<time>-<id>/``, different in every run)."""
    root = store / "runs" / RUN_ID / "ckpt" / f"iter-{iteration:04d}"
    out = {}
    for path in sorted(root.rglob("*.safetensors")):
        h = hashlib.sha256()
        with path.open("rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
        out[str(path.relative_to(root).relative_to(path.relative_to(root).parts[0]))] = h.hexdigest()
    return out


SEED_STAGES = ("preprocess", "template_pack", "sft")


def seed_stages(reference: Path, store: Path) -> list[str]:
    """Hard-link the uninterrupted run's committed data and SFT stages into ``store`` (artifacts are
    immutable; a stage whose inputs and params match is skipped by the rerun), so that the kill-resume
    run spends its time on the RL iterations. Returns the stages linked."""
    linked = []
    for stage in SEED_STAGES:
        src = reference / "runs" / RUN_ID / stage
        if (src / "manifest.json").exists():
            shutil.copytree(src, store / "runs" / RUN_ID / stage, copy_function=os.link)
            linked.append(stage)
    return linked


def ask_server(store: Path, port: int) -> dict[str, Any]:
    """``verl-flow serve`` on the run's export, one chat question, then Ctrl-C (the server stops)."""
    cmd = [VERL_FLOW, "serve", RUN_ID, "--store", str(store), "--port", str(port)]
    cmd += ["--vllm-enforce-eager", "--cpu-kv-cache-gib", "0.5", "--max-model-len", "1024"]
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    sampler = TreeSampler(proc.pid)
    sampler.start()
    url = model = None
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        m = re.search(r"serving (\S+) as .* at (\S+)/v1 ", line)  # the CLI's readiness line
        if m:
            model, url = m.group(1), m.group(2)
            break
    result: dict[str, Any] = {"cmd": " ".join(cmd[1:]), "start_s": time.monotonic() - t0}
    if url is None:
        proc.wait()
        return {**result, "error": "".join(lines[-20:]), **sampler.stop()}
    t1 = time.monotonic()
    result.update(client=_client(), answer=_chat(url, model or RUN_ID), answer_s=time.monotonic() - t1)
    proc.send_signal(signal.SIGINT)
    try:
        result["exit_code"] = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        result["exit_code"] = "killed after 120 s"
    return {**result, **sampler.stop()}


def _client() -> str:
    try:
        import openai  # noqa: F401
    except ImportError:
        return "urllib (openai not installed)"
    return "openai"


def _chat(url: str, model: str) -> str:
    messages = [{"role": "user", "content": QUESTION}]
    if _client() == "openai":
        import openai

        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=48)  # type: ignore[arg-type]
        return reply.choices[0].message.content or ""
    body = json.dumps({"model": model, "messages": messages, "max_tokens": 48}).encode()
    req = urllib.request.Request(
        f"{url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())["choices"][0]["message"]["content"]


def _table(report: dict[str, Any]) -> None:
    for name, r in report["runs"].items():
        total, shm = r["peak_total_rss_gib"], r["peak_total_rss_plus_shm_gib"]
        print(f"\n{name}: rc {r['rc']}, wall {r['wall_s']:.0f} s, peak RSS {total:.2f} GiB (+ shm {shm:.2f})")
        for p in r["processes"]:
            print(f"  {p['role']:<28} pid {p['pid']:>7}  peak RSS {p['peak_rss_gib']:6.2f} GiB")
        peaks = r.get("stage_peak", {})
        for stage, s in r.get("stage_s", {}).items():
            m = peaks.get(stage, {})
            mem = (
                f"  peak tree {m['tree_gib']:5.2f} GiB (root {m['root_gib']:5.2f}, vLLM {m['vllm_gib']:5.2f})"
                if m
                else ""
            )
            print(f"  stage {stage:<22} {s:8.1f} s{mem}")
    for key in ("serve", "kill_resume"):
        if key in report:
            print(f"\n{key}: {json.dumps(report[key], indent=1, default=str)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", choices=sorted(VARIANTS), default="grpo")
    ap.add_argument("--kill-resume", action="store_true", help="kill -9 in RL iteration 2 and resume")
    ap.add_argument("--root", type=Path, default=REPO / "runs" / "scale_pipeline")
    ap.add_argument("--reference", type=Path, help="store of the uninterrupted run (default: <root>/grpo)")
    ap.add_argument(
        "--seed-stages",
        action="store_true",
        help="take the committed preprocess, template_pack and SFT of the reference (GRPO) run: a stage "
        "whose params and inputs match is skipped",
    )
    ap.add_argument(
        "--fresh-reference",
        action="store_true",
        help="with --kill-resume: first run the uninterrupted reference (same overrides, export and eval "
        "off) in <root>/<variant>-uninterrupted and take its data and SFT stages",
    )
    ap.add_argument("--no-serve", action="store_true", help="skip verl-flow serve")
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("overrides", nargs="*", help="dotted config overrides")
    args = ap.parse_args()

    overrides = [*VARIANTS[args.variant], *args.overrides]
    name = args.variant + ("-kill-resume" if args.kill_resume else "")
    report: dict[str, Any] = {
        "config": CONFIG,
        "overrides": overrides,
        "load_before": os.getloadavg(),
        "runs": {},
    }
    if not args.kill_resume:
        store = args.root / args.variant
        shutil.rmtree(store, ignore_errors=True)
        if args.seed_stages:
            report["stages_taken_from_the_grpo_run"] = seed_stages(args.root / "grpo", store)
        run = run_pipeline(store, overrides)
        run["stage_s"] = stage_times(store)
        report["runs"][args.variant] = run
        if run["rc"] == 0 and not args.no_serve and args.variant == "grpo":
            report["serve"] = ask_server(store, args.port)
    else:
        store = args.root / name
        shutil.rmtree(store, ignore_errors=True)
        # export and eval read the checkpoint and change no weights: off, to save their time
        lean = [*overrides, "export.enable=false", "eval.enable=false"]
        ref = args.reference or args.root / args.variant
        if args.fresh_reference:
            ref = args.root / f"{args.variant}-uninterrupted"
            shutil.rmtree(ref, ignore_errors=True)
            uninterrupted = run_pipeline(ref, lean)
            uninterrupted["stage_s"] = stage_times(ref)
            report["runs"]["uninterrupted"] = uninterrupted
        seeded = seed_stages(ref, store) if args.seed_stages or args.fresh_reference else []
        # iteration 2 (iter-0001) has its rollouts committed: its update is running when the kill lands
        marker = store / "runs" / RUN_ID / "iter-0001" / "reward" / "manifest.json"
        first = run_pipeline(store, lean, kill_when=marker)
        shm_before_resume = _shm_used() / GIB
        second = run_pipeline(store, lean)
        second["stage_s"] = stage_times(store)
        report["runs"].update(killed=first, resumed=second)
        iters = [o for o in overrides if o.startswith("trainer.total_iterations=")]
        last = int(iters[-1].split("=")[1]) if iters else 3
        mine, theirs = policy_sha256(store, last), policy_sha256(ref, last)
        files_mine, files_theirs = policy_file_sha256(store, last), policy_file_sha256(ref, last)
        report["kill_resume"] = {
            "killed_at": "iteration 2 (iter-0001), after its reward stage committed",
            "stages_taken_from_the_uninterrupted_run": seeded,
            "killed": first["killed"],
            "shm_used_gib_before_resume": shm_before_resume,
            "policy_sha256_resumed": mine,
            "policy_sha256_uninterrupted": theirs,
            "safetensors_sha256_resumed": files_mine,
            "safetensors_sha256_uninterrupted": files_theirs,
            "bit_identical": mine is not None and mine == theirs and files_mine == files_theirs,
        }
    report["load_after"] = os.getloadavg()
    args.root.mkdir(parents=True, exist_ok=True)
    out = args.root / f"{name}.json"
    out.write_text(json.dumps(report, indent=1, default=str))
    _table(report)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()

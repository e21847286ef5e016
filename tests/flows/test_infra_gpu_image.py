"""The GPU worker image (infra/docker/gpu-worker.Dockerfile) cannot be built here (no Docker, no GPU),
but what decides whether it builds can be checked on CPU:

- its two environments' Python requirements resolve for linux x86_64 with PyPI's CUDA wheels
  (``uv pip compile --python-platform``): the vLLM environment from infra/vllm/requirements-gpu.txt,
  the pipeline from pyproject.toml + flash-attn + its build dependencies under the vLLM
  environment's torch/transformers pins, as the Dockerfile installs them;
- the base image's CUDA major is the one the resolved torch wheel needs (torch's ``cuda-toolkit``
  and ``nvidia-*-cuNN`` requirements): torch's extension builder refuses an nvcc of another major
  (``torch.utils.cpp_extension._check_cuda_version``), so flash-attn would not compile;
- flash-attn (``--no-build-isolation``: its setup.py imports torch, packaging and wheel) is installed
  after torch and its build dependencies, with ``MAX_JOBS`` bounding the compile's memory.

Needs PyPI: skipped, saying so, only when uv cannot reach it; a resolution conflict fails."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "infra/docker/gpu-worker.Dockerfile"
PLATFORM = "x86_64-manylinux_2_28"  # linux x86_64, glibc 2.28+ (Ubuntu 24.04 has 2.39)
BUILD_DEPS = ("packaging", "wheel", "setuptools", "ninja")
NETWORK_ERRORS = (
    "error sending request",
    "dns error",
    "Failed to fetch",
    "client error (Connect)",
    "timed out",
)


# ---------------------------------------------------------------- reading the Dockerfile


class Image(NamedTuple):
    cuda_major: int  # of the base image's toolkit (its nvcc)
    python: str  # "3.12"
    flash_attn: str  # the version installed
    pinned: tuple[str, ...]  # what the pipeline takes from the vLLM environment's versions
    vllm_requirements: Path
    commands: list[str]  # the shell commands of the RUN instructions, in order


def read_image(text: str) -> Image:
    """The facts the check needs from the Dockerfile's text (its ARG defaults and RUN commands)."""
    joined = re.sub(r"\\\n", " ", text)  # continuation lines joined
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", joined, re.M))
    base = re.fullmatch(r"(?:[\w.-]+/)*cuda:(\d+)\.\d+(?:\.\d+)?-\S*devel\S*", args["CUDA_IMAGE"])
    assert base, f"CUDA_IMAGE={args['CUDA_IMAGE']}: expected an nvidia/cuda:X.Y.Z-*devel* image"
    runs = re.findall(r"^RUN (.*)$", joined, re.M)
    commands = [c.strip() for run in runs for c in run.split("&&")]
    python = re.search(r"python3\.(\d+) -m venv", joined)
    pins = re.search(r"grep -iE '\^\(([\w|-]+)\)=='", joined)
    requirements = re.search(r"-r \S*?(infra/vllm/[\w.-]+\.txt)", joined)
    assert python and pins and requirements, "the Dockerfile's venvs, pins or vLLM requirements moved"
    return Image(
        cuda_major=int(base.group(1)),
        python=f"3.{python.group(1)}",
        flash_attn=args["FLASH_ATTN_VERSION"],
        pinned=tuple(pins.group(1).split("|")),
        vllm_requirements=REPO / requirements.group(1),
        commands=commands,
    )


def pip_of(command: str) -> str | None:
    """The pip a command runs (``/opt/venv/bin/pip``, ``pip``: which environment), or None."""
    return next((w for w in command.split() if w == "pip" or w.endswith("/pip")), None)


def pip_installs(command: str) -> list[str]:
    """The requirement arguments of a ``pip install`` command (options and their values dropped)."""
    words = command.replace('"', "").replace("'", "").split()
    if "install" not in words or pip_of(command) is None:
        return []
    args = words[words.index("install") + 1 :]
    out, skip = [], False
    for word in args:
        if skip:
            skip = False
        elif word in ("-c", "-r", "--constraint", "--requirement"):
            skip = True
        elif not word.startswith("-"):
            out.append(re.split(r"[=<>!~\[]", word)[0].lower())
    return out


# ---------------------------------------------------------------- resolving with uv


class Pin(NamedTuple):
    version: str
    via: tuple[str, ...]  # the packages that require it


def uv() -> str:
    found = Path(sys.executable).with_name("uv")
    path = str(found) if found.exists() else shutil.which("uv")
    assert path, "uv is missing: make install puts it into .venv (pip install 'uv>=0.9,<1')"
    return path


def compile_for_gpu(
    env: str, python: str, files: list[Path], lines: list[str], tmp: Path, constraints: dict[str, str]
) -> dict[str, Pin]:
    """``uv pip compile`` of requirement ``files`` (requirements.txt, pyproject.toml) and ``lines`` for
    linux x86_64 and ``python``, under ``constraints``: name → the pinned version and what pulled it in."""
    req = tmp / f"{env}.in"
    req.write_text("\n".join(lines) + "\n")
    cons = tmp / f"{env}-constraints.txt"
    cons.write_text("".join(f"{k}=={v}\n" for k, v in constraints.items()))
    cmd = [uv(), "pip", "compile", "--python-platform", PLATFORM, "--python-version", python]
    cmd += ["--no-header", "--annotation-style", "line", "--no-python-downloads", "-c", str(cons)]
    cmd += [*map(str, files), str(req)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO)
    if done.returncode != 0:
        if "No solution found" not in done.stderr and any(e in done.stderr for e in NETWORK_ERRORS):
            pytest.skip(
                f"PyPI unreachable, the GPU image's requirements were not resolved: {done.stderr[-300:]}"
            )
        pytest.fail(f"the GPU image's requirements do not resolve ({' '.join(cmd)}):\n{done.stderr}")
    pins: dict[str, Pin] = {}
    for line in done.stdout.splitlines():
        m = re.match(r"([\w.-]+)==(\S+)(?:\s+# via (.*))?$", line)
        if m:
            via = tuple(v.strip() for v in (m.group(3) or "").split(","))
            pins[m.group(1).lower()] = Pin(m.group(2), via)
    return pins


def cuda_majors_of(pins: dict[str, Pin], dist: str) -> set[int]:
    """The CUDA majors ``dist``'s own requirements name: ``cuda-toolkit==13.0.3`` → 13,
    ``nvidia-nccl-cu13`` → 13."""
    majors = set()
    for name, pin in pins.items():
        if dist not in pin.via:
            continue
        if name == "cuda-toolkit":
            majors.add(int(pin.version.split(".")[0]))
        elif m := re.fullmatch(r"nvidia-[\w-]+-cu(\d+)", name):
            majors.add(int(m.group(1)))
    return majors


# ---------------------------------------------------------------- the checks


def test_read_image_of_a_known_dockerfile() -> None:
    # the parser itself, on a hand-written two-venv Dockerfile: CUDA 12 devel, python 3.11
    text = (
        "ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-devel-ubuntu22.04\nFROM ${CUDA_IMAGE}\n"
        "ARG FLASH_ATTN_VERSION=2.8.3\n"
        "RUN python3.11 -m venv /opt/venv && /opt/v/bin/pip install -r /x/infra/vllm/req.txt\n"
        "RUN pip freeze | grep -iE '^(torch|triton)==' > p \\\n && pip install -c p torch 'wheel>=0.4'\n"
    )
    image = read_image(text)
    assert (image.cuda_major, image.python, image.flash_attn) == (12, "3.11", "2.8.3")
    assert image.pinned == ("torch", "triton")
    assert image.vllm_requirements == REPO / "infra/vllm/req.txt"
    assert [pip_installs(c) for c in image.commands][-2:] == [[], ["torch", "wheel"]]


def test_flash_attn_is_built_after_torch_and_its_build_dependencies() -> None:
    image = read_image(DOCKERFILE.read_text())
    installs = [pip_installs(c) for c in image.commands]
    at = next((i for i, names in enumerate(installs) if "flash-attn" in names), None)
    assert at is not None, "the GPU image does not install flash-attn"
    command = image.commands[at]
    assert "--no-build-isolation" in command and "MAX_JOBS=" in command, command
    same_env = [i for i in range(at) if pip_of(image.commands[i]) == pip_of(command)]
    before = {name for i in same_env for name in installs[i]}
    missing = [d for d in ("torch", *BUILD_DEPS) if d not in before]
    assert not missing, f"installed only after flash-attn's build, which imports them: {missing}"


def test_gpu_image_requirements_resolve_for_the_base_images_cuda(tmp_path: Path) -> None:
    image = read_image(DOCKERFILE.read_text())
    # 1. the vLLM environment: vLLM decides torch (and with it the CUDA major)
    vllm_env = compile_for_gpu("vllm", image.python, [image.vllm_requirements], [], tmp_path, {})
    assert "vllm" in vllm_env and "torch" in vllm_env
    majors = cuda_majors_of(vllm_env, "torch")
    assert len(majors) == 1, f"torch {vllm_env['torch'].version} names CUDA majors {majors}"
    assert majors == {image.cuda_major}, (
        f"torch {vllm_env['torch'].version} (vllm {vllm_env['vllm'].version}) is a CUDA {majors.pop()} "
        f"build, the image's base is CUDA {image.cuda_major}: flash-attn's build would fail torch's "
        "CUDA version check"
    )
    # 2. the pipeline: the project, flash-attn and its build dependencies under the vLLM env's pins
    pins = {name: vllm_env[name].version for name in image.pinned if name in vllm_env}
    assert "torch" in pins, image.pinned
    lines = [f"flash-attn=={image.flash_attn}", *BUILD_DEPS]
    pipeline = compile_for_gpu("pipeline", image.python, [REPO / "pyproject.toml"], lines, tmp_path, pins)
    for name, version in pins.items():
        assert pipeline[name].version == version, (name, pipeline[name].version, version)
    assert {"prefect", "mlflow", "flash-attn"} <= set(pipeline)
    assert cuda_majors_of(pipeline, "torch") == {image.cuda_major}


def test_k8s_pods_mount_a_memory_backed_dev_shm() -> None:
    # weight syncs stage the whole policy in /dev/shm (verl_core.rollout.weight_sync); a pod's default
    # is 64 MB, like Docker's: every GPU manifest mounts a memory emptyDir there
    k8s = REPO / "infra/k8s"
    pods = [
        json.loads((k8s / name).read_text())["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
        for name in ("gpu-base-job-template.json", "spmd-base-job-template.json")
    ]
    pods.append(yaml.safe_load((k8s / "spmd-job.yaml").read_text())["spec"]["template"]["spec"])
    for pod in pods:
        memory = {v["name"] for v in pod["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"}
        mounts = {
            m["name"] for c in pod["containers"] for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"
        }
        assert mounts and mounts <= memory, (mounts, memory)

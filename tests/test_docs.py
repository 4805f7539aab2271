"""The docs (README.md and docs/) document every CLI command, option and recipe key the code
has, and the MkDocs site builds with no broken link."""

from __future__ import annotations

import re
import subprocess
import sys

import click

from conftest import ROOT
from hypercli.cli import cli

README = (ROOT / "README.md").read_text()
DOCS = README + "".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))


def _commands(group: click.Group, prefix: str = "hyper"):
    for name, cmd in group.commands.items():
        if cmd.hidden:
            continue
        yield f"{prefix} {name}", cmd
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, f"{prefix} {name}")


def test_every_command_and_option_is_in_the_docs():
    names = [name for name, _ in _commands(cli)]
    assert "hyper data mount" in names  # the walk reaches sub-groups
    for name, cmd in _commands(cli):
        assert name in DOCS, f"`{name}` is not documented"
        for p in cmd.params:
            if isinstance(p, click.Option):
                for opt in p.opts + p.secondary_opts:
                    if opt.startswith("--") and opt != "--help":
                        assert opt in DOCS, f"`{name} {opt}` is not documented"


def test_readme_opens_with_the_two_commands():
    blocks = re.findall(r"```bash\n(.*?)```", README, re.S)
    assert "hyper run recipes/quickstart.yaml" in blocks[0]
    assert "scripts/test.sh" in blocks[1]
    assert "scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_every_recipe_key_is_in_the_docs():
    from hypercli import recipe
    keys = set(recipe._TOP_KEYS) | set(recipe._EXPERIMENT_KEYS) | set(recipe._CLUSTER_KEYS)
    keys |= set(recipe._RANGE_KEYS) - {"type"}
    for key in sorted(keys):
        assert re.search(rf"\b{key}:", DOCS), f"recipe key {key!r} is not in the docs"


def test_every_docs_page_is_linked_from_the_readme_and_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert page.name in nav, f"docs/{page.name} is not in mkdocs.yml's nav"
        if page.name != "index.md":
            assert f"docs/{page.name}" in README, f"README.md does not link docs/{page.name}"


def test_the_site_builds_strictly(tmp_path):
    """``mkdocs build --strict``: a broken link or anchor, a page missing from the nav or a
    command whose help cannot be generated fails the build."""
    p = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q",
                        "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    page = (tmp_path / "site" / "cli-generated" / "index.html").read_text()
    assert "hyper data mount" in page and "--warm-entries" in page

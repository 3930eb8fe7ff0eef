"""The docs: the generated CLI reference matches the parser, the site builds in strict mode, and the
README stays a page with the two commands."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _cli_docs_module():
    spec = importlib.util.spec_from_file_location("gen_cli_docs", ROOT / "tools" / "gen_cli_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_reference_is_up_to_date():
    gen = _cli_docs_module()
    if (ROOT / "docs" / "cli.md").read_text() != gen.render():
        pytest.fail(f"docs/cli.md is stale (the argument parser changed): run "
                    f"`{gen.REGENERATE}` and commit the result", pytrace=False)


def test_cli_reference_names_every_subcommand():
    from jaxserve.entrypoints.cli import build_parser

    gen = _cli_docs_module()
    text = gen.render()
    for name, _, sub in gen._subcommands(build_parser()):
        assert f"## `jaxserve {name}`" in text
        for flag in (o for a in sub._actions for o in a.option_strings if o not in ("-h", "--help")):
            assert f"`{flag}" in text, flag


def test_readme_is_a_page_with_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 220
    assert "make serve" in readme and "make test" in readme


def test_mkdocs_builds_in_strict_mode(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed (it is in the dev extra: pip install -e '.[dev]')")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                             "--site-dir", str(tmp_path / "site")],
                            cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stdout + result.stderr

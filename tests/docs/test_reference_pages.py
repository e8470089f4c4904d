"""The generated reference pages (docs/gen/reference_pages.py) without a site build: every command,
option and config key is on its page, as the command line itself shows them."""

from __future__ import annotations

import importlib.util
import re
from types import ModuleType

import click
from click.testing import CliRunner

from pflkit.cli import main
from pflkit.config import describe_keys
from tests.support.paths import REPO


def _pages() -> ModuleType:
    spec = importlib.util.spec_from_file_location("reference_pages", REPO / "docs" / "gen" / "reference_pages.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pages = _pages()


def test_every_command_and_option_is_on_the_cli_page() -> None:
    page = pages.cli_page()
    listed = list(pages.commands())
    assert {ctx.command_path for ctx, _ in listed} >= {"pflkit run", "pflkit sweep", "pflkit config", "pflkit plot ala"}
    for ctx, command in listed:
        assert f"\n## {ctx.command_path}\n" in page, ctx.command_path
        section = page.split(f"\n## {ctx.command_path}\n")[1].split("\n## ")[0]
        for param in command.params:
            if isinstance(param, click.Option) and not param.hidden:
                for opt in param.opts + param.secondary_opts:
                    assert opt in section, f"{ctx.command_path} {opt}"
    assert page.count("\n## ") == len(listed)


def test_the_cli_page_keeps_the_examples_and_escapes_markdown() -> None:
    page = pages.cli_page()
    run = page.split("\n## pflkit run\n")[1].split("\n## ")[0]
    assert "```bash\npflkit run " in run and "pflkit run --resume results/quick" in run
    assert "results/&lt;name&gt;-&lt;timestamp&gt;" in run  # not an HTML tag
    assert "\b" not in page


def test_every_command_shows_an_example() -> None:
    page = pages.cli_page()
    for ctx, command in pages.commands():
        if not isinstance(command, click.Group):
            section = page.split(f"\n## {ctx.command_path}\n")[1].split("\n## ")[0]
            examples = section.partition("**Examples**\n\n```bash\n")[2].partition("```")[0]
            assert re.search(rf"^{ctx.command_path}\b", examples, flags=re.M), f"{ctx.command_path}: no example"


def test_every_config_key_is_on_the_config_page_as_config_keys_prints_it() -> None:
    page = pages.config_page()
    printed = CliRunner().invoke(main, ["config", "--keys"]).output
    lines = re.findall(r"^(\S+)(?: \(flat: (\S+)\))? = (.+)$", printed, flags=re.M)
    assert len(lines) == len(describe_keys()) > 50
    for key, alias, default in lines:
        alias_cell = pages._name(alias) if alias else ""
        assert f"| {pages._name(key)} | {alias_cell} | `{default}` |" in page, key


def test_every_config_key_says_what_it_means() -> None:
    assert [key for key, _, _, meaning in describe_keys() if not meaning] == []

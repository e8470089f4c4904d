"""The reference pages generated at build time: the command line from pflkit's click command tree,
the config keys from the schema (what ``pflkit config --keys`` prints). Pure functions: the build's
script (reference.py) writes their Markdown, and the tests read it without a build."""

from __future__ import annotations

import html
import inspect
import json
import re
from collections.abc import Iterator
from typing import Any

import click

from pflkit.cli import main
from pflkit.config import config_model, describe_keys


def commands(
    group: click.Group = main, ctx: click.Context | None = None
) -> Iterator[tuple[click.Context, click.Command]]:
    """Every visible command below ``group``, depth first, by name, each with its click context
    (``ctx.command_path`` is ``pflkit plot ala``)."""
    ctx = ctx or click.Context(group, info_name="pflkit")
    for name in sorted(group.list_commands(ctx)):
        command = group.get_command(ctx, name)
        if command is None or command.hidden:
            continue
        sub = click.Context(command, info_name=name, parent=ctx)
        yield sub, command
        if isinstance(command, click.Group):
            yield from commands(command, sub)


def _text(text: str) -> str:
    """Click help text as Markdown: no ``\\b`` markers, ``code`` in single backticks, and outside code
    the brackets, pipes and HTML-like words (``<name>``) shown as written."""
    text = "\n".join(line for line in inspect.cleandoc(text).splitlines() if line.strip() != "\b")
    pieces = re.split(r"(``?[^`]+``?)", text)  # odd pieces: code spans
    return "".join(
        "`" + piece.strip("`") + "`" if i % 2 else re.sub(r"([\[\]*|])", r"\\\1", html.escape(piece, quote=False))
        for i, piece in enumerate(pieces)
    )


def _examples(epilog: str) -> str:
    """A command's examples (the lines of its epilog that run pflkit) as a shell block."""
    lines = [line.strip() for line in epilog.splitlines() if line.strip().startswith("pflkit ")]
    return "**Examples**\n\n```bash\n" + "\n".join(lines) + "\n```\n" if lines else ""


def _summary(command: click.Command) -> str:
    """The first paragraph of a command's help."""
    return _text(inspect.cleandoc(command.help or "").split("\n\n")[0]).replace("\n", " ")


def _anchor(ctx: click.Context) -> str:
    """The id of a command's heading (the toc extension's slug of ``pflkit plot ala``)."""
    return ctx.command_path.replace(" ", "-")


def _command_list(group: click.Group, ctx: click.Context) -> str:
    """A linked list of the commands below ``group``, each with its summary."""
    return "\n".join(f"- [`{sub.command_path}`](#{_anchor(sub)}): {_summary(cmd)}" for sub, cmd in commands(group, ctx))


def _command(ctx: click.Context, command: click.Command) -> str:
    """One command's section: usage, help, options (as ``--help`` shows them), subcommands, examples."""
    usage = command.get_usage(ctx).removeprefix("Usage: ")
    parts = [f"## {ctx.command_path}", f"```text\n{usage}\n```", _text(command.help or "")]
    help_option = command.get_help_option(ctx)
    rows = [
        record
        for param in command.get_params(ctx)
        if isinstance(param, click.Option)
        and param is not help_option
        and (record := param.get_help_record(ctx)) is not None
    ]
    if rows:
        table = "\n".join(f"| `{names}` | {_text(help)} |" for names, help in rows)
        parts.append("| option | meaning |\n|---|---|\n" + table)
    if isinstance(command, click.Group):
        parts.append("Commands:\n\n" + _command_list(command, ctx))
    parts.append(_examples(command.epilog or ""))
    return "\n\n".join(p for p in parts if p) + "\n"


def cli_page() -> str:
    """The command-line reference: every command and option of ``pflkit``."""
    root = click.Context(main, info_name="pflkit")
    options = "\n".join(
        f"| `{names}` | {_text(help)} |"
        for param in main.get_params(root)
        if (record := param.get_help_record(root)) is not None
        for names, help in [record]
    )
    head = [
        "# Command line",
        "Every command of `pflkit`, read from the command line's own definitions; "
        "`pflkit COMMAND --help` prints the same.",
        f"```text\n{main.get_usage(root).removeprefix('Usage: ')}\n```",
        _text(main.help or ""),
        "| option | meaning |\n|---|---|\n" + options,
        "Commands:\n\n" + _command_list(main, root),
    ]
    return "\n\n".join(head) + "\n\n" + "\n".join(_command(ctx, cmd) for ctx, cmd in commands())


def shown_default(default: Any) -> str:
    """A default as ``pflkit config --keys`` prints it: JSON, or ``unset``."""
    return "unset" if default is None else json.dumps(default)


def _name(key: str) -> str:
    """A key as code that a narrow column may break after its dots."""
    return "<code>" + key.replace(".", ".<wbr>") + "</code>"


def config_page() -> str:
    """The config reference: every key by section, with its flat alias, default and meaning."""
    fields = config_model().model_fields
    sections: dict[str, list[str]] = {}
    for key, alias, default, meaning in describe_keys():
        section = key.split(".")[0] if "." in key else ""
        row = f"| {_name(key)} | {_name(alias) if alias else ''} | `{shown_default(default)}` | {_text(meaning)} |"
        sections.setdefault(section, []).append(row)
    parts = [
        "# Configuration keys",
        "Every key a config accepts, read from the config schema (`pflkit config --keys` prints the "
        "same list). A key is set in a TOML file (`[train]` then `local_epochs = 5`) or on the command "
        "line as `train.local_epochs=5`; a flat alias (`local_epochs=5`) sets the same key. A method's "
        "section is read only when `algorithms` names that method.",
    ]
    for section, rows in sections.items():
        about = fields[section].description if section else "the experiment itself"
        title = f"[{section}]" if section else "Top level"
        parts.append(
            f"## {title}\n\n{_text(about or '')}\n\n| key | flat alias | default | meaning |\n|---|---|---|---|"
        )
        parts[-1] += "\n" + "\n".join(rows)
    return "\n\n".join(parts) + "\n"

"""Write docs/cli.md, the command-line reference, from the argument parser itself.

    python tools/gen_cli_docs.py            # rewrite docs/cli.md
    python tools/gen_cli_docs.py --check    # exit 1 when docs/cli.md is stale

Only argparse's own objects are read (the parser `jaxserve.entrypoints.cli.build_parser()`
returns), so however the flags are declared, the reference is what `jaxserve --help` knows.
argparse has no public API to walk a parser, so this reads its `_actions` and `_action_groups`
(as sphinx-argparse does); no terminal-width-dependent text (usage lines) is used, so the output
is the same on every machine.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jaxserve.entrypoints.cli import build_parser

OUT = Path(__file__).resolve().parent.parent / "docs" / "cli.md"
REGENERATE = "python tools/gen_cli_docs.py"
HEADER = f"""# Command line

<!-- Generated from jaxserve.entrypoints.cli.build_parser() by `{REGENERATE}`;
     do not edit by hand (tests/test_docs.py fails when this file is stale). -->

Every error a user can cause prints one line (`error: ...`) on stderr and exits with status 1.
Flags left out of an engine command fall back to the model's registry defaults (`configs/*.toml`),
then to the config dataclasses' defaults.
"""


def _subcommands(parser: argparse.ArgumentParser):
    """(name, help, subparser) for each subcommand, in declaration order."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield name, helps.get(name), sub


def _cell(text: str) -> str:
    """One line of Markdown table text: no pipes, emphasis or HTML from help strings."""
    text = " ".join(str(text).split())
    for char, escaped in (("|", "\\|"), ("*", "\\*"), ("<", "&lt;")):
        text = text.replace(char, escaped)
    return text


def _flag(action: argparse.Action) -> str:
    if not action.option_strings:
        name = action.metavar or action.dest
        return f"`{name}`" + (" ..." if action.nargs in ("+", "*") else "")
    takes = action.nargs != 0
    if takes and action.choices is not None:
        arg = "{" + ",".join(map(str, action.choices)) + "}"
    elif takes:
        arg = action.metavar or action.dest.upper()
    else:
        arg = ""
    return ", ".join(f"`{o}{' ' + arg if arg else ''}`" for o in action.option_strings)


def _default(action: argparse.Action) -> str:
    if not action.option_strings:  # a positional argument: given, or nargs says how often
        return ""
    if action.required:
        return "required"
    d = action.default
    if d is None or d is argparse.SUPPRESS or action.nargs == 0:
        return ""
    return f"`{d}`"


def _help(action: argparse.Action, prog: str) -> str:
    text = action.help or ""
    if "%" in text:  # argparse's own expansion of %(default)s, %(prog)s, ...
        text = text % dict(vars(action), prog=prog)
    return _cell(text)


def _section(parser: argparse.ArgumentParser, path: list[str], help_text: str | None) -> list[str]:
    title = " ".join(path)
    lines = [f"## `{title}`", ""]
    if help_text:
        text = _cell(help_text)
        lines += [text[0].upper() + text[1:] + ".", ""]
    subs = list(_subcommands(parser))
    for group in parser._action_groups:
        actions = [a for a in group._group_actions
                   if a.help is not argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)
                   and not isinstance(a, argparse._SubParsersAction)]
        if not actions:
            continue
        title = {"positional arguments": "arguments", "optional arguments": "options"}.get(
            group.title, group.title)
        lines += [f"**{_cell(title)}**" + (f": {_cell(group.description)}"
                                           if group.description else ""), ""]
        lines += ["| argument | default | meaning |", "|---|---|---|"]
        lines += [f"| {_flag(a)} | {_default(a)} | {_help(a, ' '.join(path))} |"
                  for a in actions]
        lines.append("")
    if subs:
        lines += ["Subcommands: " + ", ".join(f"`{title} {name}`" for name, _, _ in subs) + ".", ""]
    for name, sub_help, sub in subs:
        lines += _section(sub, path + [name], sub_help)
    return lines


def render() -> str:
    parser = build_parser()
    lines = [HEADER]
    for name, help_text, sub in _subcommands(parser):
        lines += _section(sub, [parser.prog, name], help_text)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale: run `{REGENERATE}`", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""A Sphinx directive that renders an argparse parser, so the CLI reference is built from the code.

Usage in a MyST page::

    ```{cli-reference} phasesched.cli:build_parser
    ```

The argument names a function that returns an :class:`argparse.ArgumentParser` (default
``phasesched.cli:build_parser``). The directive emits one section per command and subcommand,
nested as the subparsers are, each with its usage line, its description, and every positional
argument and option with its help text, choices and default. Nothing is copied by hand, so the
page cannot drift from the parser.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import re
from collections.abc import Iterator
from typing import Any, ClassVar

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective

_OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
"""An option named in running text, such as ``--trace``: shown as code, not typographic dashes."""
_USAGE_WIDTH = 88  # columns of the usage line, fixed so the page does not depend on the terminal


def load_parser(spec: str) -> argparse.ArgumentParser:
    """Call ``"module:function"`` and return the parser it builds.

    >>> load_parser("argparse:ArgumentParser").prog is not None
    True
    """
    module_name, _, function_name = spec.partition(":")
    factory = getattr(importlib.import_module(module_name), function_name or "build_parser")
    parser = factory()
    if not isinstance(parser, argparse.ArgumentParser):
        msg = f"{spec} returned {type(parser).__name__}, not an argparse.ArgumentParser"
        raise TypeError(msg)
    return parser


def subcommands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, str, argparse.ArgumentParser]]:
    """``(name, one-line help, parser)`` of each subcommand of ``parser``, in declaration order."""
    for action in parser._actions:  # noqa: SLF001 -- argparse offers no public view of its actions
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}  # noqa: SLF001
            for name, sub in action.choices.items():
                yield name, helps.get(name, ""), sub


def sentence(text: str) -> str:
    """``text`` as a sentence: first letter capitalised, a full stop at the end.

    >>> sentence("seed of every random workload (default 0)")
    'Seed of every random workload (default 0).'
    """
    text = text.strip()
    if not text:
        return text
    text = text[0].upper() + text[1:]
    return text if text.endswith((".", "!", "?")) else text + "."


def _hidden_default(default: object) -> bool:
    return default is None or default is False or default is argparse.SUPPRESS or default == []


def details(action: argparse.Action, formatter: argparse.HelpFormatter) -> list[str]:
    """The sentences that describe an argument: its help, then choices, default and repetition."""
    text = formatter._expand_help(action) if action.help else ""  # noqa: SLF001 -- expands %(default)s
    choices = [] if isinstance(action, argparse._SubParsersAction) else list(action.choices or ())  # noqa: SLF001
    for choice in choices:  # "default: a small grid; gpu: ..." names choices: show them as code
        text = re.sub(rf"(?<![\w`-]){re.escape(str(choice))}:", f"``{choice}``:", text)
    parts = [sentence(text)]
    if choices:
        parts.append("Choices: " + ", ".join(f"``{choice}``" for choice in choices) + ".")
    if not _hidden_default(action.default) and action.nargs != 0 and "(default" not in text:
        parts.append(f"Default: ``{action.default}``.")
    if action.required and action.option_strings:
        parts.append("Required.")
    if isinstance(action, argparse._AppendAction):  # noqa: SLF001
        parts.append("Repeatable.")
    return [part for part in parts if part]


class CliReference(SphinxDirective):
    """``cli-reference``: sections for a parser and all its subcommands."""

    optional_arguments = 1
    has_content = False
    option_spec: ClassVar[dict[str, Any]] = {}

    def run(self) -> list[nodes.Node]:
        """Build the sections of the parser named by the argument."""
        parser = load_parser(self.arguments[0] if self.arguments else "phasesched.cli:build_parser")
        return [self._section(parser, parser.prog, parser.description or "")]

    def _section(self, parser: argparse.ArgumentParser, title: str, summary: str) -> nodes.section:
        label = nodes.make_id(f"cli {title}")
        section = nodes.section(ids=[label], names=[label])
        self.state.document.note_explicit_target(section)
        section += nodes.title("", "", nodes.literal(title, title))
        parser.formatter_class = functools.partial(argparse.HelpFormatter, width=_USAGE_WIDTH)
        usage = parser.format_usage().removeprefix("usage: ").strip()
        section += nodes.literal_block(usage, usage, language="text")
        if parser.description or summary:
            section += self._paragraph(sentence(parser.description or summary))
        formatter = parser._get_formatter()  # noqa: SLF001 -- the formatter argparse itself would use
        visible = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]  # noqa: SLF001
        positionals = [a for a in visible if not a.option_strings and not isinstance(a, argparse._SubParsersAction)]  # noqa: SLF001
        options = [a for a in visible if a.option_strings]
        for heading, actions in (("Arguments", positionals), ("Options", options)):
            if actions:
                section += nodes.rubric(heading, heading)
                section += self._definitions(actions, formatter)
        commands = list(subcommands(parser))
        if commands:
            section += nodes.rubric("Commands", "Commands")
            listing = nodes.bullet_list()
            for name, help_text, _ in commands:
                item = nodes.list_item()
                paragraph = nodes.paragraph()
                target = nodes.make_id(f"cli {title} {name}")
                paragraph += nodes.reference("", "", nodes.literal(name, name), internal=True, refid=target)
                paragraph += nodes.Text(f": {sentence(help_text)}" if help_text else "")
                item += paragraph
                listing += item
            section += listing
        for name, help_text, sub in commands:
            section += self._section(sub, f"{title} {name}", help_text)
        return section

    def _definitions(self, actions: list[argparse.Action], formatter: argparse.HelpFormatter) -> nodes.definition_list:
        listing = nodes.definition_list()
        for action in actions:
            item = nodes.definition_list_item()
            written = formatter._format_action_invocation(action)  # noqa: SLF001 -- as --help writes it
            item += nodes.term("", "", nodes.literal(written, written))
            definition = nodes.definition()
            definition += self._paragraph(" ".join(details(action, formatter)))
            item += definition
            listing += item
        return listing

    def _paragraph(self, text: str) -> nodes.paragraph:
        """A paragraph of ``text``; its ``code`` spans and ``--options`` are rendered as literals."""
        paragraph = nodes.paragraph()
        for i, part in enumerate(text.replace("``", "`").split("`")):
            pieces = [part] if i % 2 else _OPTION.split(part)  # odd: inside backticks
            for j, piece in enumerate(pieces):
                if piece:
                    code = i % 2 == 1 or j % 2 == 1
                    paragraph += nodes.literal(piece, piece) if code else nodes.Text(piece)
        return paragraph


def setup(app: Sphinx) -> dict[str, Any]:
    """Register the directive."""
    app.add_directive("cli-reference", CliReference)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}

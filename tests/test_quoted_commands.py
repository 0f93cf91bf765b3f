"""Every `python -m model_check...` / `python -m rowcache...` command quoted in the docs parses.

The documents are README.md, spec/*.md, spec/*.toml, docs/*.md and the run records
docs/records/*.md. A command is quoted in a `backtick span` (which may wrap across lines), on a
line of a fenced code block, or on an indented code line. Each is parsed with the real parser
of the module `python -m` would run, without running the command: the module's `main(argv)` is
called with `argparse.ArgumentParser.parse_args` intercepted, so the parser `main` builds
parses the arguments and the run stops there. Placeholders the prose uses (`MUTANT`, `OUTDIR`)
are replaced by a value of their kind first.
"""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn
from unittest import mock

import pytest

from model_check.table.mutants import MUTANTS

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = (
    sorted(ROOT.glob("README.md"))
    + sorted((ROOT / "spec").glob("*.md"))
    + sorted((ROOT / "spec").glob("*.toml"))
    + sorted((ROOT / "docs").glob("*.md"))
    + sorted((ROOT / "docs" / "records").glob("*.md"))
)
CHECKED = ("model_check", "rowcache")
PLACEHOLDERS = {"MUTANT": MUTANTS[0].name, "OUTDIR": "out"}
SHELL_STOP = ("|", "||", "&&", ";", ">", ">>", "2>&1", "&")

_FENCE = re.compile(r"^```.*?^```", re.M | re.S)
_SPAN = re.compile(r"`([^`]+)`")
_COMMAND = re.compile(r"(?:^|[\s(])(?:[\w./-]*/)?python3? -m ([\w.]+)(.*)$", re.S)


class Command:
    def __init__(self, where: str, module: str, argv: list[str]) -> None:
        self.where, self.module, self.argv = where, module, argv

    def __str__(self) -> str:
        return " ".join(["python -m", self.module, *self.argv])


def candidates(text: str) -> Iterator[str]:
    """Text that may hold a command: fenced lines, backtick spans, indented code lines."""
    for block in _FENCE.findall(text):
        # A line ending in a backslash goes on in the next one, as the shell reads it.
        joined = re.sub(r"\\\n\s*", " ", block)
        yield from joined.splitlines()[1:-1]
    text = _FENCE.sub("", text)
    for span in _SPAN.findall(text):
        yield " ".join(span.split())
    text = _SPAN.sub("", text)
    for line in text.splitlines():
        if line.startswith(("    ", "\t")):
            yield line.strip().removeprefix("$ ")


def commands(text: str, where: str) -> list[Command]:
    out = []
    for chunk in candidates(text):
        found = _COMMAND.search(chunk)
        if found is None:
            continue
        module, rest = found.group(1), found.group(2)
        if module.split(".")[0] not in CHECKED:
            continue
        argv: list[str] = []
        for token in shlex.split(rest, comments=False):
            if token in SHELL_STOP:
                break
            argv.append(PLACEHOLDERS.get(token, token))
        out.append(Command(where, module, argv))
    return out


def quoted_commands() -> list[Command]:
    found = []
    for path in DOCUMENTS:
        found += commands(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    return found


class _Parsed(Exception):
    def __init__(self, namespace: argparse.Namespace) -> None:
        super().__init__()
        self.namespace = namespace


def parse_only(module: str, argv: list[str]) -> argparse.Namespace:
    """Parse `python -m module argv`'s arguments with the parser the module's `main` builds,
    stopping before anything else runs; SystemExit when the parser rejects them."""
    target = importlib.import_module(module)
    if hasattr(target, "__path__"):  # a package: `python -m` runs its __main__
        target = importlib.import_module(f"{module}.__main__")
    main = getattr(target, "main", None)
    assert callable(main), f"{target.__name__} has no main(argv) to take the parser from"
    real = argparse.ArgumentParser.parse_args

    def intercept(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> NoReturn:
        raise _Parsed(real(self, *args, **kwargs))

    with mock.patch.object(argparse.ArgumentParser, "parse_args", intercept):
        try:
            main(argv)
        except _Parsed as parsed:
            return parsed.namespace
    raise AssertionError(f"{target.__name__}.main returned without parsing its arguments")


COMMANDS = quoted_commands()


def test_the_documents_quote_the_commands_users_run() -> None:
    shown = {str(c) for c in COMMANDS}
    for expected in (
        "python -m model_check",
        "python -m model_check mutants",
        "python -m model_check check --write-manifest",
        "python -m model_check.codegen",
        "python -m model_check diagram --out table.svg",
        f"python -m model_check explain {PLACEHOLDERS['MUTANT']} --out trace.svg",
    ):
        assert expected in shown, sorted(shown)
    assert any(c.module.startswith("rowcache") for c in COMMANDS)
    assert any(c.where.startswith("docs/records/") for c in COMMANDS)


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: f"{c.where}: {c}")
def test_quoted_command_parses(command: Command, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        parse_only(command.module, command.argv)
    except SystemExit:
        pytest.fail(
            f"{command.where} quotes `{command}`, which its parser rejects:\n"
            + capsys.readouterr().err
        )


@pytest.mark.parametrize(
    "wrong",
    [
        # The instruction spec/manifest.toml used to give: the flag is on `check`.
        "`python -m model_check --write-manifest`",
        "`python -m model_check explain no_such_mutant`",
        "`python -m model_check.codegen --chek`",
        "    python -m rowcache.bench --steps many",
    ],
)
def test_a_wrong_command_is_caught(wrong: str) -> None:
    [command] = commands(f"see\n\n{wrong}\n", "seeded")
    with pytest.raises(SystemExit):
        parse_only(command.module, command.argv)


def test_a_right_command_parses_to_what_it_says() -> None:
    [command] = commands("run `python -m model_check check --write-manifest` after", "seeded")
    args = parse_only(command.module, command.argv)
    assert args.command == "check" and args.write_manifest


def test_an_unknown_module_is_caught() -> None:
    [command] = commands("`python -m model_check.no_such_module`", "seeded")
    with pytest.raises(ModuleNotFoundError):
        parse_only(command.module, command.argv)

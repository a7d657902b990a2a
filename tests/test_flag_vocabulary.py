"""One flag vocabulary: every error message that names a command-line flag names one that exists."""

import ast
import pathlib
import re

from specforge_core.cli import build_cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def cli_flags():
    flags = set()
    for command in build_cli().commands.values():
        for param in command.params:
            flags.update(opt for opt in (*param.opts, *param.secondary_opts) if opt.startswith("--"))
    return flags


def raised_messages(path):
    """The string pieces of every ``raise`` statement in a source file, with their line."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and node.exc is not None:
            for part in ast.walk(node.exc):
                if isinstance(part, ast.Constant) and isinstance(part.value, str):
                    yield node.lineno, part.value


def sources():
    packages = [ROOT / "specforge_core", *ROOT.glob("plugins/*/specforge_plugin_*"),
                *ROOT.glob("plugins/backends/*/specforge_plugin_*")]
    return [path for package in packages for path in package.rglob("*.py")]


def test_every_flag_an_error_message_names_exists_on_the_command_line():
    known = cli_flags()
    wrong = [f"{path.relative_to(ROOT)}:{line}: {flag}" for path in sources() for line, text in raised_messages(path)
             for flag in FLAG.findall(text) if flag not in known]
    assert wrong == []


def test_the_shared_flags_have_one_spelling_on_every_command_that_takes_them():
    commands = build_cli().commands
    for name in ("run", "capture", "regenerate"):
        opts = {opt for param in commands[name].params for opt in param.opts}
        assert {"--target-model", "--data", "--set", "--config"} <= opts, name
    assert "--data" in {opt for param in commands["eval"].params for opt in param.opts}
    assert "--target-model" in {opt for param in commands["eval"].params for opt in param.opts}

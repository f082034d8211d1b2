"""The command registry and :func:`main`: parse the arguments, run the subcommand (or the
main job), print its :class:`~einattn.cli.output.Output` as tables or JSON."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import NoReturn

from ..errors import EinattnError
from . import bench, latex, trace, verify
from .main_job import DESCRIPTION, main_job
from .options import Command, Options, UsageError, fill_sizes, size_options
from .output import Output, Paint, one_line

# The subcommands, in the order --help lists them; command() registers one more.
COMMANDS: dict[str, Command] = {"trace": trace.COMMAND, "verify": verify.COMMAND,
                                "latex": latex.COMMAND, "bench": bench.COMMAND}


def command(name: str, help: str, *options: Options):
    """Register ``run(args, paint) -> Output`` as the subcommand ``name``, with the option
    groups it takes (``--json`` and ``--help`` come with every subcommand)."""
    def register(run: Callable[[argparse.Namespace, Paint], Output]):
        COMMANDS[name] = Command(run, help, options)
        return run
    return register


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line from main(), not usage + message
        raise UsageError(message)


def _json_option(parser: argparse.ArgumentParser) -> None:
    # SUPPRESS: a subcommand's default must not overwrite `einattn --json <subcommand>`.
    parser.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="print one JSON document instead of tables")


def parser() -> argparse.ArgumentParser:
    top = _Parser(prog="einattn", description=DESCRIPTION)
    _json_option(top)
    size_options(top)
    sub = top.add_subparsers(dest="command", title="subcommands (each has --help)")
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        _json_option(p)
        for add in cmd.options:
            add(p)
    return top


def main(argv: list[str] | None = None) -> int:
    """Run the command line. Exit status: 0 done, 1 a step (or, with ``bench --check``, a
    target) failed, 2 bad arguments or a derivation block that is wrong in itself (one line
    on stderr each), 141 (as for SIGPIPE) when stdout was closed early."""
    try:
        args = parser().parse_args(argv)
        chosen = COMMANDS.get(args.command)
        fill_sizes(args, args.command or "einattn",
                   chosen is None or size_options in chosen.options)
        output = (chosen.run if chosen else main_job)(args, Paint.for_stdout())
    except SystemExit as done:  # --help printed its text
        return done.code if isinstance(done.code, int) else 0
    except (UsageError, EinattnError) as error:
        print(f"einattn: error: {one_line(error)}", file=sys.stderr)
        return 2
    as_json = getattr(args, "json", False)
    text = json.dumps(output.document, indent=2, ensure_ascii=False) if as_json else None
    written = _write(text or "\n".join(output.lines))
    for error in output.errors:  # shown in the report too, in place
        print(f"einattn: error: {error}", file=sys.stderr)
    return output.status if written else 141


def _write(text: str) -> bool:
    """Print ``text``; False if the reader went away (``einattn | head``), quietly."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return False
    return True

"""The `servelab` command: the process entry point that reads Settings once and wires the core.

Knows the command list and its order (as `servelab --help` shows it). Does not know any command's body:
each group lives in its own module. Every bad input ends in one line on stderr and exit code 2.
"""

from __future__ import annotations

import logging
from typing import Annotated

import typer

from servelab.cli import bench, client, engine, keys, lab, stack
from servelab.cli.options import forget_settings

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__.split("\n")[0])

# NOTE: the order here is the order of `servelab --help`; the groups follow the commands.
COMMANDS = (
    engine.generate, stack.worker, engine.quantize, lab.quality, stack.migrate, stack.up, stack.down, lab.run,
    lab.compare, lab.calibrate, stack.dashboard, lab.sweep, stack.api, stack.jobs_worker, stack.beat, client.submit, client.results,
)
for command in COMMANDS:
    app.command()(command)
app.add_typer(bench.app, name="bench")
app.add_typer(keys.app, name="keys")


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"servelab {version('servelab')}")
        raise typer.Exit()


@app.callback()
def main(verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
         show_version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                                    help="print the version and exit")] = False) -> None:
    forget_settings()
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

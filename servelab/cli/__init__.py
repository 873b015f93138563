"""The `servelab` command: the process entry point that reads Settings once and wires the core.

Knows the command list, its panels and order (as `servelab --help` shows it) and the help people read
first. Does not know any command's body: each group lives in its own module. Every bad input ends in one
line on stderr and exit code 2.
"""

from __future__ import annotations

import logging
from typing import Annotated

import typer

from servelab.cli import bench, client, engine, keys, lab, stack, status
from servelab.cli.options import forget_settings

# NOTE: one source line per paragraph would be too long; the pieces join into paragraphs that the help reflows.
HELP = "\n\n".join([
    "servelab serves an LLM through a queue (an OpenAI-compatible API, batch jobs) and tells you, with "
    "measurements, which serving configuration to run.",
    "Start with `servelab up` (the local stack: the API on http://127.0.0.1:8000/v1), `servelab status` (what "
    "runs), `servelab keys create --tenant NAME` (an API key), `servelab compare plans/demo.yaml` (a verdict) "
    "and `servelab down`.",
    "Exit status: 0 success; 1 a result that is not one (a rejected comparison, a failed batch, a service "
    "down); 2 bad input or a failed step; 3 an inconclusive comparison.",
    "Where things are comes from SERVELAB_* variables: SERVELAB_REDIS_URL and SERVELAB_DATABASE_URL name the "
    "servers (unset: embedded ones are started under .state/).",
])

app = typer.Typer(no_args_is_help=True, add_completion=False, help=HELP, rich_markup_mode="markdown")

# NOTE: the order here is the order of `servelab --help`, panel by panel; the groups follow the commands.
PANELS = (
    ("The local stack", (stack.up, status.status, stack.down, stack.dashboard)),
    ("API clients", (client.submit, client.results)),
    ("Comparing configs", (lab.compare, lab.run, lab.quality, lab.sweep, lab.calibrate)),
    ("The engine in this process", (engine.generate, engine.check_model, engine.check_gpu, engine.quantize)),
    ("Services (what docker-compose runs)", (stack.api, stack.worker, stack.jobs_worker, stack.beat, stack.migrate,
                                             status.health)),
)
for panel, commands in PANELS:
    for command in commands:
        app.command(rich_help_panel=panel)(command)
app.add_typer(keys.app, name="keys", rich_help_panel="API clients")
app.add_typer(bench.app, name="bench", rich_help_panel="The engine in this process")


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"servelab {version('servelab')}")
        raise typer.Exit()


@app.callback()
def main(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="log what servelab does on stderr")] = False,
         show_version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                                    help="print the version and exit")] = False) -> None:
    forget_settings()
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

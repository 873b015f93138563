"""What every command group shares: the --config option, reading configs and number lists, exiting with
one clear line, this process's Settings (read once) and connecting to Redis and PostgreSQL.

Knows Typer and the Settings classes. Does not know any command, the engine or what a command measures.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer

from servelab.config import ConfigError, ServingConfig
from servelab.settings import ServiceSettings, Settings

if TYPE_CHECKING:
    from servelab.runtime import Runtime

ConfigOption = Annotated[Path, typer.Option("--config", "-c", help="serving config YAML, e.g. configs/fp32.yaml")]
ThreadsOption = Annotated[int | None, typer.Option(min=1, max=256, help="torch threads (default: the config's, "
                                                                         "else torch's)")]


def fail(message: str) -> NoReturn:
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    raise typer.Exit(code=2)


def progress(message: str) -> None:
    typer.echo(message, err=True)


def load_config(path: Path) -> ServingConfig:
    try:
        return ServingConfig.from_yaml(path)
    except ConfigError as exc:
        fail(str(exc))


def config_paths(text: str) -> list[Path]:
    """The paths of a comma-separated --configs value, blanks skipped."""
    return [Path(p.strip()) for p in text.split(",") if p.strip()]


def parse_ints(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        fail(f"{what} must be comma-separated whole numbers, got {text!r}")
    if not values or any(v < 1 for v in values):
        fail(f"{what} must be positive whole numbers, got {text!r}")
    return values


@lru_cache(maxsize=1)
def settings() -> Settings:
    """This process's Settings, read from the environment the first time a command asks."""
    return Settings()


@lru_cache(maxsize=1)
def service_settings() -> ServiceSettings:
    """The api's Settings (its URL and key), for the commands that talk to the API."""
    return ServiceSettings()


def forget_settings() -> None:
    """Called as each invocation starts: one process runs one command, except under a test's CliRunner,
    which invokes the app many times in one process, each time with its own environment."""
    settings.cache_clear()
    service_settings.cache_clear()


def load_engines(configs: list[ServingConfig], threads: int | None) -> list:
    """An engine per config, in this process, each with `threads` torch threads where given."""
    from servelab.engine.engine import Engine
    from servelab.engine.loader import ModelLoadError

    with_threads = settings().model_copy(update={"num_threads": threads}) if threads else settings()
    try:
        return [Engine.from_config(c.model_copy(update={"num_threads": threads or c.num_threads}), with_threads)
                for c in configs]
    except ModelLoadError as exc:
        fail(str(exc))


@contextmanager
def connected(with_settings: Settings | None = None) -> Iterator[Runtime]:
    """Connect (creating and migrating the database) with these Settings, default this process's; the
    connections are closed however the block ends. An embedded server that cannot start is one line, exit 2."""
    from servelab.embedded import EmbeddedServerError
    from servelab.runtime import connect

    try:
        runtime = connect(with_settings or settings())
    except EmbeddedServerError as exc:
        fail(str(exc))
    try:
        yield runtime
    finally:
        runtime.close()

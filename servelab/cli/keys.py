"""The `keys` group: API keys, one tenant per key, stored hashed.

Knows the command's options and that the key is printed once. Does not know how a key is made or
hashed: servelab/store/keys.py does.
"""

from __future__ import annotations

from typing import Annotated

import typer

from servelab.cli.options import connected, fail

app = typer.Typer(no_args_is_help=True, help="API keys: one tenant per key, stored hashed.")


@app.command("create")
def keys_create(tenant: Annotated[str, typer.Option(help="the tenant the key acts for")]) -> None:
    """Create a key and print it; only its hash is stored, so it is shown this once."""
    from servelab.store.db import session_scope
    from servelab.store.keys import create_key

    if not tenant.strip():
        fail("--tenant must not be empty")
    with connected() as runtime, session_scope(runtime.sessions) as session:
        key = create_key(session, tenant=tenant.strip())
    typer.echo(key)

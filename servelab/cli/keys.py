"""The `keys` group: API keys, one tenant per key, stored hashed.

Knows the command's options and that the key is printed once. Does not know how a key is made or
hashed: servelab/store/keys.py does.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
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


@app.command("list")
def keys_list(
    tenant: Annotated[str | None, typer.Option(help="only this tenant's keys")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the keys as JSON")] = False,
) -> None:
    """Every key: its id, tenant, the first characters of its hash, when it was made and revoked (never the key)."""
    from servelab.store.db import session_scope
    from servelab.store.keys import list_keys

    with connected() as runtime, session_scope(runtime.sessions) as session:
        rows = [{"id": r.id, "tenant": r.tenant, "hash": r.key_hash[:12], "created_at": r.created_at.isoformat(),
                 "revoked_at": r.revoked_at.isoformat() if r.revoked_at else None}
                for r in list_keys(session, tenant=tenant)]
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        typer.echo("no keys" + (f" for tenant {tenant!r}" if tenant else ""))
        return
    typer.echo(f"{'id':>6}  {'tenant':<20} {'hash':<12}  {'created':<25} revoked")
    for r in rows:
        typer.echo(f"{r['id']:>6}  {r['tenant']:<20} {r['hash']:<12}  {r['created_at']:<25} {r['revoked_at'] or '-'}")


@app.command("revoke")
def keys_revoke(
    key: Annotated[str | None, typer.Argument(help="the key itself (sl-...)")] = None,
    key_id: Annotated[int | None, typer.Option("--id", help="the key's id, as `keys list` shows it")] = None,
) -> None:
    """Revoke a key, by the key or by its id: requests with it are refused from then on (401)."""
    from servelab.store.db import session_scope
    from servelab.store.keys import revoke_key, revoke_key_by_id

    if (key is None) == (key_id is None):
        fail("give the key to revoke, or --id N (see `servelab keys list`), not both")
    with connected() as runtime, session_scope(runtime.sessions) as session:
        now = datetime.now(UTC)
        done = revoke_key(session, key=key, now=now) if key is not None else \
            revoke_key_by_id(session, key_id=key_id, now=now)
    if not done:
        fail(f"no live key {'with id ' + str(key_id) if key is None else 'like that'}: unknown or already revoked")
    typer.echo(f"revoked {'key ' + str(key_id) if key is None else 'the key'}")


@app.command("weight")
def keys_weight(
    tenant: Annotated[str, typer.Option(help="the tenant whose weight to set or show")],
    weight: Annotated[float | None, typer.Argument(help="its new weight (> 0); none: show it")] = None,
) -> None:
    """A tenant's weight in the fair share of bulk work: the tenants' batch jobs feeding a config share its bulk
    queue in proportion to their weights, a tenant's share split among its jobs. Unset: 1."""
    from servelab.store.db import session_scope
    from servelab.store.keys import set_tenant_weight, tenant_weights

    if not tenant.strip():
        fail("--tenant must not be empty")
    if weight is not None and not (weight > 0 and weight < float("inf")):
        fail(f"the weight must be a positive number, got {weight}")
    with connected() as runtime, session_scope(runtime.sessions) as session:
        if weight is not None:
            set_tenant_weight(session, tenant=tenant.strip(), weight=weight)
        now = tenant_weights(session, tenants=[tenant.strip()]).get(tenant.strip(), 1.0)
    typer.echo(f"tenant {tenant.strip()!r} weighs {now:g} in the fair share of bulk work")

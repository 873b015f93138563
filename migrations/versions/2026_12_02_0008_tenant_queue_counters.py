"""Submissions at a front end's rate: each tenant's queued-request count kept by triggers, not counted per post.

tenant_queues holds, per tenant, the number of its queued requests that belong to no batch job (what
SERVELAB_MAX_QUEUED_REQUESTS limits). Statement-level triggers on requests keep it in the same transaction
as the rows they change (inserts, status changes, deletes, truncation), so it is exact at every commit,
whichever process wrote and however that process ended. Each statement touches a tenant's row once, tenants
in name order, so two statements never wait for each other's counters in opposite orders (no deadlock).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02 16:00:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COUNTED = "status = 'queued' AND batch_job_id IS NULL"

# NOTE: one function for the four events; PL/pgSQL plans a statement when it first runs, so each branch names
# only the transition tables its own trigger declares. Tenants in name order: see the module's docstring.
FUNCTION = f"""
CREATE FUNCTION count_queued_requests() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    change record;
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        DELETE FROM tenant_queues;
        RETURN NULL;
    END IF;
    IF TG_OP = 'INSERT' THEN
        FOR change IN SELECT tenant, count(*) AS delta FROM new_rows WHERE {COUNTED}
                      GROUP BY tenant ORDER BY tenant LOOP
            PERFORM add_queued(change.tenant, change.delta);
        END LOOP;
    ELSIF TG_OP = 'DELETE' THEN
        FOR change IN SELECT tenant, -count(*) AS delta FROM old_rows WHERE {COUNTED}
                      GROUP BY tenant ORDER BY tenant LOOP
            PERFORM add_queued(change.tenant, change.delta);
        END LOOP;
    ELSE
        FOR change IN SELECT d.tenant, sum(d.delta) AS delta FROM (
                          SELECT tenant, 1 AS delta FROM new_rows WHERE {COUNTED}
                          UNION ALL
                          SELECT tenant, -1 AS delta FROM old_rows WHERE {COUNTED}) AS d
                      GROUP BY d.tenant HAVING sum(d.delta) <> 0 ORDER BY d.tenant LOOP
            PERFORM add_queued(change.tenant, change.delta);
        END LOOP;
    END IF;
    RETURN NULL;
END
$$
"""
# NOTE: UPDATE first: an INSERT ... ON CONFLICT checks the row it proposes, and a negative delta fails the
# check constraint before the conflict is found. A missing row is made by the first positive delta.
ADD_QUEUED = """
CREATE FUNCTION add_queued(tenant_name text, delta bigint) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    UPDATE tenant_queues SET num_queued = num_queued + delta WHERE tenant = tenant_name;
    IF NOT FOUND THEN
        INSERT INTO tenant_queues AS q (tenant, num_queued) VALUES (tenant_name, delta)
        ON CONFLICT (tenant) DO UPDATE SET num_queued = q.num_queued + EXCLUDED.num_queued;
    END IF;
END
$$
"""


def upgrade() -> None:
    op.create_table(
        "tenant_queues",
        sa.Column("tenant", sa.Text(), nullable=False),
        sa.Column("num_queued", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.CheckConstraint("num_queued >= 0", name=op.f("ck_tenant_queues_num_queued_not_negative")),
        sa.PrimaryKeyConstraint("tenant", name=op.f("pk_tenant_queues")),
    )
    # NOTE: no request changes between the count below and the triggers' first firing.
    op.execute("LOCK TABLE requests IN SHARE ROW EXCLUSIVE MODE")
    op.execute(f"INSERT INTO tenant_queues (tenant, num_queued) SELECT tenant, count(*) FROM requests "
               f"WHERE {COUNTED} GROUP BY tenant")
    op.execute(ADD_QUEUED)
    op.execute(FUNCTION)
    # NOTE: transition tables are allowed for one event per trigger, and each trigger declares its own.
    op.execute("CREATE TRIGGER requests_count_queued_insert AFTER INSERT ON requests REFERENCING NEW TABLE AS "
               "new_rows FOR EACH STATEMENT EXECUTE FUNCTION count_queued_requests()")
    op.execute("CREATE TRIGGER requests_count_queued_update AFTER UPDATE ON requests REFERENCING OLD TABLE AS "
               "old_rows NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION count_queued_requests()")
    op.execute("CREATE TRIGGER requests_count_queued_delete AFTER DELETE ON requests REFERENCING OLD TABLE AS "
               "old_rows FOR EACH STATEMENT EXECUTE FUNCTION count_queued_requests()")
    op.execute("CREATE TRIGGER requests_count_queued_truncate AFTER TRUNCATE ON requests "
               "FOR EACH STATEMENT EXECUTE FUNCTION count_queued_requests()")


def downgrade() -> None:
    for event in ("truncate", "delete", "update", "insert"):
        op.execute(f"DROP TRIGGER requests_count_queued_{event} ON requests")
    op.execute("DROP FUNCTION count_queued_requests()")
    op.execute("DROP FUNCTION add_queued(text, bigint)")
    op.drop_table("tenant_queues")

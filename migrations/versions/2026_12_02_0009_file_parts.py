"""Files in parts: a file's bytes move from files.content to file_parts rows of at most 1 MiB each.

Uploads, output files and downloads are then written and read a part at a time (a 50,000-line file is never
held whole by the api or the jobs-worker). Existing files are cut into parts on the way up and joined again on
the way down.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02 16:00:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

PART_BYTES = 1 << 20  # NOTE: servelab/store/files.py PART_BYTES at the time of this migration


def upgrade() -> None:
    op.create_table(
        "file_parts",
        sa.Column("file_id", sa.Text(), nullable=False),
        sa.Column("byte_offset", sa.BigInteger(), nullable=False),
        sa.Column("content", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(["file_id"], ["files.id"], name=op.f("fk_file_parts_file_id_files"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("file_id", "byte_offset", name=op.f("pk_file_parts")),
    )
    # NOTE: uncompressed, as files.content was: substring() reads only the slice it asks for.
    op.execute("ALTER TABLE file_parts ALTER COLUMN content SET STORAGE EXTERNAL")
    op.execute(f"""
        INSERT INTO file_parts (file_id, byte_offset, content)
        SELECT id, start, substring(content FROM start + 1 FOR {PART_BYTES})
        FROM files, generate_series(0, octet_length(content) - 1, {PART_BYTES}) AS start
        WHERE octet_length(content) > 0
    """)
    op.drop_column("files", "content")


def downgrade() -> None:
    op.add_column("files", sa.Column("content", sa.LargeBinary(), nullable=False, server_default=sa.text("''::bytea")))
    op.execute("ALTER TABLE files ALTER COLUMN content SET STORAGE EXTERNAL")
    op.execute("""
        UPDATE files SET content = joined.content
        FROM (SELECT file_id, string_agg(content, ''::bytea ORDER BY byte_offset) AS content
              FROM file_parts GROUP BY file_id) AS joined
        WHERE joined.file_id = files.id
    """)
    op.alter_column("files", "content", server_default=None)
    op.drop_table("file_parts")

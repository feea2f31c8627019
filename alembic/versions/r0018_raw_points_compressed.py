"""Raw points' value blobs compressed in the row on PostgreSQL (issue 21).

PostgreSQL only (SQLite stores a blob as it is: nothing to do). Revision 0001 kept ``points.vals`` in the heap row
uncompressed (``STORAGE EXTERNAL`` and ``toast_tuple_target`` 8160): noise does not compress, and a 2 KiB blob
(512 layers) split out of line takes two TOAST chunks. But a metric whose value is the same in every layer (a count
that stays 0, a ratio that stays 1) compresses to a few bytes, and a row of 512 layers (about 2,120 bytes) leaves
a quarter of its page empty, three to a page where four rows of 2,030 bytes fit. From this revision the column is
``STORAGE MAIN`` (compressed in the row, out of line only when a row would not fit a page), with lz4 where the server
is built with it (cheaper than pglz, which needs a quarter saved), and the table's ``toast_tuple_target`` is back
to its default (2,032 bytes: a row longer is compressed). On the recorded series about a fifth of the rows shrink
(bench/storage_layout.py, 1,024 steps, 16-step batches: the raw table 0.83 → 0.68 bytes per point of the run for
the demo, 0.83 → 0.70 for the agent, the random walk unchanged). Rows stored before keep their layout (the raw tail
is folded into chunks soon); the downgrade restores 0001's settings and leaves rows written compressed as they
are: every revision reads both.
"""

from __future__ import annotations

from alembic import op

revision: str = "0018_raw_points_compressed"
down_revision: str | None = "0017_rollup_codec"


def _lz4() -> bool:
    """Whether the server can compress with lz4 (PostgreSQL 14 and later, built with it)."""
    found = op.get_bind().exec_driver_sql(
        "SELECT 'lz4' = ANY(enumvals) FROM pg_settings WHERE name = 'default_toast_compression'"
    )
    return bool(found.scalar())


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("ALTER TABLE points ALTER COLUMN vals SET STORAGE MAIN")
    if _lz4():
        op.execute("ALTER TABLE points ALTER COLUMN vals SET COMPRESSION lz4")
    op.execute("ALTER TABLE points RESET (toast_tuple_target)")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("ALTER TABLE points ALTER COLUMN vals SET STORAGE EXTERNAL")
    if _lz4():
        op.execute("ALTER TABLE points ALTER COLUMN vals SET COMPRESSION DEFAULT")
    op.execute("ALTER TABLE points SET (toast_tuple_target = 8160)")

"""Statements every ingest batch runs, as driver SQL compiled once per dialect (issue 21).

Executing a Core statement costs SQLAlchemy more than the driver spends on the same SQL: it computes the statement's
cache key, looks the compiled form up, and builds each row's parameters through the compiled statement (SQLAlchemy
2.1 on SQLite: the points upsert of 8 rows 35 µs through ``Connection.execute``, 24 µs through ``exec_driver_sql``;
single-row statements 2–5 µs less; a statement built per batch, as the scalar upsert was, ~150 µs instead of ~11).
:class:`DriverStatement` compiles a Core statement once per dialect and runs its SQL through
``Connection.exec_driver_sql``, which keeps what the collector relies on: SQLAlchemy's transaction, its cursor
events (the benchmarks count statements with them) and the wrapping of driver errors in ``DBAPIError`` (the app
answers 503 to those).

Parameters go through the bind processors Core would apply (the JSON type serialises with the engine's
``json_serializer``, or wraps the value for psycopg, which serialises with it; binaries become the driver's binary
type). Rows come back as the driver returns them, columns by position: a statement whose result columns Core would
convert is refused, as is one that needs what only Core's execution does (expanding or literal-execute parameters,
Python-side column defaults, values bound into the statement), so nothing is skipped silently.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sqlalchemy import Connection, CursorResult, Table
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Dialect
from sqlalchemy.sql import ClauseElement
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.selectable import ReturnsRows

__all__ = ["DriverStatement", "conflict_statements", "driver_upserts"]

Row = Mapping[str, Any]
Processor = Callable[[Any], Any]


class DriverStatement:
    """A Core statement run as its SQL compiled for the connection's dialect (once per dialect), with parameters
    given by name as Core takes them: one mapping, or a list of them (an ``executemany``)."""

    def __init__(self, statement: ClauseElement, columns: Sequence[str] = ()) -> None:
        """``columns``: the columns an ``INSERT`` without ``values()`` writes (Core takes them from the first row's
        keys on each execution; here they are fixed)."""
        self.statement = statement
        self.columns = tuple(columns)
        self._compiled: weakref.WeakKeyDictionary[Dialect, _Compiled] = weakref.WeakKeyDictionary()

    def execute(self, conn: Connection, params: Row | Sequence[Row]) -> CursorResult[*tuple[Any, ...]]:
        """Run the statement in ``conn``'s transaction; the driver's rows, columns by position."""
        compiled = self._compiled.get(conn.dialect)
        if compiled is None:
            compiled = self._compiled[conn.dialect] = _Compiled(self.statement, self.columns, conn.dialect)
        if isinstance(params, Mapping):
            return conn.exec_driver_sql(compiled.sql, compiled.parameters(params))
        return conn.exec_driver_sql(compiled.sql, [compiled.parameters(row) for row in params])


class _Compiled:
    """One statement's SQL for one dialect and how to turn a row of named values into the driver's parameters:
    a tuple in the SQL's order for a positional paramstyle (sqlite3's ``qmark``), a dict otherwise (psycopg's
    ``pyformat``)."""

    def __init__(self, statement: ClauseElement, columns: Sequence[str], dialect: Dialect) -> None:
        # Compiled as for an executemany, whatever the rows: an INSERT then has no implicit RETURNING of the keys
        # the database generates, which a single row's form adds on PostgreSQL for Core's ``inserted_primary_key``.
        compiled = statement.compile(dialect=dialect, column_keys=list(columns) or None, for_executemany=True)
        if not isinstance(compiled, SQLCompiler):
            raise ValueError(f"not a SQL statement: {statement!r}")
        _refuse_what_core_alone_does(statement, compiled, dialect)
        self.sql = compiled.string
        self.positional = dialect.positional
        names = list(compiled.positiontup or ()) if self.positional else list(compiled.binds)
        self.names = names
        self._take: Callable[[Row], tuple[Any, ...]] = (
            operator.itemgetter(*names) if len(names) > 1 else lambda row: tuple(row[name] for name in names)
        )
        processors = [compiled.binds[name].type.dialect_impl(dialect).bind_processor(dialect) for name in names]
        self._processed: list[tuple[int, Processor]] = [(i, p) for i, p in enumerate(processors) if p is not None]

    def parameters(self, row: Row) -> tuple[Any, ...] | dict[str, Any]:
        """The driver's parameters for the values in ``row`` (a KeyError names a missing one)."""
        values = self._take(row)
        if self._processed:
            listed = list(values)
            for index, process in self._processed:
                listed[index] = process(listed[index])
            values = tuple(listed)
        return values if self.positional else dict(zip(self.names, values, strict=True))


def _refuse_what_core_alone_does(statement: ClauseElement, compiled: SQLCompiler, dialect: Dialect) -> None:
    """Raise ValueError for a statement whose execution needs Core's (see the module's docstring)."""
    if compiled.literal_execute_params or compiled.post_compile_params:
        raise ValueError("expanding or literal-execute parameters are rendered per execution by Core")
    if compiled.insert_prefetch or compiled.update_prefetch:
        raise ValueError("columns with Python-side defaults are filled per execution by Core")
    if compiled.escaped_bind_names:
        raise ValueError(f"bind names the driver sees escaped: {sorted(compiled.escaped_bind_names)}")
    fixed = [name for name, bind in compiled.binds.items() if not bind.required]
    if fixed:
        raise ValueError(f"values bound into the statement (pass them by name instead): {fixed}")
    if isinstance(statement, ReturnsRows):
        converted = [
            str(column)
            for column in statement.exported_columns
            if column.type.dialect_impl(dialect).result_processor(dialect, None) is not None
        ]
        if converted:
            raise ValueError(f"result columns Core would convert: {converted}")


def conflict_statements(table: Table | type[Any], keys: Sequence[str], updated: Sequence[str] = ()) -> dict[str, Any]:
    """``INSERT … ON CONFLICT (keys)`` into ``table`` (a table or a mapped class) setting the ``updated`` columns
    (none: ``DO NOTHING``), by dialect name.

    Built once per dialect at import: building and cache-keying the statement per batch costs more than running it.
    """
    statements: dict[str, Any] = {}
    for dialect, module in (("sqlite", sqlite), ("postgresql", postgresql)):
        statement = module.insert(table)
        if updated:
            excluded = {name: statement.excluded[name] for name in updated}
            statements[dialect] = statement.on_conflict_do_update(index_elements=list(keys), set_=excluded)
        else:
            statements[dialect] = statement.on_conflict_do_nothing(index_elements=list(keys))
    return statements


def driver_upserts(
    table: Table | type[Any], keys: Sequence[str], updated: Sequence[str] = ()
) -> dict[str, DriverStatement]:
    """:func:`conflict_statements` as driver SQL writing the ``keys`` and ``updated`` columns, by dialect name: the
    upserts every batch runs (last write wins on the ``updated`` columns)."""
    return {
        dialect: DriverStatement(statement, (*keys, *updated))
        for dialect, statement in conflict_statements(table, keys, updated).items()
    }

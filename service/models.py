"""TEMPORARY local stub (not committed): replaced by the service branch's models."""

from sqlalchemy import MetaData
from sqlalchemy.orm import DeclarativeBase


class Base(DeclarativeBase):
    """Stub."""

    metadata = MetaData()

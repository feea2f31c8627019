"""The collector service: ingest, full-resolution history, alerts and Prometheus exposition."""

from quantwatch.service.app import create_app
from quantwatch.service.batch import IngestBatch, IngestObserver, IngestStep, WireError
from quantwatch.service.core.config import Settings

__all__ = ["IngestBatch", "IngestObserver", "IngestStep", "Settings", "WireError", "create_app"]

"""The collector service: ingest, full-resolution history, alerts and Prometheus exposition."""

__all__: list[str] = []

"""The training-side agent: hooks quantized layers and streams their error to a collector."""

__all__: list[str] = []

"""Number formats, quantizers, fused error statistics and quantized layers."""

__all__: list[str] = []

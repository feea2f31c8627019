"""What ``update_rel_l2`` adds to a sampled step: the update comparison with Σ(g_q − g_ref)² against the cosine alone.

The agent compares each layer's weight gradient with its FP32 reference once per sampled step. ``update_cosine`` needs
Σq², Σx², Σqx; ``update_rel_l2`` also needs Σ(q − x)², taken directly (rebuilt from the other three it cancels at
FP8-sized errors). Both variants run alternately in one process on gradients of the bench transformer's shapes.

    python bench/update_rel_l2.py [--repeats 200]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from quantwatch.agent.comparison import comparison_stats
from quantwatch.kernels import native

SHAPES = ((768, 768), (3072, 768), (768, 3072))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    isa = native.vector_isa()  # builds and loads the native kernels the comparison uses on the CPU
    print(f"{platform.processor() or platform.machine()}, native kernels: {isa}, load {os.getloadavg()}")
    torch.manual_seed(0)
    for shape in SHAPES:
        reference = torch.randn(shape)
        quantized = reference + 0.01 * torch.randn(shape)
        cosine_only: list[float] = []
        with_error: list[float] = []
        for index in range(args.repeats + 20):
            for error, sink in ((False, cosine_only), (True, with_error)):
                started = time.perf_counter()
                comparison_stats(reference, quantized, error=error)
                if index >= 20:
                    sink.append(time.perf_counter() - started)
        a, b = statistics.median(cosine_only), statistics.median(with_error)
        print(f"{shape}: cosine only {a * 1e3:.3f} ms, with Σ(q−x)² {b * 1e3:.3f} ms, added {(b - a) * 1e3:+.3f} ms")


if __name__ == "__main__":
    main()

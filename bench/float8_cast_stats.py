"""The torchao float8 adapter's cast statistics, the tensors' way against one native pass, in one process.

The casts of one training step of the agent-overhead bench's Float8Linear transformer (``Float8LinearConfig``'s
recipe ``--recipe``, emulated), each the first of its layer and role as the agent measures them (weight, input,
output gradient), captured from torchao; then ``_cast_result(...).stats()`` (decode, divide, mask, statistics pass:
the adapter's way where the native pass does not apply) and ``_cast_stats`` (`kernels.float8_stats`, one pass)
over all of them, alternated ``--repeats`` times, thread CPU time, medians. Every cast's statistics are compared
bit for bit first.

Run: ``.venv/bin/python bench/float8_cast_stats.py [--recipe rowwise]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from agent_overhead import VOCAB, TinyLM

from quantwatch.agent.adapters.torchao_float8 import _cast_result, _cast_stats
from quantwatch.kernels import native

Capture = tuple[torch.Tensor, Any, float, bool]


def capture_casts(recipe: str, batch: int, seq: int) -> list[Capture]:
    """(high-precision tensor, torchao's cast, the format's maximum, whether its scale is reported) of each layer's
    first cast per role in one step."""
    import torchao.float8.float8_linear as float8_linear
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = TinyLM()
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda _, fqn: fqn.startswith("blocks."))
    original = float8_linear.hp_tensor_to_float8_dynamic
    seen: set[tuple[int, str]] = set()
    casts: list[Capture] = []

    def capturing(hp: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        fp8 = original(hp, *args, **kwargs)
        role = kwargs["gemm_input_role"].name
        key = (id(args[1]), role)  # the layer's LinearMMConfig, one per layer
        if key not in seen:
            seen.add(key)
            casts.append((hp.detach(), fp8, torch.finfo(fp8._data.dtype).max, role == "INPUT"))
        return fp8

    float8_linear.hp_tensor_to_float8_dynamic = capturing
    try:
        tokens = torch.randint(0, VOCAB, (batch, seq + 1), generator=torch.Generator().manual_seed(1))
        F.cross_entropy(model(tokens[:, :-1]).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
    finally:
        float8_linear.hp_tensor_to_float8_dynamic = original
    return casts


def tensors_way(cast: Capture) -> torch.Tensor:
    result = _cast_result(*cast)
    return result.stats().as_tensor()


def one_pass(cast: Capture) -> torch.Tensor:
    return _cast_stats(*cast)[0].as_tensor()


def thread_seconds(fn: Callable[[Capture], torch.Tensor], casts: list[Capture]) -> float:
    started = time.thread_time()
    for cast in casts:
        fn(cast)
    return time.thread_time() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="tensorwise", choices=["tensorwise", "rowwise", "rowwise_with_gw_hp"])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    native.prepare()
    casts = capture_casts(args.recipe, args.batch, args.seq)
    for cast in casts:
        if not torch.equal(tensors_way(cast).nan_to_num(-1.0), one_pass(cast).nan_to_num(-1.0)):
            raise SystemExit(f"statistics differ for a cast of shape {tuple(cast[0].shape)}")
    times: dict[str, list[float]] = {"tensors": [], "one_pass": []}
    for _ in range(args.repeats):
        times["tensors"].append(thread_seconds(tensors_way, casts))
        times["one_pass"].append(thread_seconds(one_pass, casts))
    before, after = (statistics.median(times[k]) * 1e3 for k in ("tensors", "one_pass"))
    print(f"{len(casts)} casts ({args.recipe}), every statistic equal bit for bit")
    print(f"tensors' way {before:.2f} ms  one native pass {after:.2f} ms  ratio {after / before:.3f}", end="")
    print("  (thread CPU, median)")


if __name__ == "__main__":
    main()

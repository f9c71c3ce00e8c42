"""Time the exact partitioner on random profiles.

Run: ``.venv/bin/python benchmarks/bench_partition.py`` (add ``--layers/--stages`` to change
the large case). Prints one plain line per case: the size, the time the partition took, the
bottleneck it found and how it compares with the equal-layers split.
"""

from __future__ import annotations

import argparse
import random
import time

from pipeoptim.errors import PlanError
from pipeoptim.plan.memory_factors import method_memory_factors
from pipeoptim.plan.partition import equal_layer_partition, min_memory_partition, optimal_partition
from pipeoptim.plan.partition_cost import evaluate_partition
from pipeoptim.plan.profile import Profile
from pipeoptim.plan.units import format_bytes

MiB = 2**20
BANDWIDTH = "25GB/s"
LATENCY_S = 1e-5


def random_profile(num_layers: int, seed: int) -> Profile:
    rng = random.Random(seed)
    return Profile.from_costs(
        forward_s=[rng.uniform(1e-3, 1e-2) for _ in range(num_layers)],
        backward_s=[rng.uniform(2e-3, 2e-2) for _ in range(num_layers)],
        activation_bytes=[rng.randint(1 * MiB, 64 * MiB) for _ in range(num_layers)],
        param_bytes=[rng.randint(1 * MiB, 256 * MiB) for _ in range(num_layers)],
        optimizer="adam",
    )


def run_case(label: str, profile: Profile, stages: int, cap: str | None) -> None:
    factors = method_memory_factors("pipeoptim", stages, 1)
    start = time.perf_counter()
    best = optimal_partition(
        profile,
        stages,
        memory_cap_bytes=cap,
        memory_factors=factors,
        bandwidth_bytes_per_s=BANDWIDTH,
        latency_s=LATENCY_S,
    )
    elapsed = time.perf_counter() - start
    naive = evaluate_partition(
        profile,
        equal_layer_partition(profile.num_layers, stages),
        memory_factors=factors,
        bandwidth_bytes_per_s=BANDWIDTH,
        latency_s=LATENCY_S,
    )
    print(
        f"{label}: {profile.num_layers} layers x {stages} stages, "
        f"cap {format_bytes(int(cap)) if cap else 'none'}: "
        f"{elapsed:.3f} s; bottleneck {best.bottleneck_s * 1e3:.2f} ms, "
        f"peak memory {format_bytes(best.peak_memory_bytes)} "
        f"(equal layers, ignoring the cap: {naive.bottleneck_s * 1e3:.2f} ms, "
        f"{format_bytes(naive.peak_memory_bytes)})"
    )


def binding_cap(profile: Profile, stages: int) -> str:
    """A cap halfway between the lowest feasible peak and the unconstrained optimum's peak."""
    factors = method_memory_factors("pipeoptim", stages, 1)
    low = min_memory_partition(profile, stages, memory_factors=factors).peak_memory_bytes
    free = optimal_partition(profile, stages, memory_factors=factors).peak_memory_bytes
    return str((low + free) // 2)


def run_infeasible(label: str, profile: Profile, stages: int) -> None:
    factors = method_memory_factors("pipeoptim", stages, 1)
    start = time.perf_counter()
    try:
        optimal_partition(profile, stages, memory_cap_bytes="1GiB", memory_factors=factors)
    except PlanError:
        elapsed = time.perf_counter() - start
        print(
            f"{label}: {profile.num_layers} layers x {stages} stages, cap 1GiB (infeasible): "
            f"{elapsed:.3f} s to find that out and the lowest possible peak"
        )
    else:
        print(f"{label}: cap 1GiB unexpectedly fits")


def transformer_profile(blocks: int = 24, hidden: int = 1024, seq: int = 1024) -> Profile:
    """A GPT-2-medium-like stack (per mini-batch of 8 sequences, fp16): embedding, attention
    and MLP halves of each block, head. Times scale with FLOPs at ~100 TFLOP/s."""
    batch, flops_per_s, dtype = 8, 100e12, 2
    tokens = batch * seq
    act = tokens * hidden * dtype
    fwd: list[float] = [tokens * hidden * 2 / flops_per_s]
    params: list[int] = [50_000 * hidden * dtype]
    acts: list[int] = [act]
    for _ in range(blocks):
        attn = 4 * hidden * hidden
        mlp = 8 * hidden * hidden
        fwd += [
            2 * tokens * attn / flops_per_s + 4 * tokens * seq * hidden / flops_per_s,
            2 * tokens * mlp / flops_per_s,
        ]
        params += [attn * dtype, mlp * dtype]
        acts += [act * 3, act * 5]
    fwd.append(2 * tokens * hidden * 50_000 / flops_per_s)
    params.append(50_000 * hidden * dtype)
    acts.append(tokens * 50_000 * dtype)
    return Profile.from_costs(
        fwd, [2 * f for f in fwd], acts, params, optimizer="adam", batch_size=batch
    )


def run_search(stages: int, cap: str) -> None:
    from pipeoptim.plan.units import parse_bandwidth, parse_bytes
    from pipeoptim.planning import explain, search

    profile = transformer_profile()
    start = time.perf_counter()
    ranked = search(
        profile,
        stages,
        memory_cap_bytes=parse_bytes(cap),
        bandwidth_bytes_per_s=parse_bandwidth(BANDWIDTH),
        latency_s=LATENCY_S,
    )
    took = time.perf_counter() - start
    print(
        f"plan search: {profile.num_layers}-layer transformer profile, {stages} devices, cap "
        f"{cap}: {len(ranked)} candidates (method x micro-batches) in {took:.3f} s"
    )
    print(f"  {explain(ranked, parse_bytes(cap))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=1000)
    parser.add_argument("--stages", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    large = random_profile(args.layers, args.seed)
    run_case("large", large, args.stages, None)
    run_case("large", large, args.stages, binding_cap(large, args.stages))
    run_infeasible("large", large, args.stages)
    small = random_profile(100, args.seed + 1)
    run_case("small", small, 8, None)
    run_case("small", small, 8, binding_cap(small, 8))
    run_infeasible("small", small, 8)
    run_search(8, "16GiB")


if __name__ == "__main__":
    main()

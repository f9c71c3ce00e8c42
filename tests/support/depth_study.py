"""A small language-model study with every kind of row issue 65 adds (the one-step family
under Muon, the dial, the extrapolation's λ rows, equal-time rows) and fake simulated
throughputs, for the study's tests. The dial is xpipe's (any M today)."""

from __future__ import annotations

from pipeoptim.study.grid import StudyConfig

RATES = {"adamw": (2e-3, None)}

CONFIG = StudyConfig(
    "gpt-deep",
    steps=100,
    eval_every=50,
    methods=("gpipe", "xpipe", "2bw", "pipedream"),
    optimizers=("adamw",),
    stages=(8,),
    sweep_stages=8,
    seeds=1,
    rates={"adamw": (2e-3,)},
    high_rate=False,
    warmup=0.1,
    final_lr=0.1,
    pairs=(("gpipe", "muon"), ("xpipe", "muon")),
    twins=("zb-h1",),
    dial=("muon",),
    dial_method="xpipe",
    extrapolations=(("pipedream+pipemare", "adamw", 0.25), ("pipedream+pipemare", "adamw", 1.0)),
    equal_time=("xpipe", "xpipe (muon)", "2bw", "pipedream+pipemare"),
)

# seconds per sample by row: zb-h1 is the budget; xpipe 25 % faster, 2bw as fast
SPEED = {
    "zb-h1": 1.0,
    "zb-h1 (muon)": 2.0,
    "xpipe": 0.8,
    "2bw": 1.0,
    "xpipe (muon)": 4.0,
    "xpipe M=2 (muon)": 1.0,
    "xpipe M=4 (muon)": 1.6,
    "pipedream+pipemare λ=0.25": 0.5,
    "pipedream+pipemare λ=1": 0.5,
}


def fake_speed(label: str, stages: int) -> float:
    assert stages == 8
    return SPEED[label]

"""Calibration: feed what a run measured back into the simulator and see how close it was.

A runtime Trace carries every action's measured duration and every rank's memory. The
per-stage medians become a :class:`~pipeoptim.sim.costs.CostModel`; the simulator replays
the run's own method and shape on it; the two Traces go through the same metrics function,
and the comparison lists predicted against measured with the relative error. This is the
one place that reads runtime output and drives the simulator; it needs no torch (both sides
speak the shared Trace).

A data-parallel run (``meta["data_parallel"]`` = D replicas; the events are replica 0's)
trains B/(D·M) samples per micro-batch, and every measured update includes the blocking
all-reduce of the stage's gradients. The all-reduce is modelled as the simulator models it
(:mod:`pipeoptim.sim.collectives`, a ring over the stage's D replicas, its gradient one
parameter-sized copy) on :func:`run_cluster`; the rest of the measured update is the
optimizer step, which does not depend on D. So the run's own prediction keeps its measured
update time, and a prediction for another D (:func:`what_if`) swaps the all-reduce only.

The ranks' clocks are put on one clock by their messages first (each rank takes its origin
after a barrier; on a loaded machine they differ by milliseconds:
:mod:`pipeoptim.calibrate.clocks`).
For a run of several processes the costs are what :func:`machine_fit` fits: every action's
work (under processor sharing where the ranks shared their host's cores: the trace's
machine record, ``meta["machine"]``, else fitted), each message's fixed cost at both ends,
each link's fastest message, and the machine, which the simulator then shares among the
busy ranks where they outnumber its cores. A one-process run (the local transport), and a
trace of a core per rank that recorded no message, keep the per-stage medians. Why the
fit with a core per rank too: the medians leave out the work of taking a message in and
the executor's time before each receive, which on a small model is most of a step; on 2
ranks with a core each they under-predicted the time per mini-batch by 28 % (1f1b), 48 %
(pipeoptim) and 54 % (pipedream) on the digits MLP, the fit by 2.5 %, 4.8 % and 15 %
(issue 34).

A runtime trace holds every rank's actions, sends and receives on the rank's own clock. Three
steps turn it into what the simulator needs beyond per-action times:

* :mod:`~pipeoptim.calibrate.clocks` puts the ranks on one clock: each rank takes its time
  origin after a barrier, which on a loaded machine lets the ranks' clocks differ by
  milliseconds; the messages between two ranks bound the difference from both sides.
* :mod:`~pipeoptim.calibrate.busy` finds when each rank used a core (actions, sends, the
  executor's work between them, the part of a receive after its message arrived), how many
  ranks of a host were busy at each moment (in all and in actions), and so how much work
  each piece of time did when the host's cores were shared: by processor sharing
  (:mod:`pipeoptim.sim.sharing`), or with the ranks in actions first, as a real host runs
  short actions (the fit takes the rule the run's actions show).
* :mod:`~pipeoptim.calibrate.fit` fits the host's core count where the trace does not record
  it, the work of every action, and the fixed cost of a message at each end, and says which
  it fitted (:class:`~pipeoptim.calibrate.fit.MachineFit`).

The modules, by concern: runs (what the trace recorded: plan, replicas, cluster, machine,
boundaries, link latencies), trace_costs (the run as simulator costs), comparison (predicted
against measured), layer_costs (the calibrated per-layer profile), prediction (what-if),
and the machine fit: clocks, busy, links, fit, fit_costs.
"""

from pipeoptim.calibrate.comparison import (
    BUBBLE_NOTE_RATIO,
    Comparison,
    bubble_note,
    calibrate,
    compare,
    compute_ratio,
    compute_seconds,
    format_comparison,
    predict_run,
)
from pipeoptim.calibrate.fit import MachineFit, fit_machine
from pipeoptim.calibrate.fit_costs import profile_meta, shared_costs, with_profile_machine
from pipeoptim.calibrate.layer_costs import calibrated_profile
from pipeoptim.calibrate.prediction import WhatIf, policy_excess, what_if
from pipeoptim.calibrate.runs import (
    cluster_recorded,
    link_latencies,
    run_boundaries,
    run_cluster,
    run_machine,
    run_replicas,
)
from pipeoptim.calibrate.trace_costs import (
    costs_from_trace,
    fitted_costs,
    machine_fit,
    with_allreduce,
)

__all__ = [
    "BUBBLE_NOTE_RATIO",
    "Comparison",
    "MachineFit",
    "WhatIf",
    "bubble_note",
    "calibrate",
    "calibrated_profile",
    "cluster_recorded",
    "compare",
    "compute_ratio",
    "compute_seconds",
    "costs_from_trace",
    "fit_machine",
    "fitted_costs",
    "format_comparison",
    "link_latencies",
    "machine_fit",
    "policy_excess",
    "predict_run",
    "profile_meta",
    "run_boundaries",
    "run_cluster",
    "run_machine",
    "run_replicas",
    "shared_costs",
    "what_if",
    "with_allreduce",
    "with_profile_machine",
]

"""Fitting the simulator's machine model from a measured trace (for :mod:`pipeoptim.calibrate`).

A runtime trace holds every rank's actions, sends and receives on the rank's own clock. Three
steps turn it into what the simulator needs beyond per-action times:

* :mod:`~pipeoptim.tracefit.clocks` puts the ranks on one clock: each rank takes its time
  origin after a barrier, which on a loaded machine lets the ranks' clocks differ by
  milliseconds; the messages between two ranks bound the difference from both sides.
* :mod:`~pipeoptim.tracefit.busy` finds when each rank used a core (actions, sends, the
  executor's work between them, the part of a receive after its message arrived), how many
  ranks of a host were busy at each moment, and so how much work each piece of time did
  when the host's cores were shared (processor sharing, :mod:`pipeoptim.sim.sharing`).
* :mod:`~pipeoptim.tracefit.fit` fits the host's core count where the trace does not record
  it, the work of every action, and the fixed cost of a message at each end, and says which
  it fitted (:class:`~pipeoptim.tracefit.fit.MachineFit`).

No torch: it reads the shared :class:`~pipeoptim.trace.Trace`.
"""

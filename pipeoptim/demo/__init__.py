"""``pipeoptim demo``: the whole product on one model, in one report a person opens.

A newcomer's question is "which method should I run, and what will it cost me?". The answer
takes every part of the toolkit, so the demo runs them in order on one model and gathers
what they found in one offline HTML page:

1. profile the model under the conditions of the run (:mod:`pipeoptim.demo.measure`);
2. plan P stages and simulate every method on that profile (:mod:`pipeoptim.demo.predict`);
3. train the recommended method and the strongest synchronous rival for real, one process
   per stage over gloo;
4. calibrate the simulator from both runs and compare predicted with measured;
5. train the same methods on one device (the local transport's emulation) to compare
   convergence;
6. write the report and the JSON of every figure (:mod:`pipeoptim.demo.report`).

Each step writes its result file atomically with a fingerprint of its inputs
(:mod:`pipeoptim.demo.resume`), so an interrupted demo keeps what it finished and the same
command resumes it. :mod:`pipeoptim.demo.run` drives the steps.
"""

from pipeoptim.demo.options import DemoOptions
from pipeoptim.demo.run import DemoOutcome, run_demo

__all__ = ["DemoOptions", "DemoOutcome", "run_demo"]

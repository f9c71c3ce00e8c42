"""The convergence study: every method trained on the same model, data and learning rate.

``runs.py`` trains one configuration and records its curve (``RunSpec`` -> ``RunRecord``);
``grid.py`` builds the grid (learning-rate sweep on gpipe, then every method) and runs it in
worker processes, resumable; ``report.py`` turns the records into the study's report:
``cells.py`` groups them, ``tables.py`` (final metric, prediction closure, time to target),
``targets.py`` (samples and time to the target, the risk-fit points) and ``plots.py``
(curves) make its parts; ``risk_fit.py`` gathers the risk fit and the planner's tables.
``pipeoptim compare`` is the command line.
"""

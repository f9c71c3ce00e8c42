"""The convergence study: every method trained on the same model, data and learning rate.

``runs.py`` trains one configuration and records its curve (``RunSpec`` -> ``RunRecord``);
``grid.py`` builds the grid (learning-rate sweep on gpipe, then every method) and runs it in
worker processes, resumable; ``report.py`` turns the records into tables, curves, time to
accuracy and the prediction closure. ``pipeoptim compare`` is the command line.
"""

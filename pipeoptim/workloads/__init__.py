"""The built-in workloads: the models and data a user trains, as examples of the library.

``pipeoptim train --model NAME`` and the convergence study train these; they are clients of
the runtime (:class:`~pipeoptim.runtime.pipeline.Pipeline`), not part of it. The dependency
points one way: this package imports ``pipeoptim.runtime``, the runtime never imports it
(``tests/test_layering.py`` checks).

* ``classifiers.py``: the digits MLP and CNN, the majority transformer;
* ``gpt.py``: a character-level GPT and its corpus, the Python standard library's source;
* ``data.py``: the in-memory data sets and the deterministic order a run visits them in;
* ``loader.py``: model names (built-in, or a user's ``module:factory``) to layers, data, loss;
* ``train.py``: a :class:`~pipeoptim.runtime.config.TrainConfig` as a run (``pipeoptim
  train``), started by :mod:`pipeoptim.runtime.launch`;
* ``profiling.py``: a named model profiled on its own training data (``pipeoptim profile``).
"""

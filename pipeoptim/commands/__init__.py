"""Sub-commands of the ``pipeoptim`` CLI, one module each (see ``pipeoptim.cli``)."""

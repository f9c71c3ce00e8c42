"""pipeoptim: asynchronous pipeline-parallel training with optimizer-dependent weight prediction."""

__version__ = "0.1.0"

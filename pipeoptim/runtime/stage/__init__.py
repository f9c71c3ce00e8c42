"""One pipeline stage (:mod:`.stage`, with its forward, backward, prediction and checkpoint
state in modules of their own) and the parts its forward and backward run over, one concern
each: the weight versions a pass reads, mixed precision, the bytes held, what a forward's
graph saves, the stage's random stream, the split backward of zero-bubble schedules, the
chain of units, the loss, and the diagnosis of a failing unit.

The parts import nothing above the stage (``tests/test_layering.py``)."""

"""A stage's update rule: the optimizer (torch's, or a whole-stage one of :mod:`.optimizers` and
:mod:`.basis_rotation`), built by its family (:mod:`.families`, one module each), the step
around it (:mod:`.update`), the delay corrections (:mod:`.corrections`), the weight predictors
(:mod:`.predictors`, chosen by :mod:`.predict`), the learning-rate
schedules by name, and the measurements of how well a prediction closes the stale distance
(:mod:`.prediction_closure`) and how much of an update persists (:mod:`.update_persistence`).

:mod:`.builder` builds all of a stage's rule in one call."""

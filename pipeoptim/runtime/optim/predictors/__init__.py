"""The weight predictors, by where their Δ comes from: the frame and the displacement record
(:mod:`.base`), element-wise optimizer state (:mod:`.moments`), matrix work (:mod:`.matrix`).
Which predictor a stage gets is :func:`pipeoptim.runtime.optim.predict.predictor_for`'s
choice, from the optimizer's family (:mod:`pipeoptim.runtime.optim.families`)."""

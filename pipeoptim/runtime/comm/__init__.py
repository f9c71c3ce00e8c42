"""How stages talk: the process model (one process for every stage, or one per stage), the
transport classes that move activations and gradients, data-parallel replicas, and where
each stage runs (device and process group)."""

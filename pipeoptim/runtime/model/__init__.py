"""The user's model as the runtime sees it: cut into units, materialised from the meta
device stage by stage, with its tied weights found and its stage boundaries checked."""

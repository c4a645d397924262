"""Activation patching: a grid of runs that patch a clean prompt's residual stream into a
corrupted one's, layer by position, and the effect each cell has on the target's score."""

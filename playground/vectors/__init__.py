"""The steering-vector library: vectors uploaded, built from contrast prompts or from a run's
captured activations, renamed, deleted and downloaded."""

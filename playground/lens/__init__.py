"""The logit lens of a run's captured activations: the model's own unembedding read at every
layer (tables), computed once when the run finishes (run_lens) and drawn on the run page
with the picks of its form (section)."""

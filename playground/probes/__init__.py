"""Linear probes by layer (issue 44, part 1): a labelled dataset's residual stream harvested
through /v1/harvest with the user's playground key, pooled per text, and a logistic-regression
probe fitted per layer on a stratified held-out split, with bootstrap intervals, the
majority-class baseline and a shuffled-label control; a layer's probe saved to the vector
library and read out on a capture run as a per-token score strip.

Modules: `models` (the `Probe` row), `datasets` (parsing a pasted or uploaded dataset),
`fitting` (the numbers, pure functions over numpy arrays), `services` (writes: create, the
worker's steps, cancel, saving a vector), `selectors` (the page's view of a probe, its
export), `figures` (plotly), `strip` (the run page's score strip), `forms`, `views`, `tasks`,
`urls`."""

"""Steering comparisons: a baseline and steered runs of one prompt (a sweep when there are
several scales), their group page and scrubber, and their scores on the same tokens."""

"""Steering evaluated over a dataset (issue 44, part 2): a library vector at several scales,
scored teacher-forced on prompts with a target and a foil completion, against an unsteered
baseline sent several times per prompt; per scale the mean change in logit difference and in
target logprob with bootstrap 95% intervals, the noise floor and the share of top tokens
that flip. `services` makes the runs, `metrics` holds the numbers as pure functions,
`selectors` reads an evaluation back as its page shows it."""

"""One engine step: the core (schedule, run, sample, events) and its runners (plan -> model)."""

"""Which token comes next: the batched sampler, grammar constraints, speculative proposals."""

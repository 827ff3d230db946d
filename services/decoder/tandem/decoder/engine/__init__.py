"""The engine: requests in, scheduled steps on the model, tokens and events out (rank 0's side)."""

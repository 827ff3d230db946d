"""Several ranks: process groups and collectives, rank 0's step broadcast, the other ranks' loop."""

"""The gRPC edge: entry point and flags, the thin servicer, proto <-> engine conversion."""

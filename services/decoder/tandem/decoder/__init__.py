"""The decoder service: prompts of token IDs, text and embedding rows in; streamed tokens out.

Packages, each importing only those below it (tests/unit/test_architecture.py checks):

    api/          the gRPC edge: entry point and flags, the thin servicer, proto <-> engine conversion
    distributed/  several ranks: process groups and collectives, rank 0's step broadcast, worker loop
    engine/       requests -> validated, scheduled steps on the model -> sampled tokens and events
    config.py     EngineConfig and DecoderConfig: one frozen object each, validated when built
    backends/     what differs between CPU, CUDA and Neuron, and how decode buckets are compiled
    models/       Qwen3, Qwen2, Llama, Mistral: layers, attention, checkpoint loading; a leaf over common
"""

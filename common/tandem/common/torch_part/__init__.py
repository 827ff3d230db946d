"""The part of the contract that needs torch or numpy (common/pyproject.toml's `tensors` extra).

The tensor codec and its dtypes, the shared-memory segments, quantized weights, the GGUF import and
the model cache built on it, the random test model, and the prompt parts that become tensors. It is a
package of its own so that the rest of `tandem.common`, which the gateway and the CLI load, can be held
torch-free by a test (tests/unit/test_architecture.py) rather than by convention.
"""

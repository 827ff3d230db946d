"""The Neuron backend on torch_xla: runtime, buckets, sharding, the step and its runner."""

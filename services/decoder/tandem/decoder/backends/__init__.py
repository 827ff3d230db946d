"""What differs between CPU, CUDA and Neuron: the backend table and how decode buckets are compiled."""

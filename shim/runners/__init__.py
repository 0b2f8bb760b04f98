"""Models and their caches: loading a pair, the runners' KV caches (one row and batched), the fused forward,
kernels, the draft's pruned output layer."""

"""Models and their caches: loading a pair, the runners' KV caches, the fused forward, kernels."""

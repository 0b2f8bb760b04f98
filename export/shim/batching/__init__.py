"""Batched decoding: many rows at once, their caches, datagen's generation, the vLLM proposer."""

"""Batched decoding: many rows at once, datagen's generation, the vLLM proposer."""

"""The decoding engine: model loading, KV caches, policies, the draft/verify loop."""

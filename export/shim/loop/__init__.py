"""The decoding loop and its round: the engine, what a round leaves, drafting, sampling, counts."""

"""The runtime's lowest layer: sampling, divergences and generation counts, which every other folder may use."""

"""specheads: training toolkit for the learned heads of speculative decoding."""

__version__ = "0.1.0"

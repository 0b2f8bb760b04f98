"""Evaluation: metrics, policy benchmarks, plots."""

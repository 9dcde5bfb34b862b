"""Benchmarks: each prints its figures and whether they meet the requirement, as ratios against a
baseline measured in the same run where the requirement is relative (machines here are noisy)."""

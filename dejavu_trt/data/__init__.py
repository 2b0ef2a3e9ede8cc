"""Corpora and their deterministic split into calibration / validation / test windows."""

"""Calibration data and per-module sensitivity (which layers earn INT8 under a byte budget)."""

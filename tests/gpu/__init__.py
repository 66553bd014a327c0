"""Tests that launch the CUDA kernels (marked ``gpu``; skipped where the cuda backend cannot run)."""

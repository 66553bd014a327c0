"""Benchmarks: ``python -m spikefuse bench {neuron,e2e}``; shared helpers in :mod:`.common`."""

"""Exchange formats for models trained with spikefuse.

:mod:`spikefuse.interop.nir` exports models to and imports them from the Neuromorphic
Intermediate Representation (needs ``pip install 'spikefuse[nir]'``; imported only on use).
"""

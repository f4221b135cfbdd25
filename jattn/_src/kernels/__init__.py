"""jattn's own Pallas kernels (TPU, Mosaic)."""

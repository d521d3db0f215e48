"""The Mosaic TPU backend: the ragged paged attention kernel, its plan, tuned block sizes and VMEM limits."""

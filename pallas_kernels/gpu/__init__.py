"""The Pallas GPU (Triton) backend: the ragged paged attention kernel, its plan, tuned block sizes and pointer-offset
fix."""

"""Host-side scheduling: what a sequence is (`sequence`), who runs this step (`scheduler`), and the record the
scheduler hands the worker (`output`). Plain Python over the KV manager; no JAX."""

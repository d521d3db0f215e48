"""The device side: the model runner (step inputs padded to buckets, compiled step executables, warm-up), the
on-device sampler, sharding over a mesh, the KV page budget, and the device half of the lookahead."""

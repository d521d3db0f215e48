"""The model definitions: decoder families (`families.causal_lm` picks one by `model_type`), their layers,
the attention seam (`attention`), parameter shapes and initialization (`init`), partitioning (`partition`)
and weight quantization (`quant`). Where parameters come from is `paged_jax.model.loader`.

Nothing is re-exported here, so importing one submodule (the GGUF reader, say) loads only what it needs."""

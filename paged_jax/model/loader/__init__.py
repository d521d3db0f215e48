"""Where parameters come from (`weights.load_weights`): Hugging Face safetensors (`hf`), GGUF files (`gguf`,
`gguf_file`), orbax checkpoints (`checkpoint`), named models (`named`), with the fused layout built at load
(`fuse`) and a fit check before any allocation (`budget`)."""

"""Text <-> token ids with the model's own tokenizer: the tokenizer (`tokenizer`, or one rebuilt from a GGUF
file's metadata in `gguf`), its special tokens, chat templates, and incremental detokenization."""

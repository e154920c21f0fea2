"""Text in: corpora (built-in, files, folders, .bin) and the batch sampler; tokenizers."""

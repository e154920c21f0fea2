"""Text in: corpora (built-in, files, folders, .bin) and the batch sampler; the run's tokenizer and tokenizer training."""

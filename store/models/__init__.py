"""Model folders as both stages see them: the tokenizer, GGUF files, weight fingerprints, policy versions."""

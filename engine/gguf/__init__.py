"""GGUF checkpoints, llama.cpp's one-file format: the header reader, metadata -> config.json
dict, weights (names, dequantization, layouts), the tokenizer, and the default model."""

"""Tokenizer, datasets and the stateful data loader that feeds the training loop."""

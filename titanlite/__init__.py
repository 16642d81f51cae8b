"""titanlite: a small PyTorch-native LLM training framework."""

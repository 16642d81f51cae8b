"""Data the worked examples generate for themselves, no downloads: a tokenizer and chat conversations
(chat_example.py), the arithmetic task (arithmetic.py) and its tool-calling variant (arithmetic_tools.py). The library
(data/) reads such files; it never writes them."""

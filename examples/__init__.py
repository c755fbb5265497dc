"""Runnable examples: a Llama-style model decoding through the paged KV cache."""

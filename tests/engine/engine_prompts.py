"""Prompts shared by the engine tests (mixed lengths, one batch)."""

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "List three primary colours:",
    "The quick brown fox",
    "Water boils at a temperature of",
    "In 1969, the first humans to walk on the Moon were",
    "A haiku about autumn leaves:\n",
]

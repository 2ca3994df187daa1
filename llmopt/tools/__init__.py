"""User tools over a loaded artifact: `bench`, `evaluate` (perplexity), `inspect`."""

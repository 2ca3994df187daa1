"""llmopt: ahead-of-time LLM optimization compiler and paged runtime."""
__version__ = "0.1.0"

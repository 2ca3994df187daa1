"""llmopt.runtime.serve: an OpenAI-compatible HTTP server over the engine (`llmopt serve`).

Needs the `serve` extra (FastAPI, uvicorn, prometheus-client); imports neither torch nor
transformers.
"""

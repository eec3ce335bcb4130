"""What `pagedmodel serve` (FastAPI, server/api/) and `pagedmodel router` (aiohttp, server/router/) share.

Neither program owns it, and it imports neither web framework, so the router loads no FastAPI or
uvicorn and the engine's API no aiohttp: the OpenAI error shape (`errors.py`), the HTTP limits and
their flags (`http_limits.py`), and the `--api-key` check (`api_key.py`).
"""

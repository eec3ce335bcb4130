"""Why each of vLLM's HTTP tests that fails against pagedmodel fails (run.py reports any other as new)."""

KNOWN: dict[str, str] = {}

NOT_OVER_HTTP: dict[str, str] = {}

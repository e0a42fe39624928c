"""OpenAI's fine-tuning API: its routes (routes.py, the request's body in models.py), its SQLite store (store.py),
the runner that trains queued jobs in worker processes (runner.py), and `motet serve`'s flags for it (flags.py)."""

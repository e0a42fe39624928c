"""OpenAI's Batch API (`/v1/batches`): routes.py the handlers, lines.py the JSONL formats of a batch's lines,
store.py the batches and their lines in SQLite, runner.py the lines sent through the server's own routes when
priority.py lets them go.

(`motet run-batch`, which runs a batch file offline behind the app, is api/offline_batch.py: it builds the
app, which imports these routes.)"""

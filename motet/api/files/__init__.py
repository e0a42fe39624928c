"""OpenAI's Files API (`/v1/files`): routes.py its handlers, store.py the files on disk and their index."""

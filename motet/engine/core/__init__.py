"""The engine's core: which rows run each step (the scheduler, tenants' fairness and latency isolation), the
sequences and their state, the paged KV blocks with their prefix cache, sliding windows and KV tiers."""

"""Tenants' LoRA adapters (`/v1/adapters`, vLLM's load / unload routes): routes.py the handlers, protocol.py
their wire format, store.py where adapters are kept and which one a request's `model` names."""

"""The adapters family's wire format: adapter cards and lists, vLLM's load / unload requests (pydantic)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from motet.api.protocol import _Request


class AdapterCard(BaseModel):
    id: str  # the name requests use as `model`
    object: Literal["adapter"] = "adapter"
    created: int
    owned_by: str  # the tenant; "motet" for the server's shared adapters (--lora)
    parent: str  # the base model
    size_bytes: int


class AdapterList(BaseModel):
    object: Literal["list"] = "list"
    data: list[AdapterCard]


class LoadLoraAdapterRequest(_Request):
    """vLLM's POST /v1/load_lora_adapter."""

    unsupported = {"load_inplace": ((None, False), "unload the adapter first, then load the new one")}
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraAdapterRequest(_Request):
    """vLLM's POST /v1/unload_lora_adapter (adapters are named, never numbered, here)."""

    unsupported = {"lora_int_id": ((None,), "name the adapter with lora_name")}
    lora_name: str = Field(min_length=1)


class AdapterDeleted(BaseModel):
    id: str
    object: Literal["adapter"] = "adapter"
    deleted: bool = True

"""LoRA adapters by served name: `--lora-modules` at startup, vLLM's
/v1/load_lora_adapter and /v1/unload_lora_adapter at run time (with
VLLM_ALLOW_RUNTIME_LORA_UPDATING=true, as in vLLM). A request's `model`
names the base model or an adapter; /v1/models lists both."""
import itertools
import json
import os

from engine.errors import InvalidRequest
from engine.lora import LoRARequest
from server.errors import APIError
from server.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

RUNTIME_UPDATES_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def parse_lora_module(entry: str) -> tuple[str, str, str | None]:
    """vLLM's --lora-modules forms: name=path, or JSON
    {"name": ..., "path": ..., "base_model_name": ...}."""
    if entry.lstrip().startswith("{"):
        try:
            d = json.loads(entry)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules: not valid JSON ({e}): {entry!r}") from None
        if not isinstance(d, dict) or not isinstance(d.get("name"), str) or not isinstance(d.get("path"), str):
            raise ValueError(f'--lora-modules: expected {{"name": ..., "path": ...}}, got {entry!r}')
        name, path, parent = d["name"], d["path"], d.get("base_model_name")
    else:
        name, eq, path = entry.partition("=")
        if not eq or not name or not path:
            raise ValueError(f"--lora-modules: expected name=path or a JSON object, got {entry!r}")
        parent = None
    if not os.path.isfile(os.path.join(path, "adapter_config.json")):
        raise ValueError(f"--lora-modules {name}: {path!r} is not a PEFT adapter directory (no adapter_config.json)")
    return name, path, parent


class LoRARegistry:
    """Served adapter names -> LoRARequest; each load gets a new id, so a
    name loaded again from another path never shares cached prefixes."""

    def __init__(self):
        self.adapters: dict[str, LoRARequest] = {}
        self.parents: dict[str, str | None] = {}
        self._ids = itertools.count(1)

    def get(self, name: str | None) -> LoRARequest | None:
        return self.adapters.get(name) if name is not None else None

    def new(self, name: str, path: str) -> LoRARequest:
        return LoRARequest(name, next(self._ids), os.path.abspath(path))

    def register(self, lora: LoRARequest, parent: str | None = None) -> None:
        self.adapters[lora.lora_name] = lora
        self.parents[lora.lora_name] = parent


async def load_adapter(state, req: LoadLoRAAdapterRequest) -> str:
    """POST /v1/load_lora_adapter."""
    _check_allowed()
    name, path = req.lora_name, req.lora_path
    if name in state.loras.adapters or name in state.config.model_names:
        raise APIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")
    lora = state.loras.new(name, path)
    try:
        await state.llm.add_lora(lora)
    except InvalidRequest as e:     # the adapter does not fit (named in the message)
        raise APIError(400, str(e), param="lora_path") from None
    if name in state.loras.adapters:        # loaded by a concurrent call meanwhile
        state.llm.remove_lora(lora.lora_int_id)
        raise APIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")
    state.loras.register(lora)
    return f"Success: LoRA adapter '{name}' added successfully."


async def unload_adapter(state, req: UnloadLoRAAdapterRequest) -> str:
    """POST /v1/unload_lora_adapter {lora_name}: new requests can no longer
    name it; those already accepted run to their end with it."""
    _check_allowed()
    name = req.lora_name
    lora = state.loras.adapters.pop(name, None)
    if lora is None:
        raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name")
    state.loras.parents.pop(name, None)
    state.llm.remove_lora(lora.lora_int_id)
    return f"Success: LoRA adapter '{name}' removed successfully."


def _check_allowed() -> None:
    if os.environ.get(RUNTIME_UPDATES_ENV, "").lower() not in ("1", "true"):
        raise APIError(404, f"Loading and unloading LoRA adapters at run time is off: start the server with "
                            f"{RUNTIME_UPDATES_ENV}=true.")


"""Three PEFT LoRA adapters on the tiny llama, for the snapshot tests of LoRA blobs and their loading."""

from __future__ import annotations

from pathlib import Path

from warmstart.snapshot.adapters import AdapterSpec

LORAS = {"sql": {"r": 4, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
         "chat": {"r": 8, "lora_alpha": 8, "use_rslora": True, "target_modules": ["o_proj", "gate_proj", "down_proj"]},
         "math": {"r": 2, "lora_alpha": 4, "target_modules": ["k_proj", "up_proj"]}}


def specs(loras: dict[str, Path], *names: str) -> list[AdapterSpec]:
    return [AdapterSpec(n, loras[n]) for n in names]

"""``local_to_te_state_dict``: rename a Megatron local-spec model's state dict to the Transformer-Engine
names the Turbo spec uses (the norms fused into ``linear_qkv``/``linear_fc1``, experts as ``weight{i}``),
so a local-spec checkpoint loads into a Turbo (or TE) model."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch

__all__ = ["local_to_te_state_dict", "te_name"]

_EXPERT = re.compile(r"(.*\.experts)\.local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)$")


def te_name(key: str, target: set[str] | frozenset[str]) -> str:
    """The Transformer-Engine-spec name of local-spec entry ``key`` in a model with keys ``target``."""
    if ".input_layernorm." in key:
        return key.replace(".input_layernorm.", ".self_attention.linear_qkv.layer_norm_")
    if ".pre_mlp_layernorm." in key:
        fused = key.replace(".pre_mlp_layernorm.", ".mlp.linear_fc1.layer_norm_")
        return fused if fused in target else key
    if match := _EXPERT.match(key):
        prefix, index, linear, kind = match.groups()
        return f"{prefix}.{linear}.{kind}{index}"
    return key


def local_to_te_state_dict(
    state_dict: Mapping[str, torch.Tensor], target_keys: Iterable[str]
) -> dict[str, torch.Tensor]:
    """``state_dict`` renamed to the keys of ``target_keys`` (a Turbo/TE model's ``state_dict().keys()``).

    Raises when a tensor has no place in the target or a target tensor has no source, so a silent
    mismatch cannot load half a model.
    """
    target = set(target_keys)
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if key.endswith("_extra_state"):
            continue
        new = te_name(key, target)
        if new not in target:
            raise KeyError(f"{key!r} (as {new!r}) has no place in the target state dict")
        out[new] = value
    missing = sorted(k for k in target if not k.endswith("_extra_state") and k not in out)
    if missing:
        raise KeyError(f"the target's {missing[:5]} (and {max(len(missing) - 5, 0)} more) have no source")
    return out

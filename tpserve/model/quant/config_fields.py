"""Checks shared by the readers of a checkpoint's ``quantization_config``
(``checkpoint_format.py`` for FP8, ``int_checkpoint.py`` for integer weights): the refusal
naming a field, the layers left unquantized, and compressed-tensors' one config group."""

from __future__ import annotations

from typing import Any


def refuse(field: str, value: Any, why: str) -> ValueError:
    """The error naming ``quantization_config.<field>`` and why its value is refused."""
    return ValueError(f"config.json: quantization_config.{field} = {value!r} is not "
                      f"supported: {why}")


def check_ignored(field: str, names: Any, what: str) -> None:
    """Only the LM head may stay unquantized (tpserve never quantizes it): each of
    ``names`` (``field``'s list; a ``re:`` pattern too) must name it. ``what``: how tpserve
    serves every other linear layer, for the error."""
    for name in names or ():
        if not (isinstance(name, str) and name.removeprefix("re:").rstrip("$")
                .endswith("lm_head")):
            raise refuse(field, names, f"tpserve serves every linear layer {what} (only "
                         "the LM head may be left out)")


def linear_group(qc: dict[str, Any], what: str) -> tuple[str, dict[str, Any]]:
    """A compressed-tensors config's one config group, on every linear layer and without
    sparsity: ``(its path in the config, the group)``; ``what``: the weights it must hold
    ("FP8", "integer"), for the errors."""
    if qc.get("sparsity_config"):
        raise refuse("sparsity_config", qc["sparsity_config"], "sparse weights")
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise refuse("config_groups", sorted(groups), f"exactly one config group ({what} "
                     "weights on every linear layer) is supported")
    (name, group), = groups.items()
    field = f"config_groups.{name}"
    if group.get("targets") != ["Linear"]:
        raise refuse(f"{field}.targets", group.get("targets"), "tpserve serves every "
                     f"linear layer with {what} weights (targets ['Linear'])")
    return field, group

"""Which target layers feed an EAGLE3 head: one rule for the planner and the worker (no torch import).

A head whose layer ids do not fit the target is refused by the planner first, with the message the
worker would give, so a planned EAGLE3 deployment is one the worker starts.
"""

from __future__ import annotations

from ..errors import InputError


def aux_layer_ids(raw: dict, target_layers: int, where: str) -> list[int]:
    """Hidden states entering these target layers feed an EAGLE3 head.

    ``eagle_config.eagle_aux_hidden_state_layer_ids`` names layers whose output is read (the state
    entering the next one); the default is the state entering layers 2, L//2 and L-3.
    """
    eagle_cfg = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else {}
    ids = eagle_cfg.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        layers = [2, target_layers // 2, target_layers - 3]
        field = f"the default layers [2, L//2, L-3] for the target's {target_layers} layers"
    else:
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise InputError(f"{where}: field 'eagle_config.eagle_aux_hidden_state_layer_ids' must be a list of "
                             "integers")
        layers = [i + 1 for i in ids]
        field = f"'eagle_config.eagle_aux_hidden_state_layer_ids' {ids}"
    if len(layers) != 3 or not all(0 <= i <= target_layers for i in layers):
        raise InputError(f"{where}: {field} must name 3 layers of the target's {target_layers}; "
                         "set eagle_config.eagle_aux_hidden_state_layer_ids to three layer ids in [-1, L-1]")
    return layers

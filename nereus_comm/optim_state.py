"""A whole training state as one flat dict of named entries, and back.

A reshard moves named tensors; a training state is a model state dict, a
``torch.optim`` state dict (per-parameter state under integer ids, hyperparameters in
``param_groups``) and, with mixed precision, fp32 master copies of the (bf16)
parameters. :func:`flatten_state` names every piece once, after its parameter:

- model entries keep their names (``layers.0.w``);
- optimizer state ``optim.<key>.<param>`` (``optim.exp_avg.layers.0.w``,
  ``optim.step.layers.0.w``: a step per parameter, a 0-dim tensor or a number), the
  integer ids mapped to names through the order of ``param_groups``;
- ``optim.param_groups``: the groups with parameter names in place of ids (a plain
  value, so it travels to every destination rank);
- master weights ``master.<param>``.

:func:`param_name` gives the parameter an entry belongs to, so the destination
placements of a parameter serve its moments and master copy too.
:func:`unflatten_state` rebuilds the three dicts (ids numbered 0.. in ``param_groups``
order, as ``Optimizer.state_dict`` numbers them and ``load_state_dict`` reads them).

Example::

    flat = flatten_state(model.state_dict(), opt.state_dict(),
                         param_names=[n for n, _ in model.named_parameters()])
    flat = reshard_dtensors(flat, new_mesh, lambda n, shape: plan[param_name(n)])
    model_sd, optim_sd, masters = unflatten_state(flat)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from nereus_comm.errors import LayoutError

__all__ = [
    "MASTER_PREFIX",
    "OPTIM_PREFIX",
    "PARAM_GROUPS_KEY",
    "TrainingState",
    "flatten_state",
    "param_name",
    "unflatten_state",
]

OPTIM_PREFIX = "optim."
MASTER_PREFIX = "master."
PARAM_GROUPS_KEY = "optim.param_groups"


class TrainingState(NamedTuple):
    """A model state dict, an optimizer state dict (or None) and master weights (or None)."""

    model: dict[str, Any]
    optim: dict[str, Any] | None
    masters: dict[str, Any] | None


def _group_names(optim_state: Mapping[str, Any], param_names: Sequence[str] | None) -> list:
    """param_groups with names in place of ids, and {id: name}."""
    groups = optim_state.get("param_groups")
    if not isinstance(groups, list):
        raise LayoutError("optim_state has no 'param_groups' list; pass Optimizer.state_dict()")
    ids = [p for g in groups for p in g["params"]]
    if all(isinstance(p, str) for p in ids):  # already keyed by name (DCP style)
        return [dict(g) for g in groups], {p: p for p in ids}
    if param_names is None:
        raise LayoutError(
            "optim_state keys parameters by integer id; pass param_names (the parameter "
            "names in the order the optimizer was given them, e.g. "
            "[n for n, _ in model.named_parameters()])"
        )
    names = list(param_names)
    if len(names) != len(ids):
        raise LayoutError(
            f"optim_state's param_groups hold {len(ids)} parameters but {len(names)} "
            "param_names were given"
        )
    if len(set(names)) != len(names):
        raise LayoutError("param_names repeat a name")
    of = dict(zip(ids, names))
    out = []
    for g in groups:
        g = dict(g)
        g["params"] = [of[p] for p in g["params"]]
        out.append(g)
    return out, of


def flatten_state(
    model_state: Mapping[str, Any],
    optim_state: Mapping[str, Any] | None = None,
    *,
    param_names: Sequence[str] | None = None,
    masters: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One flat dict of the model state, the optimizer state and master weights.

    Arguments:
        model_state: the model's state dict (tensors or DTensors by name).
        optim_state: ``Optimizer.state_dict()`` (ids) or a name-keyed one (DCP style).
        param_names: the names of the optimizer's parameters in the order of its
            param_groups (needed when ``optim_state`` keys them by id).
        masters: fp32 master weights by parameter name (mixed precision).

    Returns:
        {name: entry} as the module docstring names them (the tensors themselves, not
        copies).

    Raises:
        LayoutError: a model entry named like an optimizer or master entry, ids without
            param_names, a param_names count that differs from the optimizer's.
    """
    flat: dict[str, Any] = {}
    for k, v in model_state.items():
        if k.startswith((OPTIM_PREFIX, MASTER_PREFIX)):
            raise LayoutError(
                f"model entry {k!r} starts with {OPTIM_PREFIX!r} or {MASTER_PREFIX!r}, which "
                "name optimizer and master entries; rename it"
            )
        flat[k] = v
    if optim_state is not None:
        groups, of = _group_names(optim_state, param_names)
        for pid, per in optim_state.get("state", {}).items():
            if pid not in of:
                raise LayoutError(f"optim_state has state for parameter {pid!r}, in no param_group")
            for key, v in per.items():
                if "." in key:
                    raise LayoutError(f"optimizer state key {key!r} contains a '.'")
                flat[f"{OPTIM_PREFIX}{key}.{of[pid]}"] = v
        flat[PARAM_GROUPS_KEY] = groups
    for name, v in (masters or {}).items():
        flat[f"{MASTER_PREFIX}{name}"] = v
    return flat


def param_name(key: str) -> str:
    """The parameter a flat entry belongs to (a model entry: its own name)."""
    if key.startswith(MASTER_PREFIX):
        return key[len(MASTER_PREFIX) :]
    if key.startswith(OPTIM_PREFIX) and key != PARAM_GROUPS_KEY:
        rest = key[len(OPTIM_PREFIX) :].split(".", 1)
        # A state entry of no parameter (a global "optim.step") is its own.
        return rest[1] if len(rest) == 2 else key
    return key


def unflatten_state(flat: Mapping[str, Any]) -> TrainingState:
    """The model state dict, optimizer state dict and master weights of a flat dict.

    Returns:
        TrainingState; optim is None when the flat dict has no ``optim.param_groups``,
        masters None when it has no master entry. The optimizer state numbers
        parameters 0.. in param_groups order (what ``Optimizer.load_state_dict``
        expects).

    Raises:
        LayoutError: optimizer state for a parameter that no param_group names.
    """
    model: dict[str, Any] = {}
    masters: dict[str, Any] = {}
    per_param: dict[str, dict[str, Any]] = {}
    for k, v in flat.items():
        if k == PARAM_GROUPS_KEY:
            continue
        if k.startswith(MASTER_PREFIX):
            masters[k[len(MASTER_PREFIX) :]] = v
        elif k.startswith(OPTIM_PREFIX):
            key, name = k[len(OPTIM_PREFIX) :].split(".", 1)
            per_param.setdefault(name, {})[key] = v
        else:
            model[k] = v
    optim = None
    if PARAM_GROUPS_KEY in flat:
        groups, ids = [], {}
        for g in flat[PARAM_GROUPS_KEY]:
            g = dict(g)
            g["params"] = [ids.setdefault(n, len(ids)) for n in g["params"]]
            groups.append(g)
        stray = sorted(set(per_param) - set(ids))
        if stray:
            raise LayoutError(f"optimizer state for {stray[:5]}, which no param_group names")
        state = {ids[n]: per_param[n] for n in ids if n in per_param}
        optim = {"state": state, "param_groups": groups}
    elif per_param:
        raise LayoutError(f"optimizer entries without {PARAM_GROUPS_KEY!r}")
    return TrainingState(model, optim, masters or None)

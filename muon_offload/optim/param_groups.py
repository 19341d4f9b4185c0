"""``muon_param_groups``: split a model's trainable parameters into the param groups of
``Muon`` (hidden matrices and expert stacks) and of an AdamW group (embeddings, output head,
norms, biases and every other vector), the split every Muon user otherwise writes by hand.

Each trainable parameter lands in exactly one group; frozen ones are left out. Parameters
are listed in ``model.named_parameters()`` order, so the same model gives the same groups
(which a checkpoint's state is matched against) every time.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from fnmatch import fnmatchcase

from torch import nn
from torch.nn.modules.conv import _ConvNd

Pattern = str | re.Pattern

EMBEDDING_TYPES = (nn.Embedding, nn.EmbeddingBag)


def muon_param_groups(
    model: nn.Module,
    *,
    lr: float | None = None,
    weight_decay: float | None = None,
    adamw_lr: float | None = None,
    adamw_betas: tuple[float, float] | None = None,
    adamw_weight_decay: float | None = None,
    adamw_epsilon: float | None = None,
    muon_params: Iterable[Pattern] = (),
    adamw_params: Iterable[Pattern] = (),
) -> list[dict]:
    """Param groups for ``muon_offload.Muon`` (or dion's ``Muon``) from ``model``.

    Automatic split:

    - AdamW: the weights of ``nn.Embedding`` / ``nn.EmbeddingBag`` modules, of
      ``model.get_input_embeddings()`` and ``model.get_output_embeddings()`` where the model
      has them (transformers models: the output head), and every parameter with fewer than
      2 dims (norms, biases, scalars). A weight tied between the embedding and the head is
      one Parameter: it is listed once, in the AdamW group.
    - Muon: every other parameter with 2 or more dims. 3-D and larger tensors are stacks of
      matrices on their last two dims (MoE expert weights such as transformers'
      ``experts.gate_up_proj``), each orthogonalized on its own.
    - Muon with ``flatten=True``, a group of its own: convolution weights (any
      ``nn.Conv*d`` / ``nn.ConvTranspose*d``), orthogonalized as one
      ``[out_channels, in_channels * kernel]`` matrix rather than as a stack of kernels.

    A plain torch model has no ``get_output_embeddings()``: its output head is an
    ``nn.Linear`` like any hidden layer and goes to Muon unless named in ``adamw_params``.
    A wrapped model (``DistributedDataParallel``, ``DataParallel``, FSDP1, ``torch.compile``)
    is split as the model inside it.

    Overrides: ``muon_params`` and ``adamw_params`` are name patterns matched against
    ``model.named_parameters()`` names (a tied weight under any of its names; a wrapped
    model's parameters also under the inner model's names, ``lm_head.weight`` as well as
    ``module.lm_head.weight``): strings are
    shell-style patterns (``fnmatch``: ``"lm_head.weight"``, ``"*.mlp.gate.weight"``), compiled
    ``re.Pattern`` objects are searched. A matched parameter goes to that group whatever the
    automatic split said. Raises ``ValueError`` if a pattern matches no parameter (trainable
    or frozen: a typo would otherwise be silent), if a parameter matches patterns of both
    lists, or if ``muon_params`` matches a parameter with fewer than 2 dims.

    Keyword arguments given set that group's hyper-parameters; those left None fall back to
    the optimizer's constructor arguments (``Muon(groups, lr=..., weight_decay=...,
    betas=..., epsilon=...)``). ``lr`` and ``weight_decay`` are the Muon groups'; the
    ``adamw_*`` ones the AdamW group's (dion's keys ``beta1``, ``beta2``, ``epsilon``). The
    AdamW group usually wants a much smaller ``lr`` than Muon's (e.g. 3e-4 to 3e-3 against
    0.02). Empty groups are left out.
    """
    names, module_kind = _parameter_names_and_kinds(model)
    forced = _forced(names, muon_params, adamw_params)

    muon, conv, adamw = [], [], []
    for param, param_names in names.items():
        if not param.requires_grad:
            continue
        choice = forced.get(param)
        if choice == "muon" and param.ndim < 2:
            raise ValueError(
                f"muon_params matches {param_names[0]!r} of shape {tuple(param.shape)}: Muon "
                "needs 2 or more dims"
            )
        kind = module_kind.get(param)
        if choice == "adamw" or (choice is None and (param.ndim < 2 or kind == "embedding")):
            adamw.append(param)
        elif kind == "conv" and param.ndim > 2:
            conv.append(param)
        else:
            muon.append(param)

    muon_hyper = _given(lr=lr, weight_decay=weight_decay)
    betas = adamw_betas if adamw_betas is not None else (None, None)
    adamw_hyper = _given(
        lr=adamw_lr,
        beta1=betas[0],
        beta2=betas[1],
        weight_decay=adamw_weight_decay,
        epsilon=adamw_epsilon,
    )
    groups = [
        dict(params=muon, algorithm="muon", **muon_hyper),
        dict(params=conv, algorithm="muon", flatten=True, **muon_hyper),
        dict(params=adamw, algorithm="adamw", **adamw_hyper),
    ]
    return [g for g in groups if g["params"]]


def _parameter_names_and_kinds(model: nn.Module):
    """Every parameter (once, in ``named_parameters`` order) with all the names it has (the
    model's, then those of the models its wrappers hold), and the kind of the modules that
    hold it ("embedding" wins over "conv")."""
    names: dict[nn.Parameter, list[str]] = {}
    levels = _unwrapped(model)
    for level in levels:
        for name, param in level.named_parameters(remove_duplicate=False):
            known = names.setdefault(param, [])
            if name not in known:
                known.append(name)

    embedding_modules = {id(m) for m in model.modules() if isinstance(m, EMBEDDING_TYPES)}
    for level in levels:  # a wrapper has no getters: the model inside it does
        for getter in ("get_input_embeddings", "get_output_embeddings"):
            module = _call_getter(level, getter)
            if isinstance(module, nn.Module):
                embedding_modules.update(map(id, _unwrapped(module)))

    kind: dict[nn.Parameter, str] = {}
    for module in model.modules():
        if id(module) in embedding_modules:
            this = "embedding"
        elif isinstance(module, _ConvNd):
            this = "conv"
        else:
            continue
        for param in module.parameters(recurse=False):
            if kind.get(param) != "embedding":
                kind[param] = this
    return names, kind


def _unwrapped(model: nn.Module) -> list[nn.Module]:
    """``model`` and the models inside its wrappers, outermost first: ``torch.compile``'s
    (``_orig_mod``), and ``.module`` (DistributedDataParallel, DataParallel, FSDP1) where the
    wrapper holds the very parameters of the module inside and none of its own."""
    chain = [model]
    while True:
        outer = chain[-1]
        inner = getattr(outer, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            inner = getattr(outer, "module", None)
        if not isinstance(inner, nn.Module) or any(inner is m for m in chain):
            return chain
        if {id(p) for p in outer.parameters()} != {id(p) for p in inner.parameters()}:
            return chain
        chain.append(inner)


def _call_getter(model: nn.Module, getter: str):
    method = getattr(model, getter, None)
    if not callable(method):
        return None
    try:
        return method()
    except NotImplementedError:  # transformers' base class for models without one
        return None


def _forced(names, muon_params, adamw_params) -> dict[nn.Parameter, str]:
    forced: dict[nn.Parameter, str] = {}
    where: dict[nn.Parameter, str] = {}
    for group, patterns in (("muon", muon_params), ("adamw", adamw_params)):
        if isinstance(patterns, (str, re.Pattern)):
            patterns = [patterns]  # one pattern given bare, not its characters
        for pattern in patterns:
            hits = [p for p, ns in names.items() if any(_matches(pattern, n) for n in ns)]
            if not hits:
                raise ValueError(
                    f"{group}_params pattern {_show(pattern)} matches no parameter of the model"
                )
            for param in hits:
                if forced.get(param, group) != group:
                    raise ValueError(
                        f"{names[param][0]!r} matches both muon_params ({where[param]}) and "
                        f"adamw_params ({_show(pattern)})"
                    )
                forced[param] = group
                where.setdefault(param, _show(pattern))
    return forced


def _matches(pattern: Pattern, name: str) -> bool:
    if isinstance(pattern, re.Pattern):
        return pattern.search(name) is not None
    return fnmatchcase(name, pattern)


def _show(pattern: Pattern) -> str:
    return repr(pattern.pattern if isinstance(pattern, re.Pattern) else pattern)


def _given(**hyper) -> dict:
    return {key: value for key, value in hyper.items() if value is not None}

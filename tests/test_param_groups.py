"""``muon_param_groups`` on real model definitions (transformers' Qwen3-MoE, Llama and Qwen3
with tied and untied embeddings, torch's TransformerEncoder, a conv net): every trainable
parameter in exactly one group, each where Muon users put it, and the groups accepted by
``Muon``."""

import re
import warnings

import pytest
import torch
from torch import nn

from muon_offload import Muon, muon_param_groups

NEEDS_HF = 'needs transformers: pip install -e ".[hf]"'


def _by_algorithm(groups):
    out = {"muon": [], "conv": [], "adamw": []}
    for g in groups:
        key = "conv" if g.get("flatten") else g["algorithm"]
        out[key].extend(g["params"])
    return out


def _check_partition(model, groups):
    """Every trainable parameter exactly once; no frozen one."""
    listed = [p for g in groups for p in g["params"]]
    assert len({id(p) for p in listed}) == len(listed), "a parameter is in two groups"
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert {id(p) for p in listed} == trainable


def _ids(params):
    return {id(p) for p in params}


def _one_step_changes_every_parameter(model, groups, batch):
    """Muon takes the groups, and one step moves every parameter it was given."""
    opt = Muon(groups, lr=0.02)
    before = {id(p): p.detach().clone() for g in groups for p in g["params"]}
    loss = model(**batch).loss if isinstance(batch, dict) else model(batch).float().square().mean()
    loss.backward()
    opt.step()
    for g in groups:
        for p in g["params"]:
            assert not torch.equal(p.detach(), before[id(p)])


def _qwen3_moe(tie=False):
    transformers = pytest.importorskip("transformers", reason=NEEDS_HF)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(cfg)


def _dense(arch, tie):
    transformers = pytest.importorskip("transformers", reason=NEEDS_HF)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    cfg = config_cls(
        vocab_size=101,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    return model_cls(cfg)


def _lm_batch(vocab):
    ids = torch.randint(vocab, (2, 9), generator=torch.Generator().manual_seed(1))
    return dict(input_ids=ids, labels=ids)


def test_qwen3_moe_expert_stacks_go_to_muon():
    model = _qwen3_moe()
    groups = muon_param_groups(model, lr=0.02, adamw_lr=3e-3)
    _check_partition(model, groups)
    split = _by_algorithm(groups)
    named = dict(model.named_parameters())
    experts = [p for n, p in named.items() if ".experts." in n]
    # transformers 5 stores each layer's experts as [experts, out, in] parameters.
    assert experts and all(p.ndim == 3 for p in experts)
    assert _ids(experts) <= _ids(split["muon"])
    for n, p in named.items():
        if n in ("model.embed_tokens.weight", "lm_head.weight") or p.ndim < 2:
            assert id(p) in _ids(split["adamw"]), n
        else:  # attention projections, expert stacks and the router
            assert id(p) in _ids(split["muon"]), n
    assert not split["conv"]
    _one_step_changes_every_parameter(model, groups, _lm_batch(97))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_dense_causal_lm_embeddings_and_head_go_to_adamw(arch, tie):
    model = _dense(arch, tie)
    head, embed = model.lm_head.weight, model.model.embed_tokens.weight
    assert (head is embed) == tie
    groups = muon_param_groups(model)
    _check_partition(model, groups)
    split = _by_algorithm(groups)
    assert {id(head), id(embed)} <= _ids(split["adamw"])
    hidden = [n for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n]
    assert ("lm_head.weight" in hidden) != tie
    matrices = [model.get_parameter(n) for n in hidden if n != "lm_head.weight"]
    assert _ids(split["muon"]) == _ids(matrices)
    _one_step_changes_every_parameter(model, groups, _lm_batch(101))


def test_tied_weight_forced_under_its_second_name():
    """A tied weight has two names; a pattern on either moves the one Parameter."""
    model = _dense("llama", tie=True)
    assert "lm_head.weight" not in dict(model.named_parameters())  # deduplicated there
    groups = muon_param_groups(model, muon_params=["lm_head.weight"])
    _check_partition(model, groups)
    assert id(model.lm_head.weight) in _ids(_by_algorithm(groups)["muon"])


def test_transformer_encoder():
    layer = nn.TransformerEncoderLayer(d_model=24, nhead=4, dim_feedforward=40, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    groups = muon_param_groups(model, adamw_lr=1e-3)
    _check_partition(model, groups)
    split = _by_algorithm(groups)
    assert _ids(split["muon"]) == _ids(p for p in model.parameters() if p.ndim == 2)
    assert _ids(split["adamw"]) == _ids(p for p in model.parameters() if p.ndim < 2)
    # The packed q/k/v projection is one [3 d, d] matrix.
    assert id(model.layers[0].self_attn.in_proj_weight) in _ids(split["muon"])
    torch.manual_seed(0)
    _one_step_changes_every_parameter(model, groups, torch.randn(2, 5, 24))


def _conv_net():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 12, 3, padding=1, bias=False),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(12 * 5 * 5, 10),
    )


def test_conv_net_conv_weights_flattened():
    model = _conv_net()
    groups = muon_param_groups(model, adamw_params=["6.*"])  # the classifier head
    _check_partition(model, groups)
    split = _by_algorithm(groups)
    assert _ids(split["conv"]) == {id(model[0].weight), id(model[3].weight)}
    assert _ids(split["muon"]) == set()
    assert id(model[6].weight) in _ids(split["adamw"])
    assert [g["algorithm"] for g in groups] == ["muon", "adamw"]
    _one_step_changes_every_parameter(model, groups, torch.randn(2, 3, 5, 5))


def test_flattened_conv_weight_is_updated_as_its_matrix():
    """A conv weight's step is Muon's step on the [out, in * kh * kw] matrix it flattens to
    (the reference: a 2-D parameter with the same data and gradient, plain Muon)."""
    gen = torch.Generator().manual_seed(2)
    conv = nn.Conv2d(5, 7, 3)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=gen))
    matrix = nn.Parameter(conv.weight.detach().reshape(7, -1).clone())
    stack = nn.Parameter(conv.weight.detach().clone())  # Muon's default for 4-D: 3x3 kernels
    grad = torch.randn(conv.weight.shape, generator=gen)
    conv.weight.grad, stack.grad = grad.clone(), grad.clone()
    matrix.grad = grad.reshape(7, -1).clone()
    groups = muon_param_groups(conv)
    assert groups[0]["flatten"] and groups[0]["params"] == [conv.weight]
    for opt in (Muon(groups, lr=0.05), Muon([matrix], lr=0.05), Muon([stack], lr=0.05)):
        opt.step()
    # Same arithmetic on the same numbers: bitwise.
    assert torch.equal(conv.weight.detach().reshape(7, -1), matrix.detach())
    assert not torch.allclose(conv.weight.detach(), stack.detach(), rtol=0, atol=1e-3)


def test_patterns_fnmatch_and_regex_override():
    model = _conv_net()
    groups = muon_param_groups(
        model, muon_params=[re.compile(r"^6\.weight$")], adamw_params=["0.*"]
    )
    split = _by_algorithm(groups)
    assert id(model[6].weight) in _ids(split["muon"])
    assert id(model[0].weight) in _ids(split["adamw"])
    assert _ids(split["conv"]) == {id(model[3].weight)}
    _check_partition(model, groups)
    # One bare string is one pattern, not a list of characters.
    bare = muon_param_groups(model, adamw_params="6.weight")
    assert id(model[6].weight) in _ids(_by_algorithm(bare)["adamw"])


def test_pattern_errors():
    model = _conv_net()
    with pytest.raises(ValueError, match=r"adamw_params pattern 'head\.\*' matches no"):
        muon_param_groups(model, adamw_params=["head.*"])
    with pytest.raises(ValueError, match=r"muon_params pattern '\^x' matches no"):
        muon_param_groups(model, muon_params=[re.compile("^x")])
    with pytest.raises(ValueError, match="matches both muon_params"):
        muon_param_groups(model, muon_params=["6.*"], adamw_params=["6.weight"])
    with pytest.raises(ValueError, match="Muon needs 2 or more dims"):
        muon_param_groups(model, muon_params=["1.bias"])


def test_frozen_parameters_left_out():
    model = _conv_net()
    model[0].requires_grad_(False)
    # A pattern that matches only frozen parameters is no typo: no error.
    groups = muon_param_groups(model, adamw_params=["0.weight"])
    _check_partition(model, groups)
    assert id(model[0].weight) not in _ids(p for g in groups for p in g["params"])


def test_hyperparameters_reach_the_optimizer():
    model = _conv_net()
    groups = muon_param_groups(
        model,
        lr=0.03,
        weight_decay=0.1,
        adamw_lr=2e-3,
        adamw_betas=(0.8, 0.9),
        adamw_weight_decay=0.0,
        adamw_epsilon=1e-10,
    )
    opt = Muon(groups, lr=0.5, weight_decay=0.5, betas=(0.1, 0.2), epsilon=0.3)
    muon, conv, adamw = opt.param_groups
    assert (muon["lr"], muon["weight_decay"], muon["flatten"]) == (0.03, 0.1, False)
    assert (conv["lr"], conv["weight_decay"], conv["flatten"]) == (0.03, 0.1, True)
    got = [adamw[k] for k in ("algorithm", "lr", "beta1", "beta2", "weight_decay", "epsilon")]
    assert got == ["adamw", 2e-3, 0.8, 0.9, 0.0, 1e-10]
    # Left unset: the constructor's values.
    defaults = muon_param_groups(model)
    opt = Muon(defaults, lr=0.5, weight_decay=0.25, betas=(0.1, 0.2), epsilon=0.3)
    got = [opt.param_groups[2][k] for k in ("lr", "beta1", "beta2", "weight_decay", "epsilon")]
    assert got == [0.5, 0.1, 0.2, 0.25, 0.3]


@pytest.fixture
def gloo_world():
    """A one-process gloo group, as DistributedDataParallel needs one."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed, and no process group already made")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _Wrapper(nn.Module):
    """A wrapper in FSDP1's manner: the model as ``.module``, nothing of its own."""

    def __init__(self, module):
        super().__init__()
        self.wrapped = module

    @property
    def module(self):
        return self.wrapped

    def forward(self, *args, **kwargs):
        return self.wrapped(*args, **kwargs)


def _wrapped_groups_match_the_model(model, wrapped, prefix):
    """The wrapped model's groups are the model's, and its names (the wrapped ones, and the
    model's own) still move parameters by pattern."""
    head = model.lm_head.weight
    expected = muon_param_groups(model)
    groups = muon_param_groups(wrapped)
    assert [(g["algorithm"], _ids(g["params"])) for g in groups] == [
        (g["algorithm"], _ids(g["params"])) for g in expected
    ]
    assert id(head) in _ids(_by_algorithm(groups)["adamw"])
    for name in (f"{prefix}lm_head.weight", "lm_head.weight"):
        moved = muon_param_groups(wrapped, muon_params=[name])
        assert id(head) in _ids(_by_algorithm(moved)["muon"]), name
    with pytest.raises(ValueError, match=re.escape(f"'{prefix}model.norm.weight' of shape")):
        muon_param_groups(wrapped, muon_params=["model.norm.weight"])


def _fsdp1(model):
    from torch.distributed.fsdp import FullyShardedDataParallel

    with warnings.catch_warnings():  # one process: FSDP1 says it will not shard
        warnings.simplefilter("ignore", UserWarning)
        return FullyShardedDataParallel(model, use_orig_params=True, device_id="cpu")


@pytest.mark.parametrize(
    "wrap,prefix",
    [(nn.parallel.DistributedDataParallel, "module."), (_fsdp1, "_fsdp_wrapped_module.")],
    ids=["ddp", "fsdp1"],
)
def test_distributed_wrapper_keeps_the_head_in_adamw(gloo_world, wrap, prefix):
    model = _dense("llama", tie=False)
    wrapped = wrap(model)
    _wrapped_groups_match_the_model(model, wrapped, prefix)
    _one_step_changes_every_parameter(wrapped, muon_param_groups(wrapped), _lm_batch(101))


def test_module_wrapper_and_compiled_model_keep_their_head_in_adamw():
    model = _dense("llama", tie=False)
    _wrapped_groups_match_the_model(model, _Wrapper(model), "wrapped.")
    try:
        compiled = torch.compile(model)
    except Exception as err:  # noqa: BLE001 - whatever keeps torch.compile from working here
        pytest.skip(f"torch.compile unavailable: {err}")
    _wrapped_groups_match_the_model(model, compiled, "_orig_mod.")
    _wrapped_groups_match_the_model(model, _Wrapper(compiled), "wrapped._orig_mod.")


def test_wrapper_with_parameters_of_its_own_is_not_unwrapped():
    """A module that holds a model as ``.module`` beside a parameter of its own is a model in
    its own right: its ``.module``'s head is a hidden layer of it."""
    model = _dense("llama", tie=False)
    outer = _Wrapper(model)
    outer.extra = nn.Linear(8, 8)
    split = _by_algorithm(muon_param_groups(outer))
    assert id(model.lm_head.weight) in _ids(split["muon"])

"""The replayed step's host path takes shortcuts: pairs reused from the last step
(``step_work``), the last plan compared before a lookup (``PlanCache``), state dicts found
without hashing (``StateIndex``). Each shortcut must see every change that makes it wrong:
here a graphed optimizer (a stand-in graph whose replay runs the captured step's Python
again, as in test_cuda_graph.py) and an eager twin take the same changes between replayed
steps; they must stay equal bit for bit, and the graph must be dropped where the change
moved what it reads."""

import pytest
import torch

from muon_offload import Muon
from muon_offload.engine import capture_rules
from muon_offload.engine.graphs import StepGraphs


class FakeGraph:
    """capture() keeps the body (a capture runs nothing); replay() runs it."""

    def __init__(self):
        self.body, self.was_reset = None, False

    def capture(self, body):
        self.body = body

    def replay(self):
        self.body()

    def reset(self):
        self.was_reset = True


def _params(seed=0, shapes=((24, 40), (24, 40), (40, 24), (77,), (5,))):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def _muon(params, graphed, monkeypatch, made):
    groups = [
        dict(params=params[:3]),
        dict(params=params[3:4], algorithm="adamw", lr=3e-3),
        dict(params=params[4:], algorithm="lion", lr=1e-3),
    ]
    opt = Muon(groups, lr=0.02, backend="triton", cuda_graph=False)
    if graphed:  # the CPU stands in for the GPU: the device check is the one thing bypassed
        monkeypatch.setattr(capture_rules, "check_device", lambda cuda_graph, device: None)
        opt.cuda_graph = True
        opt._graphing.graphs = StepGraphs(
            torch.device("cpu"), lambda: made.append(FakeGraph()) or made[-1]
        )
    return opt


def _grads(params, step):
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        g = torch.randn(p.shape, generator=gen)
        if p.grad is None:
            p.grad = g
        else:
            p.grad.copy_(g)  # in place: the addresses a graph holds stay valid


def _twins(monkeypatch, steps=3):
    """A graphed optimizer replaying by now, and its eager twin, after ``steps`` steps (0 eager,
    1 capture, 2 replay: the next step replays unless a change is seen)."""
    a, b, made = _params(), _params(), []
    opt_a, opt_b = _muon(a, True, monkeypatch, made), _muon(b, False, monkeypatch, made)
    _steps(opt_a, a, opt_b, b, range(steps))
    assert opt_a.graph_stats()["replays"] >= 1
    return opt_a, a, opt_b, b, made


def _steps(opt_a, a, opt_b, b, steps):
    for s in steps:
        for opt, ps in ((opt_a, a), (opt_b, b)):
            _grads(ps, s)
            opt.step()
    for p, q in zip(a, b, strict=True):
        assert torch.equal(p, q)
        assert opt_a.state[p].keys() == opt_b.state[q].keys()
        for k in opt_a.state[p]:
            assert torch.equal(opt_a.state[p][k], opt_b.state[q][k]), k


def _change_both(opt_a, a, opt_b, b, change):
    change(opt_a, a)
    change(opt_b, b)


def _replace_state_tensor(opt, params):
    state = opt.state[params[0]]
    state["momentum"] = state["momentum"].clone()


def _replace_state_dict(opt, params):
    opt.state[params[1]] = {k: v.clone() for k, v in opt.state[params[1]].items()}


def _replace_adamw_state(opt, params):
    opt.state[params[3]]["variance"] = opt.state[params[3]]["variance"].clone()


def _move_parameter(opt, params):
    params[2].data = params[2].data.clone()


@pytest.mark.parametrize(
    "change",
    [_replace_state_tensor, _replace_state_dict, _replace_adamw_state, _move_parameter],
)
def test_what_a_replay_reads_moved_drops_the_graph(monkeypatch, change):
    opt_a, a, opt_b, b, made = _twins(monkeypatch)
    _change_both(opt_a, a, opt_b, b, change)
    _steps(opt_a, a, opt_b, b, range(3, 6))
    assert made[0].was_reset and opt_a.graph_stats()["captures"] == 2


def test_state_dropped_or_emptied_is_created_afresh(monkeypatch):
    opt_a, a, opt_b, b, made = _twins(monkeypatch)

    def forget(opt, params):
        del opt.state[params[0]]
        opt.state[params[4]].clear()

    _change_both(opt_a, a, opt_b, b, forget)
    _steps(opt_a, a, opt_b, b, range(3, 6))
    assert opt_a.state[a[0]]["momentum"].abs().sum() > 0
    assert set(opt_a.state[a[4]]) == {"momentum"}
    assert made[0].was_reset


def test_state_dict_rekeyed_is_seen(monkeypatch):
    """The last parameter's state dict stored under another parameter: the same dicts in the
    same order, one key differing."""
    opt_a, a, opt_b, b, made = _twins(monkeypatch)

    def rekey(opt, params):
        last = list(opt.state)[-1]
        moved = opt.state.pop(last)
        extra = torch.nn.Parameter(torch.zeros_like(last))
        opt.state[extra] = moved  # not a parameter of any group: ``last`` has no state now

    _change_both(opt_a, a, opt_b, b, rekey)
    _steps(opt_a, a, opt_b, b, range(3, 6))
    assert made[0].was_reset


def test_parameter_swapped_in_a_group(monkeypatch):
    opt_a, a, opt_b, b, made = _twins(monkeypatch)

    def swap(opt, params):
        new = torch.nn.Parameter(params[1].detach().clone())
        opt.param_groups[0]["params"][1] = new
        params[1] = new

    _change_both(opt_a, a, opt_b, b, swap)
    _steps(opt_a, a, opt_b, b, range(3, 6))
    assert made[0].was_reset and set(opt_a.state[a[1]]) == {"momentum"}


def test_gradients_come_and_go_between_replays(monkeypatch):
    opt_a, a, opt_b, b, made = _twins(monkeypatch)
    for params in (a, b):
        params[1].grad = None
    _steps(opt_a, a, opt_b, b, range(3, 6))
    _steps(opt_a, a, opt_b, b, range(6, 9))  # the gradient back (a new address): again


def test_reconfigure_plans_afresh(monkeypatch):
    opt_a, a, opt_b, b, made = _twins(monkeypatch)
    for opt in (opt_a, opt_b):
        opt.reconfigure(resident_chunk_bytes=4000)
    _steps(opt_a, a, opt_b, b, range(3, 6))
    assert made[0].was_reset and len(opt_a._plans[next(iter(opt_a._plans))][0].chunks) > 1


def test_parameter_reshaped_is_refused_at_replay(monkeypatch):
    opt_a, a, _, _, _ = _twins(monkeypatch)
    a[0].data = torch.randn(40, 24)
    a[0].grad = torch.randn(40, 24)
    before = a[0].detach().clone()
    with pytest.raises(ValueError, match="changed shape since its state was created"):
        opt_a.step()
    assert torch.equal(a[0], before)


def test_sparse_gradient_is_refused_at_replay(monkeypatch):
    """A replayed step reads the data pointers with the checks: a gradient without storage
    must still meet the check that names it."""
    opt_a, a, _, _, _ = _twins(monkeypatch)
    a[3].grad = a[3].grad.to_sparse()
    before = a[3].detach().clone()
    with pytest.raises(TypeError, match="sparse gradients are not supported"):
        opt_a.step()
    assert torch.equal(a[3], before)

"""Worker body for tests/test_distributed_in_place.py: an FSDP2 model's checkpoint loaded in
place into the live state dicts (``dcp.load({"model": ..., "optim": opt.state_dict()})``, no
load_state_dict), as torchao's FSDP2 tests resume."""

import torch
import torch.distributed.checkpoint as dcp
from dist_workers_int8 import _fsdp_model, _same, _train

from dist_workers import _finish, init


def in_place_resume(rank, world, port, path, state_dtype, offload):
    """Saved at step 3, loaded in place into an optimizer that stepped on other data, resumed
    to step 5: bitwise the uninterrupted run, 8-bit scales of uneven shards included."""
    mesh = init(rank, world, port)
    state_dtype = getattr(torch, state_dtype)
    kw = dict(offload=offload, chunk_bytes=512)
    straight, straight_opt = _fsdp_model(mesh, state_dtype, **kw)
    _train(straight, straight_opt, range(5))
    first, first_opt = _fsdp_model(mesh, state_dtype, **kw)
    _train(first, first_opt, range(3))
    dcp.save({"model": first.state_dict(), "optim": first_opt.state_dict()}, checkpoint_id=path)
    resumed, resumed_opt = _fsdp_model(mesh, state_dtype, **kw)
    _train(resumed, resumed_opt, range(50, 52))  # state and counts to be overwritten
    target = {"model": resumed.state_dict(), "optim": resumed_opt.state_dict()}
    dcp.load(target, checkpoint_id=path)
    del target  # as dcp.load(opt.state_dict()) keeps nothing
    if not offload:  # 8-bit scales of shards are copies, read back by state_dict() or a step
        resumed_opt.state_dict()
        _same(first, first_opt, resumed, resumed_opt)
    _train(resumed, resumed_opt, range(3, 5))
    _same(straight, straight_opt, resumed, resumed_opt)
    _finish()

"""Sharded values made ordinary again in rank 0 (transfer/unshard.py), on real FSDP2 (``fully_shard``),
``distribute_module`` and DTensor values in a one-process gloo group: the class back, whole parameters and
buffers, sharding's hooks and FSDP's state gone (the person's own stay), one object still one object, and kept
ranks' values left as they were."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor

from taas_magic.transfer import unshard
from taas_magic.transfer.unshard import Rebuild, make_plain, original_class, oversized, shallow_tree, tensor_key
from tests.unit.gloo import one_rank_group


@pytest.fixture(scope="module")
def mesh():
    """A one-process gloo group and its CPU mesh: what FSDP2 and DTensor need to exist at all."""
    with one_rank_group() as one:
        yield one


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(4, 6)
        self.head = torch.nn.Linear(6, 3)
        self.register_buffer("scale", torch.tensor([1.0, 2.0, 3.0]))

    def forward(self, x):
        return self.head(torch.relu(self.embed(x))) * self.scale


def _sharded(mesh) -> tuple[Net, Net]:
    """A ``Net`` sharded as a training cell does (each block, then the root), and an unsharded copy of it."""
    torch.manual_seed(0)
    model = Net()
    model.embed.bias.requires_grad_(False)
    reference = copy.deepcopy(model)
    fully_shard(model.embed, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, reference


def _gathered(dtensor):
    """What transfer/sharded.py's gather keeps for a DTensor: its whole tensor, a CPU copy of its own."""
    with torch.no_grad():
        return dtensor.full_tensor().detach().clone()


def _backward(model) -> None:
    """A training step's forward and backward (no optimizer step: the values stay the reference's). FSDP2 adds
    its state dict hooks at its first forward (``to_sharded_hook``; the load one in nn.Module's ``_WrappedHook``)."""
    model(torch.randn(2, 4)).sum().backward()


def _hooks(module) -> dict:
    return {table: dict(getattr(module, table)) for table in unshard.HOOK_TABLES + unshard.HOOK_FLAGS}


def test_the_original_class_is_the_first_in_the_mro_that_is_not_fsdps(mesh):
    model, _ = _sharded(mesh)
    assert type(model).__name__ == "FSDPNet" and isinstance(model, FSDPModule)
    assert original_class(type(model)) is Net
    assert original_class(type(model.embed)) is torch.nn.Linear
    assert original_class(Net) is Net and original_class(int) is int


def test_an_fsdp2_module_becomes_its_own_class_with_whole_parameters_and_nothing_of_fsdp_left(mesh):
    model, reference = _sharded(mesh)
    _backward(model)
    dtensors = dict(model.named_parameters())
    assert all(isinstance(param, DTensor) for param in dtensors.values())
    assert [param.grad is not None for param in dtensors.values()] == [True, False, True, True]
    assert any(key.startswith(unshard.STATE_KEY) for key in vars(model)) and model._forward_pre_hooks
    assert len(model.embed._state_dict_pre_hooks) == 1 and len(model.head._load_state_dict_pre_hooks) == 1
    done: dict = {}
    assert make_plain(model, _gathered, done) is model
    assert type(model) is Net and type(model.embed) is torch.nn.Linear and type(model.head) is torch.nn.Linear
    params = dict(model.named_parameters())
    assert list(params) == ["embed.weight", "embed.bias", "head.weight", "head.bias"]
    expected = dict(reference.named_parameters())
    for name, param in params.items():
        assert type(param) is torch.nn.Parameter and param.grad is None
        assert torch.equal(param.detach(), expected[name].detach())
        assert done[id(dtensors[name])] is param
    assert [param.requires_grad for param in params.values()] == [True, False, True, True]
    assert model.scale is not None and torch.equal(model.scale, torch.tensor([1.0, 2.0, 3.0]))
    for sub in (model, model.embed, model.head):
        assert done[id(sub)] is sub
        assert [key for key in vars(sub) if key.startswith(unshard.STATE_KEY) or key in unshard.FSDP_FLAGS] == []
        assert _hooks(sub) == {table: {} for table in unshard.HOOK_TABLES + unshard.HOOK_FLAGS}
    x = torch.randn(2, 4)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    again = pickle.loads(pickle.dumps(model))  # noqa: S301 - our own pickle: nothing of the process group is left in it
    assert type(again) is Net and torch.equal(again.head.weight, reference.head.weight)


def test_only_sharding_hooks_go_the_persons_own_and_their_flags_stay(mesh):
    model, _ = _sharded(mesh)
    calls: list[str] = []

    def before(module, args, kwargs):
        calls.append("before")

    def after(module, args, output):
        calls.append("after")

    def loaded(module, keys):
        calls.append("loaded")

    def loading(module, *args):
        calls.append("loading")

    _backward(model)
    pre = model.register_forward_pre_hook(before, with_kwargs=True)
    post = model.register_forward_hook(after, always_call=True)
    load = model.embed.register_load_state_dict_post_hook(loaded)
    wrapped = model.embed.register_load_state_dict_pre_hook(loading)  # in nn.Module's _WrappedHook, as FSDP2's is
    assert len(model._forward_pre_hooks) == 2 and len(model.embed._load_state_dict_post_hooks) == 3
    assert len(model.embed._load_state_dict_pre_hooks) == 2
    make_plain(model, _gathered, {})
    assert dict(model._forward_pre_hooks) == {pre.id: before}
    assert dict(model._forward_pre_hooks_with_kwargs) == {pre.id: True}
    assert dict(model._forward_hooks) == {post.id: after}
    assert dict(model._forward_hooks_always_called) == {post.id: True}
    assert dict(model.embed._load_state_dict_post_hooks) == {load.id: loaded}
    assert list(model.embed._load_state_dict_pre_hooks) == [wrapped.id]
    assert model.embed._load_state_dict_pre_hooks[wrapped.id].hook is loading
    assert dict(model.embed._forward_pre_hooks) == {} and dict(model.head._forward_pre_hooks) == {}
    assert dict(model.embed._state_dict_pre_hooks) == {} and dict(model.head._load_state_dict_pre_hooks) == {}
    calls.clear()
    with torch.no_grad():
        model(torch.randn(1, 4))
    model.embed.load_state_dict(model.embed.state_dict())
    assert calls == ["before", "after", "loading", "loaded"]


def test_checkpoint_wrappers_state_dict_hooks_stay(mesh):
    torch.manual_seed(0)
    model = torch.nn.Sequential(checkpoint_wrapper(torch.nn.Linear(4, 4)))
    fully_shard(model, mesh=mesh)
    wrapper = model[0]
    kept = {table: dict(getattr(wrapper, table)) for table in ("_state_dict_hooks", "_load_state_dict_pre_hooks")}
    assert all(len(hooks) == 1 for hooks in kept.values())
    make_plain(model, _gathered, {})
    assert type(model) is torch.nn.Sequential
    assert {table: dict(getattr(wrapper, table)) for table in kept} == kept
    assert list(model.state_dict()) == ["0.weight", "0.bias"]  # its hook still takes its own prefix off the keys


def _replicate_buffers(name, module, mesh):
    for key, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(key, torch.nn.Parameter(distribute_tensor(param.detach(), mesh, [Shard(0)])))
    for key, buffer in list(module.named_buffers(recurse=False)):
        setattr(module, key, distribute_tensor(buffer, mesh, [Replicate()]))


def _inputs(module, inputs, mesh):
    return inputs


def _outputs(module, outputs, mesh):
    return outputs


def test_tensor_parallels_hooks_go_and_a_dtensor_buffer_becomes_its_whole_tensor(mesh):
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 2)
    layer.register_buffer("seen", torch.arange(4.0))
    weight = layer.weight.detach().clone()
    distribute_module(layer, mesh, _replicate_buffers, input_fn=_inputs, output_fn=_outputs)
    assert isinstance(layer.seen, DTensor) and isinstance(layer.weight, DTensor)
    assert len(layer._forward_pre_hooks) == 1 and len(layer._forward_hooks) == 1
    done: dict = {}
    make_plain(layer, _gathered, done)
    assert dict(layer._forward_pre_hooks) == {} and dict(layer._forward_hooks) == {}
    assert type(layer.seen) is torch.Tensor and torch.equal(layer.seen, torch.arange(4.0))
    assert type(layer.weight) is torch.nn.Parameter and torch.equal(layer.weight.detach(), weight)
    assert list(layer.state_dict()) == ["weight", "bias", "seen"]


def test_oversized_is_a_tensor_whose_storage_holds_more_than_its_own_bytes():
    base = torch.arange(12.0)
    assert not oversized(base) and not oversized(base.view(3, 4)) and not oversized(torch.empty(0))
    assert oversized(base[2:6])  # a view into a larger buffer
    assert oversized(base.view(3, 4).t())  # all the storage, but not contiguous
    assert oversized(base.view(3, 4)[:, :2])


def test_a_parameter_viewing_a_larger_buffer_becomes_a_compact_copy_and_a_tied_one_stays_one():
    flat = torch.arange(20.0)  # as FSDP's unsharded parameters after a forward with no backward
    tied = torch.nn.Parameter(flat[4:12].view(2, 4))
    first, second, own = (torch.nn.Linear(4, 2, bias=False) for _ in range(3))
    first.weight = second.weight = tied
    model = torch.nn.Sequential(first, second, own)
    own_weight = own.weight

    def never(dtensor):
        raise AssertionError("no DTensor here")

    done: dict = {}
    make_plain(model, never, done)
    assert first.weight is second.weight and type(first.weight) is torch.nn.Parameter
    assert first.weight.untyped_storage().nbytes() == 8 * 4
    assert first.weight.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()
    assert torch.equal(first.weight.detach(), torch.arange(4.0, 12.0).view(2, 4)) and first.weight.requires_grad
    assert done[id(tied)] is first.weight
    assert own.weight is own_weight  # its own bytes only: it stays itself


def test_a_parameter_and_its_state_dict_entry_are_one_tensor_and_other_views_are_not(mesh):
    model, _ = _sharded(mesh)
    state = model.state_dict()
    weight = model.head.weight
    assert state["head.weight"] is not weight
    assert tensor_key(state["head.weight"]) == tensor_key(weight)
    local = weight.to_local()
    assert tensor_key(weight) == ("cpu", local.untyped_storage().data_ptr(), local.storage_offset(), (3, 6), (6, 1),
                                  (3, 6), "(Shard(dim=0),)")
    assert tensor_key(model.head.bias) != tensor_key(weight)
    rows = DTensor.from_local(local[1:], mesh, [Shard(0)])  # the same storage, another view
    assert tensor_key(rows)[2:4] == (6, (2, 6)) and tensor_key(rows) != tensor_key(weight)
    replicated = DTensor.from_local(local, mesh, [Replicate()])  # the same view, placed otherwise
    assert tensor_key(replicated) == tensor_key(weight)[:-1] + ("(Replicate(),)",)


def test_a_dtensor_with_no_memory_of_its_own_is_only_itself(mesh):
    empty = distribute_tensor(torch.empty(0), mesh, [Shard(0)])
    meta = DTensor.from_local(torch.empty(4, device="meta"), mesh, [Shard(0)])
    assert tensor_key(empty) == id(empty) and tensor_key(meta) == id(meta)


def test_a_shallow_tree_is_new_module_objects_over_the_same_tensors(mesh):
    model, _ = _sharded(mesh)
    hooks = _hooks(model)
    clones: dict = {}
    clone = shallow_tree(model, clones)
    assert type(clone) is Net and type(clone.embed) is torch.nn.Linear and type(clone.head) is torch.nn.Linear
    assert clones == {id(model): clone, id(model.embed): clone.embed, id(model.head): clone.head}
    assert clone is not model and clone.embed is not model.embed and clone.head is not model.head
    assert clone.embed.weight is model.embed.weight and clone.scale is model.scale
    assert shallow_tree(model, clones) is clone and shallow_tree(model.head, clones) is clone.head
    clone._forward_pre_hooks.clear()
    clone.head.weight = torch.nn.Parameter(torch.zeros(3, 6))
    clone.register_buffer("extra", torch.ones(1))
    assert _hooks(model) == hooks and isinstance(model.head.weight, DTensor) and "extra" not in model._buffers


def test_rebuild_replaces_dtensors_in_place_in_dicts_and_lists_and_makes_a_tuple_anew(mesh):
    table = distribute_tensor(torch.arange(6.0).view(2, 3), mesh, [Shard(0)])
    frozen = torch.nn.Parameter(distribute_tensor(torch.ones(2), mesh, [Shard(0)]), requires_grad=False)
    whole = {tensor_key(table): torch.arange(6.0).view(2, 3), tensor_key(frozen): torch.ones(2)}
    nested, plain = [table, 3, "s", None], (1, "a")
    value = {"table": table, "nested": nested, "pair": (frozen, 1.5), "plain": plain}
    rebuild = Rebuild(whole)
    assert rebuild(value) is value and value["nested"] is nested and value["plain"] is plain
    assert value["table"] is whole[tensor_key(table)] and nested == [whole[tensor_key(table)], 3, "s", None]
    param, number = value["pair"]
    assert type(param) is torch.nn.Parameter and not param.requires_grad and number == 1.5
    assert param.untyped_storage().data_ptr() == whole[tensor_key(frozen)].untyped_storage().data_ptr()
    assert rebuild(table) is value["table"] and rebuild(frozen) is param  # each made whole once
    assert rebuild(7) == 7 and rebuild("x") == "x"


def test_a_list_that_holds_itself_is_rebuilt_once(mesh):
    table = distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])
    whole = {tensor_key(table): torch.arange(4.0)}
    loop: list = [table]
    loop.append(loop)
    kept = Rebuild(whole, in_place=False)(loop)
    assert kept is not loop and kept[0] is whole[tensor_key(table)] and kept[1] is kept
    assert loop[0] is table and loop[1] is loop  # kept ranks keep their own
    assert Rebuild(whole)(loop) is loop and loop[0] is whole[tensor_key(table)] and loop[1] is loop


def test_a_model_and_its_state_dict_come_back_sharing_their_whole_tensors(mesh):
    model, reference = _sharded(mesh)
    state = model.state_dict()
    scale = state["scale"]  # FSDP2 leaves buffers whole
    whole = {tensor_key(param): _gathered(param) for param in model.parameters()}
    keys = {name: tensor_key(param) for name, param in model.named_parameters()}
    rebuild = Rebuild(whole)
    pair = (model, state)
    assert rebuild(pair) is pair  # both made plain in place: nothing new to hold
    assert type(model) is Net and rebuild(model) is model and rebuild({"again": model})["again"] is model
    assert state["scale"] is scale
    for name, param in model.named_parameters():
        assert state[name] is whole[keys[name]]
        assert param.untyped_storage().data_ptr() == state[name].untyped_storage().data_ptr()
        assert torch.equal(state[name], dict(reference.named_parameters())[name].detach())


def test_kept_ranks_get_new_objects_and_go_on_with_their_sharded_model(mesh):
    model, reference = _sharded(mesh)
    _backward(model)
    state = model.state_dict()
    hooks = _hooks(model)
    whole = {tensor_key(param): _gathered(param) for param in model.parameters()}
    rebuild = Rebuild(whole, in_place=False)
    plain, plain_state = rebuild(model), rebuild(state)
    assert type(plain) is Net and plain is not model and rebuild(model) is plain and rebuild(model.head) is plain.head
    assert plain_state is not state and sorted(plain_state) == sorted(state)
    assert all(type(param) is torch.nn.Parameter for param in plain.parameters())
    assert plain_state["head.weight"].untyped_storage().data_ptr() == plain.head.weight.untyped_storage().data_ptr()
    assert _hooks(plain) == {table: {} for table in unshard.HOOK_TABLES + unshard.HOOK_FLAGS}
    # rank 0's own: still FSDP's, still sharded, still training
    assert type(model).__name__ == "FSDPNet" and _hooks(model) == hooks
    assert all(isinstance(param, DTensor) for param in model.parameters()) and isinstance(state["head.weight"], DTensor)
    x = torch.randn(2, 4)
    with torch.no_grad():
        expected = reference(x)
        assert torch.equal(plain(x), expected) and torch.equal(model(x), expected)

"""dedicate() on one process: what it selects, names and hooks, and its errors.

The multi-rank behaviour (owners, reductions, broadcasts, FSDP2, HSDP) is tested
against one process in tests-integration/."""

import pytest
import torch
from torch import nn

from dmuon.integrations import Dedication, ddp, fsdp, mesh_groups, module_of_layer, split_parameters
from dmuon.optim import DMuon, param_groups


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 16)

    def forward(self, idx):
        h = self.emb(idx)
        for b in self.blocks:
            h = torch.tanh(b(h))
        h = self.conv(h.transpose(1, 2)).transpose(1, 2)
        return self.head(self.norm(h))


def test_the_default_choice_is_param_groups_matrices_with_conv_flattened():
    dedicated, rest = split_parameters(Net())
    assert [(i.name, i.shape, i.layer) for i, _ in dedicated] == [
        ("blocks.0.weight", (8, 8), "blocks.0"),
        ("blocks.1.weight", (8, 8), "blocks.1"),
        ("conv.weight", (8, 24), "conv"),
    ]
    assert [n for n, _, _ in rest] == [
        "emb.weight",
        "blocks.0.bias",
        "blocks.1.bias",
        "conv.bias",
        "norm.weight",
        "norm.bias",
        "head.weight",
        "head.bias",
    ]


def test_a_predicate_chooses_and_frozen_parameters_are_left_out():
    net = Net()
    net.blocks[1].weight.requires_grad_(False)
    dedicated, rest = split_parameters(net, lambda n, p: n.startswith("blocks"))
    assert [i.name for i, _ in dedicated] == ["blocks.0.weight", "blocks.0.bias", "blocks.1.bias"]
    assert "blocks.1.weight" not in [n for n, _, _ in rest]


def test_ddp_dedicate_names_owners_all_reduced_and_hooks():
    net = Net()
    ded = ddp.dedicate(net)
    assert isinstance(ded, Dedication) and ded.kind == "ddp"
    assert ded.names == ("blocks.0.weight", "blocks.1.weight", "conv.weight")
    assert ded.owned == ded.names and ded.rank == 0 and ded.owner_of("conv.weight") == 0
    assert "head.weight" in ded.all_reduced
    assert ded.params == {net.blocks[0].weight, net.blocks[1].weight, net.conv.weight}
    # a forward pre-hook per layer (its module; the small layers are packed, each
    # member keeps its hook) + a state-dict pre-hook that waits for broadcasts, on the
    # model and on each module holding a dedicated weight + a load-state-dict pre-hook on
    # those and on every module above one (a load refused there changes nothing below)
    layers = sum(len(ded.exchange.layer(k).members) for k in ded.exchange.layer_keys())
    assert layers == 6  # blocks.0, blocks.1, conv, emb, head, norm
    holders = {n.rpartition(".")[0] for n in ded.names} | {""}
    assert len(holders) == 4  # blocks.0, blocks.1, conv, the model
    above = holders | {"blocks"}
    assert len(ded.handles) == 3 + len(ded.all_reduced) + layers + len(holders) + len(above)
    assert "blocks.0" in ded.summary() and "Dedication(kind='ddp'" in repr(ded)
    ded.remove()
    assert ded.handles == []


def test_training_with_a_dedication_on_one_process_equals_plain_dmuon():
    idx = torch.randint(0, 16, (4, 5), generator=torch.Generator().manual_seed(1))
    kw = dict(ns_compute_dtype="float32", weight_decay=0.1)
    results = []
    for dedicate in (None, fsdp.dedicate, ddp.dedicate):
        net = Net()
        ded = dedicate(net) if dedicate else None
        opt = DMuon(param_groups(net), distributed=ded, **kw)
        for _ in range(3):
            net(idx).square().mean().backward()
            opt.step()
            opt.zero_grad()
        assert opt.mode == ("owner" if ded else "single")
        results.append([p.detach().clone() for p in net.parameters()])
    for other in results[1:]:
        for p, q in zip(results[0], other, strict=True):
            assert torch.equal(p, q)


def test_no_sync_skips_the_reductions_and_the_optimizer_sees_the_sum():
    idx = torch.randint(0, 16, (4, 5), generator=torch.Generator().manual_seed(1))
    net = Net()
    ded = fsdp.dedicate(net)
    with ded.no_sync():
        net(idx).sum().backward()
    assert ded.exchange.reduction.next_launch == 0  # nothing launched
    net(idx).sum().backward()
    assert ded.exchange.reduction.next_launch == len(ded.exchange.layer_keys())


def test_the_parameters_become_views_of_the_broadcast_buffers():
    net = Net()
    before = net.blocks[0].weight.detach().clone()
    ded = fsdp.dedicate(net)
    layer = ded.exchange.layer("blocks.0")
    (bucket,) = layer.publish_buckets
    assert net.blocks[0].weight.data_ptr() == bucket.view("blocks.0.weight").data_ptr()
    assert torch.equal(net.blocks[0].weight.detach(), before)


def test_layer_modules_and_meshes():
    net = Net()
    assert module_of_layer(net, "blocks.1") is net.blocks[1]
    assert module_of_layer(net, "nothing.here") is net
    assert mesh_groups(None) == (None, None)
    with pytest.raises(ValueError, match="DeviceMesh"):
        mesh_groups("world")


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="scalars"):
        ddp.dedicate(Net(), scalars="sharded")
    with pytest.raises(ValueError, match="no parameter to dedicate"):
        fsdp.dedicate(nn.Sequential(nn.LayerNorm(4)))
    net = Net()
    fsdp.dedicate(net)
    with pytest.raises(ValueError, match="dedicated twice"):
        fsdp.dedicate(net)

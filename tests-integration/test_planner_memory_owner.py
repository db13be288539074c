"""The planner's optimizer state for owner mode equals what DMuon holds, per scalar layout.

``dmuon.optim.planner.memory.memory_per_rank(..., mode="owner", scalars=...)`` against
the bytes of the tensors in ``DMuon.state`` on real gloo ranks after a step (each storage
once, the scalar optimizer's ``step`` counters left out: they are not modelled), for
``ddp.dedicate``'s two scalar layouts: all-reduced (every rank steps every scalar) and
``scalars="owner"`` (whole scalar tensors planned with the matrices), and for
``fsdp.dedicate`` (FSDP2 shards the scalars). At 3 ranks only ``scalars="owner"``
(where owning whole tensors is uneven): FSDP2 gives the busiest rank ``⌈rows/N⌉`` rows
of each scalar tensor, which the model's ``Φ_S/N`` leaves out (40 of 25 896 bytes here).
"""

import torch
from torch import nn

from dmuon.comm.testing import run_on_ranks

SETUPS = ("ddp", "ddp_owner", "fsdp")


class Model(nn.Module):
    """Scalar tensors of unequal sizes (embedding, norms, biases, head) around hidden
    matrices of two shapes, so that owning whole scalar tensors is uneven."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(48, 32)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {"norm": nn.LayerNorm(32), "up": nn.Linear(32, 64), "down": nn.Linear(64, 32)}
            )
            for _ in range(3)
        )
        self.head = nn.Linear(32, 48, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for b in self.blocks:
            h = h + b["down"](torch.relu(b["up"](b["norm"](h))))
        return self.head(h)


def state_bytes(opt: torch.optim.Optimizer) -> int:
    seen: set[int] = set()
    total = 0
    for st in opt.state.values():
        for key, value in st.items():
            if key == "step" or not isinstance(value, torch.Tensor) or value.numel() == 0:
                continue
            t = value.to_local() if hasattr(value, "to_local") else value
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def run(rank: int, world: int, setups: tuple[str, ...]) -> dict[str, tuple[float, int]]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dmuon.integrations import ddp, fsdp
    from dmuon.optim import DMuon, param_groups
    from dmuon.optim.planner.config import spec_from_module
    from dmuon.optim.planner.memory import memory_per_rank

    out = {}
    for setup in setups:
        model = Model()
        spec = spec_from_module(model)
        if setup == "fsdp":
            mesh = init_device_mesh("cpu", (world,))
            ded = fsdp.dedicate(model, mesh)
            fully_shard(model, mesh=mesh, ignored_params=ded.params)
        else:
            ded = ddp.dedicate(model, scalars="owner" if setup == "ddp_owner" else "all_reduce")
        opt = DMuon(param_groups(model), distributed=ded, lr=0.01)
        g = torch.Generator().manual_seed(rank)
        x = torch.randint(0, 48, (4, 8), generator=g)
        model(x).float().pow(2).mean().backward()
        opt.step()
        held = torch.tensor([state_bytes(opt)])
        dist.all_reduce(held, op=dist.ReduceOp.MAX)
        scalars = {"ddp": "all_reduce", "ddp_owner": "owner", "fsdp": "sharded"}[setup]
        predicted = memory_per_rank(spec, ded.exchange.plan, "owner", scalars=scalars)
        out[setup] = (predicted["optimizer_state"], int(held))
        ded.remove()
    return out


def test_owner_mode_state_equals_the_planners_for_each_scalar_layout():
    for world, setups in ((2, SETUPS), (3, ("ddp_owner",))):
        results = run_on_ranks(run, world, args=(setups,), timeout=120)
        assert all(r == results[0] for r in results)
        for setup, (predicted, measured) in results[0].items():
            assert predicted == measured, (world, setup, predicted, measured)

"""How DMuon learns its mode, what its state dict holds, and what a step reports — on
two real ranks."""

from distributed_cases import OPT, batch, build, loss_of

from dmuon.comm.testing import run_on_ranks
from dmuon.optim import DMuon, StepReport, param_groups
from dmuon.optim.engine import PHASES


def run_detection(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dmuon.integrations import ddp

    errors = {}

    def error(fn):
        try:
            fn()
        except (ValueError, TypeError) as err:
            return str(err)
        return None

    model = build("gpt")
    errors["no mode"] = error(lambda: DMuon(param_groups(model)))
    errors["owner without dedication"] = error(lambda: DMuon(param_groups(model), mode="owner"))
    errors["sign with muon"] = error(lambda: DMuon(param_groups(model), mode="sign"))
    errors["bad distributed"] = error(lambda: DMuon(param_groups(model), distributed=object()))
    modes = {"explicit replicated": DMuon(param_groups(model), mode="replicated").mode}
    sharded = build("gpt")
    mesh = init_device_mesh("cpu", (world,))
    for block in sharded.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    modes["FSDP2 DTensors"] = DMuon(param_groups(sharded)).mode
    errors["DTensors as replicated"] = error(
        lambda: DMuon(param_groups(sharded), mode="replicated")
    )
    dedicated = build("gpt")
    ded = ddp.dedicate(dedicated)
    modes["dedicated, found from the parameters"] = DMuon(param_groups(dedicated)).mode
    errors["dedicated but replicated asked"] = error(
        lambda: DMuon(param_groups(dedicated), mode="replicated")
    )
    assert ded.rank == rank
    return errors, modes


def test_the_mode_is_detected_where_unambiguous_and_asked_for_otherwise():
    for errors, modes in run_on_ranks(run_detection, 2, timeout=120):
        assert "mode='replicated'" in errors["no mode"]
        assert "dedicate" in errors["owner without dedication"]
        assert "sign_muon" in errors["sign with muon"]
        assert "distributed=" in errors["bad distributed"]
        assert "blocks.0.attn.qkv.weight" in errors["DTensors as replicated"]
        assert "owner mode" in errors["dedicated but replicated asked"]
        assert modes == {
            "explicit replicated": "replicated",
            "FSDP2 DTensors": "sharded",
            "dedicated, found from the parameters": "owner",
        }


def run_state(rank, world):
    from dmuon.integrations import ddp

    model = build("gpt")
    ded = ddp.dedicate(model)
    opt = DMuon(param_groups(model), distributed=ded, **OPT)
    loss_of("gpt", model, *batch("gpt", 0, rank, world)).backward()
    opt.step()
    opt.zero_grad()
    ded.wait()
    sd = opt.state_dict()
    names = {
        i: n for g in sd["param_groups"] for i, n in zip(g["params"], g["param_names"], strict=True)
    }
    state = {
        names[i]: {k: (tuple(v.shape), v.numel()) for k, v in s.items()}
        for i, s in sd["state"].items()
    }
    opt.load_state_dict(sd)  # a round trip in owner mode
    report = opt.last_step
    assert isinstance(report, StepReport)
    return state, sd["distributed"], sorted(ded.owned), report.as_dict()


def test_state_dicts_have_the_same_keys_on_every_rank_and_owners_hold_the_values():
    out = run_on_ranks(run_state, 2, timeout=120)
    (s0, d0, _, _), (s1, d1, _, _) = out
    assert d0["owners"] == d1["owners"] and d0["plan_digest"] == d1["plan_digest"]
    assert {k: set(v) for k, v in s0.items()} == {k: set(v) for k, v in s1.items()}
    for rank, (state, info, owned, report) in enumerate(out):
        assert info["mode"] == "owner" and info["rank"] == rank
        for name, keys in state.items():
            if name not in info["owners"]:
                continue
            mine = info["owners"][name] == rank
            assert (name in owned) == mine
            full = keys["momentum_buffer"][1] > 0
            assert full == mine, f"rank {rank}: {name} momentum {'missing' if mine else 'held'}"
        assert report["mode"] == "owner" and report["world_size"] == 2
        assert set(report["seconds"]) <= {*PHASES, "total"}
        assert sorted(report["stepped"]) == owned
        # layers blocks.0, blocks.1 and the all-reduced lm_head, norm_f, tok_emb: small,
        # so one pack (layer_pack_mb)
        assert report["groups"] == 1


def test_a_single_process_reports_its_step():
    model = build("mixed")
    opt = DMuon(param_groups(model), **OPT)
    loss_of("mixed", model, *batch("mixed", 0)).backward()
    opt.step()
    report = opt.last_step
    assert report.mode == "single" and report.world_size == 1
    assert report.matrices == 1 + 2 * (3 + 2)  # conv, and per block 3 experts, up, down
    assert report.seconds["total"] >= report.seconds["rule"] > 0

"""DMuon in the Hugging Face Trainer: one process and torchrun with two gloo ranks.

Each launch runs the guide's script (``examples/hf_trainer.py``) several times in one
process through ``hf_trainer_check.py`` — transformers is imported once per launch —
with a real ``transformers.Trainer`` on a tiny Llama built from a config (no
download): six optimizer steps of two accumulated micro-batches each, a cosine
schedule with warmup, gradient clipping, checkpoints at steps 3 and 6. The
references are computed another way: the resumed run is compared with the
uninterrupted one, the stock Trainer with DMuonTrainer, the gathered optimizer state
with a single process's, two ranks with one process over the same global batch.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest

# The Trainer tests need the [hf] extra (the nox integration session installs it); the
# state-gathering test at the end needs torch only.
needs_hf = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("transformers", "accelerate")),
    reason="needs transformers and accelerate: pip install 'dmuon-optim[hf]'",
)

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
EXAMPLE = ROOT / "examples" / "hf_trainer.py"  # the guide's script
# A cold import of transformers takes tens of seconds on a loaded 2-core machine; the
# training itself takes a few. The timeouts only stop a hang.
TIMEOUT_S = 420


def _launch(cmd: list[str], out: pathlib.Path) -> list[dict]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(EXAMPLE.parent), env.get("PYTHONPATH", "")])
    # A session of its own, so a timeout stops torchrun and every rank it started.
    proc = subprocess.Popen(
        cmd,
        cwd=out,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        log, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"{cmd} did not finish in {TIMEOUT_S} s:\n{log[-6000:]}")
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{log[-6000:]}"
    results = sorted(out.glob("result-*.json"))
    return [json.loads(p.read_text()) for p in results]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_single")
    (result,) = _launch([sys.executable, str(HERE / "hf_trainer_check.py"), str(out)], out)
    return result


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_ddp")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    results = _launch([*cmd, str(HERE / "hf_trainer_check.py"), str(out)], out)
    assert [r["rank"] for r in results] == [0, 1]
    return results


def _decreases(losses: list[float]) -> bool:
    # The first loss is about ln(128) ≈ 4.85 (uniform prediction); six steps bring the
    # mean of the last two down by about 0.3 (observed 0.33 and 0.41). A step that did
    # nothing, or diverged, would not clear 0.1.
    return sum(losses[-2:]) / 2 < losses[0] - 0.1


def _assert_same_run(resumed: list[float], full: list[float], weights_max_diff: float) -> None:
    # The resumed run replays the same operations on the same values (observed: bitwise
    # equal). A momentum restarted from zero moves the weights by about lr·0.2 = 2e-3.
    assert len(resumed) == len(full) == 6
    assert resumed == pytest.approx(full, rel=1e-6, abs=0)
    assert weights_max_diff <= 1e-6


@needs_hf
def test_single_process_trains_and_loss_decreases(single):
    assert single["mode"] == "single"
    assert _decreases(single["full"]), single["full"]


@needs_hf
def test_single_process_resume_continues_identically(single):
    _assert_same_run(single["resumed"], single["full"], single["weights_max_diff"])
    assert single["full_missing"] == []


@needs_hf
def test_stock_trainer_with_the_factory_matches_dmuon_trainer(single):
    # Trainer(optimizer_cls_and_kwargs=optimizer_cls_and_kwargs(args)) builds the same
    # optimizer as DMuonTrainer: the same first three losses, a complete checkpoint.
    assert single["stock"] == pytest.approx(single["full"][:3], rel=1e-6, abs=0)
    assert single["stock_missing"] == []


@needs_hf
def test_torchrun_two_ranks_trains_in_replicated_mode(ddp):
    for r in ddp:
        assert r["world_size"] == 2 and r["mode"] == "replicated"
        assert _decreases(r["full"]), r["full"]
    assert ddp[0]["full"] == ddp[1]["full"]  # Trainer logs the loss averaged over ranks


@needs_hf
def test_torchrun_resume_continues_identically(ddp):
    for r in ddp:
        _assert_same_run(r["resumed"], r["full"], r["weights_max_diff"])


@needs_hf
def test_torchrun_checkpoint_holds_every_owners_momentum(ddp):
    r = ddp[0]
    # Both ranks own matrices, so rank 0 alone cannot have written the whole state ...
    assert set(r["owners"].values()) == {0, 1}
    # ... and yet optimizer.pt (written by rank 0) has no placeholder, and the momentum
    # of every matrix, rank 1's included, is there and not zero.
    assert r["full_missing"] == []
    assert set(r["momentum_norms"]) == set(r["owners"])
    assert all(n > 0 for n in r["momentum_norms"].values()), r["momentum_norms"]


@needs_hf
def test_stock_trainer_checkpoint_under_torchrun_is_refused_on_every_rank(ddp):
    # The failure DMuonTrainer exists for: a stock Trainer writes rank 0's share only.
    owners = ddp[0]["owners"]
    lost = sorted(f"{n}/momentum_buffer" for n, o in owners.items() if o == 1)
    assert sorted(ddp[0]["stock_missing"]) == lost
    assert ddp[0]["stock"] == pytest.approx(ddp[0]["full"][:3], rel=1e-6, abs=0)
    for r in ddp:  # resuming from it raises on both ranks (none is left waiting)
        assert r["refused"] is not None and "lacks 7 entries" in r["refused"], r["refused"]
        assert "DMuonTrainer" in r["refused"]


@needs_hf
def test_accumulation_and_clipping_two_ranks_equal_one_process(single, ddp):
    """Two ranks × 2 sequences × 2 micro-batches and one process × 4 × 2 see the same 8
    sequences per step: DMuon steps once per accumulation boundary, and Trainer's
    clipping (active at every step) acts on the all-reduced gradients, so the weights agree.
    Observed: 1.4e-7 at most (fp32, sums in another order). A DMuon step per micro-batch
    on two ranks (6 steps of 4 sequences) is off by 3.5e-2; the same run unclipped by 1e-3."""
    from safetensors.torch import load_file

    one, two = single["global"], ddp[0]["global"]
    assert one["steps"] == two["steps"] == ddp[1]["global"]["steps"] == 3
    assert min(one["grad_norms"]) > 0.5  # above max_grad_norm=0.05: every step clipped
    assert two["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-5)
    a, b = load_file(one["weights"]), load_file(two["weights"])
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    assert diff <= 2e-6, diff


def _tiny_llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2)  # fmt: skip
    return LlamaForCausalLM(config)


@needs_hf
def test_optim_args_configure_dmuon(tmp_path):
    """``TrainingArguments(optim_args=...)`` — ``--optim_args`` on a command line parsed by
    ``HfArgumentParser`` — reaches DMuon in DMuonTrainer and in the stock Trainer's factory
    (before, it was silently ignored: momentum 0.95, 5 steps, betas from adam_beta*).
    It wins over the mapped arguments; ``dmuon_options`` / the factory's keywords win over it."""
    import torch
    from transformers import Trainer, TrainingArguments

    from dmuon.integrations.hf import DMuonTrainer, optimizer_cls_and_kwargs

    args = TrainingArguments(
        str(tmp_path), learning_rate=1e-2, adam_beta1=0.9, adam_beta2=0.95, use_cpu=True,
        report_to=[], disable_tqdm=True,
        optim_args="momentum=0.8, ns_steps=3, nesterov=False, adamw_betas=(0.8, 0.99), "
                   "adamw_lr=1e-3, ns_compute_dtype=float32",
    )  # fmt: skip
    dmuon = DMuonTrainer(model=_tiny_llama(), args=args, dmuon_options={"ns_steps": 4})
    factory = optimizer_cls_and_kwargs(args, ns_steps=4)
    stock = Trainer(model=_tiny_llama(), args=args, optimizer_cls_and_kwargs=factory)
    for trainer in (dmuon, stock):
        matrix, scalar = trainer.create_optimizer().param_groups[:2]
        assert (matrix["momentum"], matrix["ns_steps"], matrix["nesterov"]) == (0.8, 4, False)
        assert matrix["ns_compute_dtype"] in ("float32", torch.float32)
        assert (matrix["lr"], scalar["lr"], tuple(scalar["betas"])) == (1e-2, 1e-3, (0.8, 0.99))
    # a misspelt name is refused, as DMuon(momentun=...) is; a malformed item is named
    for text, match in (("momentun=0.8", "momentun"), ("momentum", "'momentum'.*name=value")):
        args.optim_args = text
        with pytest.raises(ValueError, match=match):
            DMuonTrainer(model=_tiny_llama(), args=args).create_optimizer()


@needs_hf
def test_optim_args_read_as_python_keywords():
    """``optim_args`` is read by Python's parser as a call's keywords: commas inside
    quotes and brackets stay in their value, a bare or dotted word arrives as written,
    and a name given twice or an unbalanced bracket is refused, naming the text (before,
    a repeated name silently took the last value and ``momentum=0.8)`` reached DMuon as
    the string ``'0.8)'``)."""
    from dmuon.integrations.hf.factory import _parse_optim_args

    text = "a='x, y', b=[1, (2, 3)], ns_compute_dtype=torch.float32, rule=sign-muon, lr=-1e-3,"
    assert _parse_optim_args(text) == {
        "a": "x, y", "b": [1, (2, 3)], "ns_compute_dtype": "torch.float32",
        "rule": "sign-muon", "lr": -1e-3,
    }  # fmt: skip
    for text, match in (
        ("momentum=0.8, momentum=0.9", "names 'momentum' twice"),
        ("momentum=0.8)", r"optim_args='momentum=0.8\)' is not name=value"),
        ("momentum=0.9, 3", "not name=value"),
        ("**extra", r"'\*\*extra' is not name=value"),
    ):
        with pytest.raises(ValueError, match=match):
            _parse_optim_args(text)


def test_guide_shows_the_script_the_tests_run():
    guide = (ROOT / "docs" / "guides" / "hf-trainer.md").read_text()
    script = EXAMPLE.read_text()
    assert f"```python\n{script}```" in guide, "docs/guides/hf-trainer.md must show the script"


# ---------------------------------------------------------------------------------------
# gather_full_state_dict on its own (no Trainer): 3 ranks (an odd world), replicated mode.

GATHER_STEPS, MORE_STEPS = 3, 2


def _blocks_model():
    import torch

    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(
        torch.nn.ModuleDict({"a": torch.nn.Linear(8, 16), "b": torch.nn.Linear(16, 8)})
        for _ in range(3)
    )
    return torch.nn.ModuleDict({"blocks": blocks, "norm": torch.nn.LayerNorm(8)})


def _grads(model, step):
    """The same 'all-reduced' gradients on every rank (replicated mode's input)."""
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def _optimizer(model, mode):
    from dmuon.optim import DMuon, param_groups

    return DMuon(param_groups(model), lr=0.02, mode=mode, ns_compute_dtype="float32")


def _train(model, opt, steps, first=0):
    for s in range(first, first + steps):
        _grads(model, s)
        opt.step()
        opt.zero_grad()


def _gather_at_3(rank, world):
    from dmuon.integrations.hf import gather_full_state_dict, missing_state

    model = _blocks_model()
    opt = _optimizer(model, "replicated")
    _train(model, opt, GATHER_STEPS)
    local = opt.state_dict()
    local_missing = missing_state(local)
    local = {
        **local,
        "state": {i: {k: v.clone() for k, v in st.items()} for i, st in local["state"].items()},
    }
    full = gather_full_state_dict(opt)
    assert opt.state_dict()["state"].keys() == full["state"].keys()
    return {
        "full": full,
        "local": local,
        "local_missing": local_missing,
        "still_missing": missing_state(opt.state_dict()),  # the live state is unchanged
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }


def _resume(rank, world, full, params):
    model = _blocks_model()
    model.load_state_dict(params)
    opt = _optimizer(model, "replicated" if world > 1 else "single")
    opt.load_state_dict(full)
    _train(model, opt, MORE_STEPS, first=GATHER_STEPS)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_gather_full_state_dict_collects_every_owner_and_reloads_on_any_world():
    import torch

    from dmuon.comm.testing import run_on_ranks
    from dmuon.integrations.hf import missing_state

    # Reference: one process, the same gradients, all five steps.
    ref_model = _blocks_model()
    ref_opt = _optimizer(ref_model, "single")
    _train(ref_model, ref_opt, GATHER_STEPS)
    # state_dict() hands out the live tensors: copy them before training on.
    ref_state = {
        i: {k: v.clone() for k, v in st.items()} for i, st in ref_opt.state_dict()["state"].items()
    }
    _train(ref_model, ref_opt, MORE_STEPS, first=GATHER_STEPS)
    expected = ref_model.state_dict()

    out = run_on_ranks(_gather_at_3, 3, timeout=120)
    owners = out[0]["full"]["distributed"]["owners"]
    assert set(owners.values()) == {0, 1, 2}  # every rank owns matrices
    for r in out:
        assert r["local_missing"] and r["still_missing"] == r["local_missing"]
        assert missing_state(r["full"]) == []
        # The gathered state is every owner's, and the single process's: replicated runs
        # the same rule on the same gradients (fp32 Newton–Schulz; the batches differ
        # only in how same-shape matrices are stacked).
        for idx, st in r["full"]["state"].items():
            for key, value in st.items():
                torch.testing.assert_close(value, ref_state[idx][key], rtol=0, atol=1e-6)
    # The full state loads on 2 ranks (another owner plan) and on 1, and training
    # continues as if it had never stopped.
    full, params = out[0]["full"], out[0]["params"]
    moved = max((expected[k] - params[k]).abs().max().item() for k in expected)
    assert moved > 1e-2, "the last steps barely moved the weights: the check would prove nothing"
    for world in (2, 1):
        resumed = run_on_ranks(_resume, world, args=(full, params), timeout=120)
        for rank_params in resumed:
            for k, v in expected.items():
                torch.testing.assert_close(rank_params[k], v, rtol=0, atol=1e-5, msg=k)
    # The control: rank 0's own state dict (other owners' momentum as placeholders) is
    # refused in one process: loading it would restart that momentum from zero.
    with pytest.raises(ValueError, match="empty placeholder in this state dict, saved by rank 0"):
        _resume(0, 1, out[0]["local"], params)


def _gather_bf16_state(rank, world):
    from dmuon.integrations.hf import gather_full_state_dict
    from dmuon.optim import DMuon, param_groups

    model = _blocks_model()
    opt = DMuon(param_groups(model), lr=0.02, mode="replicated", ns_compute_dtype="float32",
                state_dtype="bfloat16")  # fmt: skip
    _train(model, opt, GATHER_STEPS)
    return gather_full_state_dict(opt)["state"]


def test_gather_full_state_dict_keeps_the_state_dtype():
    """bf16 matrix state (state_dtype="bfloat16" on fp32 weights) is gathered as bf16,
    equal to one process's, not widened to the weights' dtype."""
    import torch

    from dmuon.comm.testing import run_on_ranks
    from dmuon.optim import DMuon, param_groups

    model = _blocks_model()
    ref = DMuon(param_groups(model), lr=0.02, ns_compute_dtype="float32", state_dtype="bfloat16")
    _train(model, ref, GATHER_STEPS)
    ref_state = ref.state_dict()["state"]
    out = run_on_ranks(_gather_bf16_state, 2, timeout=120)
    for state in out:
        bf16 = 0
        for idx, st in state.items():
            for key, value in st.items():
                want = ref_state[idx][key]
                assert value.dtype == want.dtype, (idx, key, value.dtype, want.dtype)
                bf16 += value.dtype == torch.bfloat16
                torch.testing.assert_close(value, want, rtol=8e-3, atol=1e-6)
        assert bf16 == 6  # the six matrices' momentum


def _gather_fp16_second_moments(rank, world):
    import torch

    from dmuon.integrations.hf import gather_full_state_dict
    from dmuon.optim import DMuon

    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(8, 8).half()) for _ in range(2)]
    opt = DMuon([{"params": ps, "rule": "adamuon"}], mode="replicated")
    for p in ps:
        p.grad = torch.full_like(p, 1e-4)
    opt.step()
    return gather_full_state_dict(opt)["state"]


def test_gather_full_state_dict_keeps_fp32_second_moments_of_fp16_weights():
    """A second moment of fp16 weights lives in fp32 (``StateSpec.squares``); the gathered
    dict keeps it so on every rank, owner included (it was cast to fp16 there: the
    underflow the fp32 state avoids, back in the checkpoint)."""
    import torch

    from dmuon.comm.testing import run_on_ranks

    for rank, state in enumerate(run_on_ranks(_gather_fp16_second_moments, 2, timeout=120)):
        for idx, st in state.items():
            assert st["second_moment"].dtype == torch.float32, (rank, idx)
            assert st["momentum_buffer"].dtype == torch.float16, (rank, idx)

"""Exact resume after a real crash (issue 8): a rank is SIGKILLed, torchrun restarts, the
run ends bitwise equal to an uninterrupted one.

The script is the one on docs/guides/checkpointing.md (DMuon in owner mode under
FSDP2, 2 gloo ranks, a DCP checkpoint every 2 steps). Under ``torchrun
--max_restarts 1`` its last rank kills itself with ``SIGKILL`` before step 5 (after
the checkpoint of step 4); torchrun's elastic agent restarts both ranks, which
resume from the newest complete checkpoint. Same world size, same plan, CPU: the
final weights must equal an uninterrupted run's bit for bit. Resharding (4 → 2
ranks) is tested in test_checkpoint_reshard.py.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

ROOT = pathlib.Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "guides" / "checkpointing.md"


def guide_script() -> str:
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)
    scripts = [b for b in blocks if b.startswith("# train_checkpointed.py")]
    assert len(scripts) == 1, "the guide's script (first line '# train_checkpointed.py')"
    return scripts[0]


def torchrun(script: pathlib.Path, out: pathlib.Path, *args: str, restarts: int = 0) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    if os.path.exists("/sys/class/net/lo"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env["PYTHONPATH"] = os.pathsep.join([*sys.path, env.get("PYTHONPATH", "")])
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", "--max_restarts", str(restarts), str(script), "--dir", str(out), *args]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stderr


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_killed_rank_resumes_bitwise_equal_to_an_uninterrupted_run(tmp_path):
    script = tmp_path / "train_checkpointed.py"
    script.write_text(guide_script())
    steps = ["--steps", "6", "--every", "2"]
    killed = torchrun(script, tmp_path / "killed", *steps, "--fail-at-step", "5", restarts=1)
    torchrun(script, tmp_path / "straight", *steps)

    events = (tmp_path / "killed" / "events.log").read_text().split("\n")
    assert events[:4] == ["checkpoint 2", "checkpoint 4", "resumed 4 world 2", "checkpoint 6"]
    assert "exitcode: -9" in killed, "no rank was killed: the test proves nothing"
    resumed = torch.load(tmp_path / "killed" / "final.pt", weights_only=True)
    straight = torch.load(tmp_path / "straight" / "final.pt", weights_only=True)
    assert resumed.keys() == straight.keys()
    for name in straight:
        assert torch.equal(resumed[name], straight[name]), f"{name} differs after the resume"
    # The steps after the resume moved the weights (the equality is not of untouched ones).
    at_4 = {"model": {k: torch.empty_like(v) for k, v in straight.items()}}
    dcp.load(at_4, checkpoint_id=str(tmp_path / "killed" / "step_4"), no_dist=True)
    assert any(not torch.equal(at_4["model"][k], resumed[k]) for k in resumed)

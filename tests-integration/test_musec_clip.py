"""``benchmarks/musec_clip.py`` on a tiny model: what it measures is what it says.

The clip of a normalised momentum ``B = √k·U/‖U‖_F`` must cut at least one singular
value at τ = 1 (their mean square is 1, so the largest is ≥ 1), the step's Frobenius
norm is at most Muon's (``√k``), and both clip constructions — the m×m one of
``dmuon.kernels.spectral_clip`` and the one before issue 18 — agree with a float64 SVD.
"""

import json

from benchmarks.musec_clip import main


def test_musec_clip_diagnostic_on_a_tiny_model(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    args = ["--layers", "1", "--d-model", "32", "--heads", "2", "--seq-len", "16"]
    args += ["--batch-size", "4", "--steps", "3", "--at", "1,3", "--data", str(text)]
    assert main([*args, "--out", str(tmp_path), "--tag", "t"]) == 0
    result = json.loads((tmp_path / "musec-clip-cpu-t.json").read_text())
    assert set(result["matrices"]) == {"1", "3"}
    for per in result["matrices"].values():
        assert len(per) == 4  # the four hidden matrices of one block
        for r in per.values():
            k = min(r["shape"])
            assert r["sigma_max"] >= 1.0 - 1e-6  # mean σ² is 1
            assert r["clipped_fraction"]["1.0"] >= 1 / k - 1e-12
            # fewer directions reach a higher level, and the step grows with τ up to Muon's
            fracs = [r["clipped_fraction"][t] for t in ("0.25", "0.5", "1.0", "2.0")]
            norms = [r["step_norm_vs_muon"][t] for t in ("0.25", "0.5", "1.0", "2.0")]
            assert fracs == sorted(fracs, reverse=True)
            assert norms == sorted(norms) and norms[-1] <= 1.0 + 1e-9
            # fp32 iterations against a float64 SVD: 1e-4 is ~100× the errors seen
            assert r["rel_error"]["now"] < 1e-4 and r["rel_error"]["before"] < 1e-4

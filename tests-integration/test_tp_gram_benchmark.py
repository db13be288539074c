"""``benchmarks/tp_gram.py``'s "MB moved" column is the bytes one rank sends, counted
as the library's α–β model counts them (so the table and ``tp_path="auto"`` agree).

The reference is written out by hand from the ring algorithms rather than read from
:func:`dmuon.comm.tensor_parallel_path`: a ring all-reduce of ``P`` bytes over ``t``
ranks sends ``2 (t − 1)/t · P`` per rank, an all-gather of a whole ``m × n`` matrix
``(t − 1)/t · m n`` elements. The times are reported, never asserted.
"""

from __future__ import annotations

import json

from benchmarks import tp_gram


def test_bytes_column_is_what_one_rank_sends(tmp_path):
    assert tp_gram.main(["--device", "cpu", "--dry-run", "--no-plot", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "tp-gram-cpu-dry-run.json").read_text())
    rows = result["rows"]
    assert {r["tp"] for r in rows} == {2, 4}
    for r in rows:
        m, n, t = r["m"], r["n"], r["tp"]
        gram_e = {"float32": 4, "float16": 2, "bfloat16": 2}[r["dtype"]]
        assert r["shard_dtype"] == "float32"  # the benchmark's matrices: torch.randn
        shard_e = 4
        ring = 2 * (t - 1) / t
        # two Gram all-reduces (the start and the one restart at step 2, m ≤ n), then the
        # normalisation's two fp32 all-reduces of 1 and 2 entries (a batch of one)
        gram = ring * (2 * m * m * gram_e + 1 * 4 + 2 * 4)
        gather = (t - 1) / t * m * n * shard_e  # one all-gather, no scatter back
        assert r["native_bytes"] == round(gram), (r, gram)
        assert r["gather_bytes"] == round(gather), (r, gather)

"""Matrix lists of real model families, for planning tests and benchmarks."""

from dmuon.comm import MatrixItem


def gpt_items(layers: int = 12, d: int = 768) -> list[MatrixItem]:
    """GPT-2-small-style blocks: q, k, v, o (d×d), MLP fc (4d×d) and proj (d×4d)."""
    out = []
    for i in range(layers):
        layer = f"transformer.h.{i}"
        for part, shape in [
            ("attn.q", (d, d)),
            ("attn.k", (d, d)),
            ("attn.v", (d, d)),
            ("attn.o", (d, d)),
            ("mlp.fc", (4 * d, d)),
            ("mlp.proj", (d, 4 * d)),
        ]:
            out.append(MatrixItem(f"{layer}.{part}.weight", shape, layer=layer))
    return out


def llama_items(layers: int = 16, d: int = 2048, kv: int = 512, ff: int = 8192) -> list[MatrixItem]:
    """Llama-3.2-1B-style blocks: q, o (d×d), grouped k, v (kv×d), gate, up (ff×d), down."""
    out = []
    for i in range(layers):
        layer = f"model.layers.{i}"
        for part, shape in [
            ("self_attn.q_proj", (d, d)),
            ("self_attn.k_proj", (kv, d)),
            ("self_attn.v_proj", (kv, d)),
            ("self_attn.o_proj", (d, d)),
            ("mlp.gate_proj", (ff, d)),
            ("mlp.up_proj", (ff, d)),
            ("mlp.down_proj", (d, ff)),
        ]:
            out.append(MatrixItem(f"{layer}.{part}.weight", shape, layer=layer))
    return out

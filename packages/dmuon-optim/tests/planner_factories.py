"""Model factories that ``dmuon-plan``'s ``module:factory`` tests build (on the meta device)."""

import torch
from torch import nn

BUILT_ON: list[str] = []


class Tiny(nn.Module):
    """Embedding, two blocks with a stack of experts, norms and a head."""

    def __init__(self, d: int = 16, vocab: int = 50, experts: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "norm": nn.LayerNorm(d),
                    "attn": nn.Linear(d, 3 * d),
                    "proj": nn.Linear(d, d, bias=False),
                    "mlp": nn.Linear(d, 4 * d),
                }
            )
            for _ in range(2)
        )
        self.experts = nn.Parameter(torch.zeros(experts, d, 2 * d))
        self.head = nn.Linear(d, vocab, bias=False)


def tiny() -> nn.Module:
    model = Tiny()
    BUILT_ON.append(str(next(model.parameters()).device))
    return model


def not_a_module() -> int:
    return 3

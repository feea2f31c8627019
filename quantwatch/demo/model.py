"""The demo's model and task: a tiny causal transformer learning the next token of a seeded Markov chain."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional

VOCAB = 32
SEQUENCE = 32
BATCH = 16
WIDTH = 64
HEADS = 4
BLOCKS = 2


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        attended = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(attended.transpose(1, 2).reshape(b, t, d))  # type: ignore[no-any-return]


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, 4 * WIDTH)
        self.fc2 = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(functional.gelu(self.fc1(x)))  # type: ignore[no-any-return]


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(WIDTH)
        self.attn = _Attention()
        self.ln2 = nn.LayerNorm(WIDTH)
        self.mlp = _Mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))  # type: ignore[no-any-return]


class TinyTransformer(nn.Module):
    """A two-block causal transformer (width 64, 4 heads); its linear layers are what ``quantize_model`` swaps."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.position = nn.Parameter(torch.zeros(SEQUENCE, WIDTH))
        self.blocks = nn.ModuleList(_Block() for _ in range(BLOCKS))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of the next token at every position."""
        h = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))  # type: ignore[no-any-return]


class MarkovTask:
    """Sequences from a fixed random Markov chain over ``VOCAB`` tokens; the model learns its transitions.

    The chain is peaked (a few likely successors per token), so the loss falls quickly from ln(VOCAB) towards the
    chain's entropy: a real learning curve in a few dozen steps. Everything derives from ``seed``.
    """

    def __init__(self, seed: int) -> None:
        self._generator = torch.Generator().manual_seed(seed)
        logits = torch.randn(VOCAB, VOCAB, generator=self._generator) * 2.5
        self.transitions = torch.softmax(logits, dim=-1)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)``, each ``BATCH × SEQUENCE`` token ids; targets are the inputs shifted by one."""
        tokens = torch.empty(BATCH, SEQUENCE + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(VOCAB, (BATCH,), generator=self._generator)
        for t in range(SEQUENCE):
            tokens[:, t + 1] = torch.multinomial(self.transitions[tokens[:, t]], 1, generator=self._generator)[:, 0]
        return tokens[:, :-1], tokens[:, 1:]


def next_token_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the model's next-token logits against ``targets``."""
    return functional.cross_entropy(model(inputs).reshape(-1, VOCAB), targets.reshape(-1))

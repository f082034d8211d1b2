"""A tiny character-level language model built from einattn's layer, trained twice.

    python examples/tiny_lm.py                     # 300 steps per run, 1-2 minutes on 2 cores
    python examples/tiny_lm.py --steps 50 --out /tmp

The model is a miniature GPT: token and position embeddings, two blocks of pre-LayerNorm
causal self-attention (``einattn.MultiHeadAttention(..., causal=True)``) and MLP, a final
LayerNorm and a linear read-out to the characters. It learns seven of Shakespeare's sonnets
(examples/sonnets.txt, public domain) one character at a time.

It is trained twice from the same initial weights on the same batches: once with
``impl="einsum"`` (equations (1)–(5) of docs/derivation.md as written) and once with
``impl="sdpa"`` (equations (2)–(4) by ``F.scaled_dot_product_attention``). The two loss
curves must agree to float32 rounding; the script prints both final losses and the largest
difference between the curves, exits with status 1 if that exceeds ``--tolerance``, and
saves two figures into ``--out``: the loss curves (tiny_lm_loss.png) and the attention of
the last block on a line of the text (tiny_lm_attention.png, drawn by einattn.plot).

Needs, from einattn's checkout, ``pip install '.[examples]'``: matplotlib for the figures
and tqdm for the progress bar (tqdm because it is small, has no dependencies, and falls
back to plain periodic lines when stderr is not a terminal).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from matplotlib.figure import Figure
from torch import nn
from torch.nn import functional as F
from tqdm import tqdm

import einattn
from einattn import plot

TEXT = Path(__file__).with_name("sonnets.txt")
PROMPT = "Shall I compare thee to a summer's day?"  # a line of the text, for the attention plot


@dataclass(frozen=True)
class Config:
    context: int = 64      # characters a sample sees: τ and σ run over 0..63
    d_model: int = 64      # index i
    n_heads: int = 4       # index μ, so d_head = 16 (index a)
    n_blocks: int = 2
    batch: int = 16        # index n
    lr: float = 3e-3
    seed: int = 0


class Vocabulary:
    """The characters of the text, each an integer token."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.index = {c: k for k, c in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.index[c] for c in text])

    def decode(self, tokens) -> str:
        return "".join(self.chars[int(t)] for t in tokens)


class Block(nn.Module):
    """x + attention(LayerNorm(x)), then x + MLP(LayerNorm(x))."""

    def __init__(self, config: Config, impl: str):
        super().__init__()
        d = config.d_model
        self.ln_attn = nn.LayerNorm(d)
        self.attn = einattn.MultiHeadAttention(d, config.n_heads, causal=True, impl=impl,
                                               init="gpt2")
        self.ln_mlp = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x[n τ i]
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class TinyLM(nn.Module):
    def __init__(self, config: Config, vocab_size: int, impl: str):
        super().__init__()
        self.token = nn.Embedding(vocab_size, config.d_model)
        self.position = nn.Embedding(config.context, config.d_model)
        self.blocks = nn.ModuleList(Block(config, impl) for _ in range(config.n_blocks))
        self.ln = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, vocab_size)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:  # tokens[n τ] -> x[n τ i]
        return self.token(tokens) + self.position(torch.arange(tokens.shape[1]))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # logits[n τ c]
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))

    @torch.no_grad()
    def attention(self, tokens: torch.Tensor, block: int) -> torch.Tensor:
        """The weights ``A[n μ τ σ]`` of one block's attention on ``tokens[n τ]``."""
        x = self.embed(tokens)
        for b in self.blocks[:block]:
            x = b(x)
        layer = self.blocks[block]
        _, A = layer.attn(layer.ln_attn(x), need_weights=True)
        return A

    @torch.no_grad()
    def generate(self, tokens: torch.Tensor, length: int, context: int,
                 generator: torch.Generator) -> torch.Tensor:
        for _ in range(length):
            logits = self(tokens[:, -context:])[:, -1]
            next_token = torch.multinomial(logits.softmax(-1), 1, generator=generator)
            tokens = torch.cat([tokens, next_token], dim=1)
        return tokens


def batches(data: torch.Tensor, config: Config, steps: int):
    """``steps`` batches of (input, target), each ``(batch, context)``, from a fixed seed:
    every call yields the same sequence, so two runs see the same data."""
    generator = torch.Generator().manual_seed(config.seed + 1)
    for _ in range(steps):
        start = torch.randint(len(data) - config.context - 1, (config.batch,),
                              generator=generator)
        rows = start[:, None] + torch.arange(config.context + 1)
        chunk = data[rows]
        yield chunk[:, :-1], chunk[:, 1:]


def train(impl: str, steps: int, config: Config = Config(), *, progress: bool = True
          ) -> tuple[list[float], TinyLM, Vocabulary]:
    """Train a fresh model (initial weights from ``config.seed``, the same for every
    ``impl``) for ``steps`` steps; the loss of every step, the model and its vocabulary."""
    text = TEXT.read_text(encoding="utf-8")
    vocab = Vocabulary(text)
    data = vocab.encode(text)
    torch.manual_seed(config.seed)
    model = TinyLM(config, len(vocab), impl)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.01)
    losses = []
    bar = tqdm(batches(data, config, steps), total=steps, desc=f"impl={impl:6}",
               disable=not progress, mininterval=0.5, file=sys.stderr)
    for inputs, targets in bar:
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
    return losses, model.eval(), vocab


def loss_figure(curves: dict[str, list[float]]):
    """The loss curves of the two runs, and their difference step by step, side by side."""
    fig = Figure(figsize=(9, 3.2), layout="constrained")  # no pyplot: Agg when saved
    left, right = fig.subplots(1, 2)
    for (name, losses), style in zip(curves.items(), ["-", "--"], strict=True):
        left.plot(range(1, len(losses) + 1), losses, style, label=name, linewidth=1.2)
    left.axhline(math.log(len(Vocabulary(TEXT.read_text(encoding="utf-8")))), color="grey",
                 linestyle=":", linewidth=1, label="uniform guess")
    left.set(xlabel="step", ylabel="cross-entropy (nats/char)", title="training loss")
    left.legend()
    (a, first), (b, second) = curves.items()
    difference = [x - y for x, y in zip(first, second, strict=True)]
    right.plot(range(1, len(difference) + 1), difference, color="black", linewidth=0.8)
    right.set(xlabel="step", ylabel="difference (nats/char)", title=f"loss({a}) − loss({b})")
    right.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps per run")
    parser.add_argument("--out", type=Path, default=Path("."), help="where the figures go")
    parser.add_argument("--tolerance", type=float, default=1e-4,
                        help="largest allowed |loss(einsum) − loss(sdpa)| at any step")
    parser.add_argument("--sample", type=int, default=100, metavar="CHARS",
                        help="characters to generate after the prompt")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    config = Config()
    curves, models = {}, {}
    for impl in ("einsum", "sdpa"):
        curves[impl], models[impl], vocab = train(impl, args.steps, config,
                                                  progress=not args.quiet)
    gap = max(abs(x - y) for x, y in zip(curves["einsum"], curves["sdpa"], strict=True))
    for impl, losses in curves.items():
        print(f"final loss, impl={impl:6}  {losses[-1]:.4f}  (first step {losses[0]:.4f})")
    print(f"largest |loss(einsum) - loss(sdpa)| over {args.steps} steps: {gap:.2e}")

    prompt = vocab.encode(PROMPT)[None]  # tokens[n τ], n = 1
    # Either model would do: they are the same. Decoding grows the sequence by one token a
    # call, a new shape each time, and the einsum path plans every new shape once.
    sample = models["sdpa"].generate(prompt, args.sample, config.context,
                                     torch.Generator().manual_seed(0))
    print("sample:", vocab.decode(sample[0]).replace("\n", " / "))

    args.out.mkdir(parents=True, exist_ok=True)
    loss_figure(curves).savefig(args.out / "tiny_lm_loss.png", dpi=80)
    last = config.n_blocks - 1
    A = models["einsum"].attention(prompt, block=last)[0]  # A[μ τ σ] of the one sample
    shown = [{" ": "␣", "\n": "↵"}.get(c, c) for c in PROMPT]
    fig = plot.attention(A, tokens=shown, title=f"block {last}, after {args.steps} steps")
    fig.savefig(args.out / "tiny_lm_attention.png", dpi=64)
    print(f"saved {args.out / 'tiny_lm_loss.png'} and {args.out / 'tiny_lm_attention.png'}")
    return 0 if gap <= args.tolerance else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""The demo's model and data: a decoder-only character-level LM as a list of pipeline layers.

Every system the demo trains (this repo's pipeline and sharding, torch's DDP + ZeRO and FSDP2)
builds the same layers from the same seeds and reads the same batches, so their losses can be
compared step by step. The text is real: this repo's own sources, or a file given with --data.
"""
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from relgrad import register_main_grad_hooks

REPO = Path(__file__).resolve().parent.parent


class Embedding(nn.Module):
    """Token plus learned position embeddings: the first pipeline layer."""

    def __init__(self, vocab, d_model, block_size):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d_model), nn.Embedding(block_size, d_model)
        nn.init.normal_(self.tok.weight, std=0.02)  # tied to the head: GPT-2's scale, not N(0, 1)

    def forward(self, idx):  # (B, T) int64 -> (B, T, d_model)
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class Block(nn.Module):
    """A pre-norm transformer block with a causal mask (torch's TransformerEncoderLayer)."""

    def __init__(self, d_model, n_head):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(d_model, n_head, 4 * d_model, dropout=0.0,
                                                batch_first=True, norm_first=True)

    def forward(self, x):  # (B, T, d_model) -> same, each position sees only its past
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], x.device, x.dtype)
        return self.layer(x, src_mask=mask, is_causal=True)


class Head(nn.Module):
    """Final layer norm and projection to vocabulary logits: the last pipeline layer."""

    def __init__(self, d_model, vocab):
        super().__init__()
        self.norm, self.proj = nn.LayerNorm(d_model), nn.Linear(d_model, vocab)

    def forward(self, x):  # (B, T, d_model) -> logits (B, T, vocab)
        return self.proj(self.norm(x))


def lm_loss(logits, targets):
    """Mean cross entropy of (B, T, vocab) logits against (B, T) int64 targets, in fp32."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _seeded_layer(seed, main_grad, device, cls, *args):
    """Build one layer from its own seed (same weights on any stage), on its device and, for
    --main-grad, in bf16 with fp32 main grads: all before the pipeline builds grad buffers
    (moving a module afterwards would move its grads out of their buffer)."""
    torch.manual_seed(seed)
    layer = cls(*args).to(device)
    if main_grad:
        layer.to(torch.bfloat16)
        register_main_grad_hooks(layer.parameters())
    return layer


def lm_layers(vocab, opts, device):
    """The LM as a list of layer builders for PipelineParallel (each stage builds its own)."""
    d, seed, main_grad = opts["d_model"], opts["seed"], opts["main_grad"]
    specs = ([(Embedding, vocab, d, opts["block"])] + [(Block, d, 4)] * opts["layers"]
             + [(Head, d, vocab)])
    return [partial(_seeded_layer, seed + i, main_grad, device, *spec)
            for i, spec in enumerate(specs)]


def lm_shared_weights(opts):
    """The LM's tie: token embedding (first layer) and head projection (last), both
    (vocab, d_model); across stages with pp > 1, one Parameter with pp 1."""
    return [("0.tok.weight", f"{opts['layers'] + 1}.proj.weight")]


def load_text(path=None):
    """Real text on this machine: `path`, or this repo's own sources and README."""
    paths = [Path(path)] if path else sorted(REPO.glob("*.py")) + sorted(REPO.glob("*.md"))
    return "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in paths)


class Corpus:
    """The text as int64 token ids, and the batch each data replica reads at each step.

    `batch(step, replica, replicas)` returns `(x, y)`, both (micro_batch_size * micro_batches,
    block) int64: sequences starting at positions drawn from a generator seeded by `seed` and
    `step`, so every system and every run reads the same data; `y` is `x` shifted by one.
    """

    def __init__(self, opts):
        text = load_text(opts["data"])
        self.vocab = sorted(set(text))
        index = {c: i for i, c in enumerate(self.vocab)}
        self.ids = torch.tensor([index[c] for c in text], dtype=torch.long)
        self.block, self.seed = opts["block"], opts["seed"]
        self.local = opts["micro_batch_size"] * opts["micro_batches"]

    def batch(self, step, replica, replicas, device):
        gen = torch.Generator().manual_seed(self.seed * 1000 + step)
        starts = torch.randint(0, len(self.ids) - self.block - 1, (replicas * self.local,),
                               generator=gen)[replica * self.local : (replica + 1) * self.local]
        x = torch.stack([self.ids[s : s + self.block] for s in starts.tolist()])
        y = torch.stack([self.ids[s + 1 : s + 1 + self.block] for s in starts.tolist()])
        return x.to(device), y.to(device)

"""A small character-level transformer, sequential (plain torch) and distributed (gpudist
layers with Megatron-style sequence/tensor parallelism), with the same parameters.

The network (pre-norm, causal)::

    x = tok(idx) + pos(positions)                          embeddings (vocab x D, S x D)
    block (x layers):
        a = softmax_causal(q k^T / sqrt(hd)) v per head,   q, k, v = Wq h, Wk h, Wv h,
                                                           h = LN1(x) (no key bias: it
                                                           would not change the output)
        x = x + Wo a
        x = x + W2 gelu(W1 LN2(x))                         MLP, hidden 4 D
    logits = head(LN_f(x))

Distributed over ``M`` ranks: activations ``(B, S, D)`` lie over ``P_x = (1, M, 1)`` (the
sequence split). The embeddings (:class:`~gpudist.nn.embedding.DistributedEmbedding`, work
partition ``(1, M, 1, 1)``: the table on rank 0, broadcast to the sequence blocks) and the
layer norms (:class:`~gpudist.nn.layernorm.DistributedLayerNorm`: the features are whole, no
statistics travel) act on the sequence blocks. ``q``, ``k``, ``v`` and ``W1`` are
:class:`~gpudist.nn.linear_sharded.DistributedLinearAllGather` layers: the sequence is
all-gathered and each rank computes its block of output features, i.e. whole sequences
for its ``heads / M`` heads, so the causal attention is local. ``Wo`` and ``W2`` are
:class:`~gpudist.nn.linear_sharded.DistributedLinearReduceScatter` layers: local partial
products over the rank's features, reduce-scattered back to sequence blocks for the
residual sums. The head is vocabulary-parallel: another ``DistributedLinearAllGather``
gives each rank the logits of its block of the vocabulary for the whole sequence, and the
loss (:class:`~gpudist.nn.loss.DistributedLoss`, cross-entropy with the class dimension
split) combines the ranks' log-sum-exps without gathering the logits. Adjoints: autograd
through the layers (AllGather <-> ReduceScatter, Broadcast <-> SumReduce of parameter
gradients).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpudist import DistTensor, Partition
from gpudist.nn.embedding import DistributedEmbedding
from gpudist.nn.layernorm import DistributedLayerNorm
from gpudist.nn.linear_sharded import (
    DistributedLinearAllGather,
    DistributedLinearReduceScatter,
)
from gpudist.nn.loss import DistributedLoss

from ..common import UsageError

# a few paragraphs to learn from (written for this example)
CORPUS = (
    "the workers split the sequence into blocks. each worker gathers the whole sequence "
    "for its heads, computes attention, and scatters the result back. the sum of the "
    "parts is the whole, and the whole is the same on every worker. when the gradients "
    "flow back, the gather becomes a scatter and the scatter becomes a gather. a copy "
    "becomes a sum, and a sum becomes a copy. the network learns the same thing on one "
    "worker or on four, step by step, to the last digit that the numbers can hold. "
    "small models learn small texts: they repeat what they have seen, letter by letter, "
    "and they guess the next letter from the letters before it. "
)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int
              ) -> torch.Tensor:
    """Causal multi-head attention on ``(B, S, h * head_dim)`` tensors (heads contiguous
    along the features)."""
    b, s, f = q.shape

    def split(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(b, s, f // head_dim, head_dim).transpose(1, 2)

    a = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True)
    return a.transpose(1, 2).reshape(b, s, f)


class Block(nn.Module):
    """One pre-norm transformer block (plain torch)."""

    def __init__(self, dim: int, heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.ln1 = nn.LayerNorm(dim, dtype=dtype)
        self.q = nn.Linear(dim, dim, dtype=dtype)
        self.k = nn.Linear(dim, dim, bias=False, dtype=dtype)  # a key bias has no effect
        self.v = nn.Linear(dim, dim, dtype=dtype)
        self.o = nn.Linear(dim, dim, dtype=dtype)
        self.ln2 = nn.LayerNorm(dim, dtype=dtype)
        self.fc1 = nn.Linear(dim, 4 * dim, dtype=dtype)
        self.fc2 = nn.Linear(4 * dim, dim, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.o(attention(self.q(h), self.k(h), self.v(h), self.head_dim))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class CharTransformer(nn.Module):
    """The sequential network: ``forward(idx (B, S)) -> logits (B, S, vocab)``."""

    def __init__(self, vocab: int, context: int, dim: int = 32, heads: int = 4,
                 layers: int = 2, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim, dtype=dtype)
        self.pos = nn.Embedding(context, dim, dtype=dtype)
        self.blocks = nn.ModuleList([Block(dim, heads, dtype) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(dim, dtype=dtype)
        self.head = nn.Linear(dim, vocab, dtype=dtype)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


class DistributedBlock(nn.Module):
    """:class:`Block` on ``(B, S, D)`` split along S over ``P_x = (1, M, 1)`` (see the
    module docstring); takes and returns DistTensors on ``P_x``. Collective construction."""

    def __init__(self, P_x: Partition, dim: int, heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.ln1 = DistributedLayerNorm(P_x, dim, dtype=dtype)
        self.q = DistributedLinearAllGather(P_x, dim, dim, dtype=dtype)
        self.k = DistributedLinearAllGather(P_x, dim, dim, bias=False, dtype=dtype)
        self.v = DistributedLinearAllGather(P_x, dim, dim, dtype=dtype)
        self.o = DistributedLinearReduceScatter(self.q.P_y, dim, dim, dtype=dtype)
        self.ln2 = DistributedLayerNorm(P_x, dim, dtype=dtype)
        self.fc1 = DistributedLinearAllGather(P_x, dim, 4 * dim, dtype=dtype)
        self.fc2 = DistributedLinearReduceScatter(self.fc1.P_y, 4 * dim, dim, dtype=dtype)

    def forward(self, x: DistTensor) -> DistTensor:
        h = self.ln1(x)
        q, k, v = self.q(h), self.k(h), self.v(h)  # whole sequences, this rank's heads
        a = DistTensor(attention(q.local, k.local, v.local, self.head_dim), q.spec,
                       check=False)
        x = x + self.o(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


SHARDED = ("ln1", "q", "k", "v", "o", "ln2", "fc1", "fc2")


class DistributedCharTransformer(nn.Module):
    """:class:`CharTransformer` over ``ranks`` workers (collective construction).

    ``forward(idx, batch)`` takes this rank's sequence block ``(B, S_m)`` of the token
    indices (every rank passes the batch size and the context length is fixed, so no shape
    is exchanged) and returns the logits of this rank's vocabulary block for the whole
    sequence, class-major for the loss: a DistTensor ``(B, vocab, S)`` over ``P_x``
    (vocabulary split). ``loss(logits, targets)``: the mean cross-entropy (the whole
    ``(B, S)`` targets on every rank; the value on rank 0, a zero in the graph elsewhere).
    """

    def __init__(self, vocab: int, context: int, dim: int = 32, heads: int = 4,
                 layers: int = 2, dtype: torch.dtype = torch.float64,
                 ranks: int | None = None) -> None:
        super().__init__()
        import gpudist

        w = gpudist.world()
        m = w.size if ranks is None else ranks
        check_layout(m, context, dim, heads)
        self.context, self.vocab = context, vocab
        self.P_idx = Partition.grid((1, m))
        self.P_x = Partition.grid((1, m, 1))
        P_emb = Partition.grid((1, m, 1, 1))
        kw = {"P_x": self.P_idx, "P_y": self.P_x, "dtype": dtype}
        self.tok = DistributedEmbedding(P_emb, vocab, dim, **kw)
        self.pos = DistributedEmbedding(P_emb, context, dim, **kw)
        self.blocks = nn.ModuleList([DistributedBlock(self.P_x, dim, heads, dtype)
                                     for _ in range(layers)])
        self.ln_f = DistributedLayerNorm(self.P_x, dim, dtype=dtype)
        self.head = DistributedLinearAllGather(self.P_x, dim, vocab, dtype=dtype)
        self.loss = DistributedLoss(self.P_x, "cross_entropy")
        self._pos: torch.Tensor | None = None

    def sharded(self) -> dict[str, nn.Module]:
        """The gpudist layers by their sequential names."""
        out: dict[str, nn.Module] = {"tok": self.tok, "pos": self.pos, "ln_f": self.ln_f,
                                     "head": self.head}
        for i, b in enumerate(self.blocks):
            out.update({f"blocks.{i}.{n}": getattr(b, n) for n in SHARDED})
        return out

    def forward(self, idx: torch.Tensor, batch: int) -> torch.Tensor:
        shape = (batch, self.context)
        if self._pos is None or self._pos.shape != idx.shape:
            lo = self.P_x.coords[1] if self.P_x.active else 0
            self._pos = (torch.arange(idx.shape[1], device=idx.device) + _start(
                self.context, self.P_x.shape[1], lo)).expand(idx.shape).contiguous()
        x = self.tok(DistTensor.from_local(idx, self.P_idx, shape)) + \
            self.pos(DistTensor.from_local(self._pos, self.P_idx, shape))
        for b in self.blocks:
            x = b(x)
        y = self.head(self.ln_f(x))  # (B, S, V) over (1, 1, M): this rank's vocabulary
        return DistTensor.from_local(y.local.transpose(1, 2), self.P_x,
                                     (batch, self.vocab, self.context))

    def load_from(self, seq: CharTransformer) -> None:
        """Take the sequential network's parameters (every rank passes the same ones)."""
        sd = seq.state_dict()
        for name, layer in self.sharded().items():
            layer.load_global_state_dict({k[len(name) + 1:]: v for k, v in sd.items()
                                          if k.startswith(name + ".")})

    def global_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: the full parameters (sequential names) on rank 0, {} elsewhere."""
        out: dict[str, torch.Tensor] = {}
        for name, layer in self.sharded().items():
            out.update({f"{name}.{k}": v for k, v in layer.global_state_dict().items()})
        return out


def _start(n: int, parts: int, i: int) -> int:
    from gpudist.decomposition import block_range

    return block_range(n, parts, i)[0]


def check_layout(ranks: int, context: int, dim: int, heads: int) -> None:
    """Raise :class:`UsageError` unless the heads and features split evenly over the
    ranks (each rank then holds whole heads)."""
    if ranks < 1 or heads % ranks or dim % heads or context < ranks:
        raise UsageError(
            f"the transformer example needs the {heads} heads to split evenly over the "
            f"ranks, dim ({dim}) divisible by the heads and a context ({context}) of at "
            f"least one token per rank; {ranks} rank(s) do not fit (try 1, 2 or 4)")


def vocabulary(text: str = CORPUS) -> str:
    return "".join(sorted(set(text)))


def make_sequential(seed: int, vocab: int, context: int, dtype: torch.dtype = torch.float64,
                    **kw) -> CharTransformer:
    torch.manual_seed(seed)
    return CharTransformer(vocab, context, dtype=dtype, **kw)


def make_distributed(seq: CharTransformer, vocab: int, context: int,
                     dtype: torch.dtype = torch.float64, **kw) -> DistributedCharTransformer:
    net = DistributedCharTransformer(vocab, context, dtype=dtype, **kw)
    net.load_from(seq)
    return net

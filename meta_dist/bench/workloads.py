"""The workloads of ``bench train``: the reference MLP and a GPT, each with data and both models.

Imports numpy and meta_dist (models, nn, train); imported by meta_dist.bench.train. A workload
builds its meta_dist model and its PyTorch twin (for meta_dist.bench.torch_side) from one seed,
so every variant starts from the same weights; the twins import torch only when asked for.
"""

import numpy as np

from meta_dist.errors import UsageError
from meta_dist.models import gpt
from meta_dist.nn.layers import Linear, ReLU
from meta_dist.nn.losses import cross_entropy_tokens, softmax_cross_entropy
from meta_dist.nn.model import Sequential
from meta_dist.train import synthetic_classification
from meta_dist.train.data import char_corpus, windows

BATCHES, SEED = 8, 0


def build_mlp(hidden, depth=2, xp=np):
    """Return the reference MLP on ``xp``, initialised from SEED (identical on every rank)."""
    kw = {"rng": np.random.default_rng(SEED), "dtype": np.float32, "xp": xp}
    layers = [Linear(784, hidden, **kw), ReLU()]
    for _ in range(depth - 1):
        layers += [Linear(hidden, hidden, **kw), ReLU()]
    return Sequential(*layers, Linear(hidden, 10, **kw))


class MLPWorkload:
    """The reference MLP on synthetic classification data."""

    unit = "samples"

    def __init__(self, args):
        self.hidden, self.depth, self.global_batch = args.hidden, args.depth, args.batch or 256
        self.x, self.y = synthetic_classification(BATCHES * self.global_batch, (784,), 10,
                                                  seed=SEED)
        self.config = {"input_shape": [784], "num_classes": 10}
        self.loss_fn, self.per_step = softmax_cross_entropy, self.global_batch

    def describe(self):
        """Return the model in words, for the report's header."""
        shape = "-".join(["784"] + [str(self.hidden)] * self.depth + ["10"])
        return f"MLP {shape}"

    def meta_model(self, xp=np):
        """Return the meta_dist model on ``xp``, the same on every rank."""
        return build_mlp(self.hidden, self.depth, xp)

    def torch_model(self):
        """Return (model, units): the torch MLP with the same weights, and its FSDP units."""
        import torch

        h = self.hidden
        layers = [torch.nn.Linear(784, h), torch.nn.ReLU()]
        for _ in range(self.depth - 1):
            layers += [torch.nn.Linear(h, h), torch.nn.ReLU()]
        model = torch.nn.Sequential(*layers, torch.nn.Linear(h, 10))
        with torch.no_grad():  # meta_dist stores W as (in, out), torch as (out, in)
            start = self.meta_model()
            for mine, theirs in zip(model[::2], start.layers[::2], strict=True):
                mine.weight.copy_(torch.from_numpy(theirs.params["weight"].T))
                mine.bias.copy_(torch.from_numpy(theirs.params["bias"]))
        return model, list(model[::2])

    @staticmethod
    def torch_loss(out, y):
        """Return torch's loss of a batch, the twin of ``loss_fn``."""
        import torch.nn.functional as F

        return F.cross_entropy(out, y)


class GPTWorkload:
    """A GPT (meta_dist.models.gpt) on the standard library's characters, next-token loss."""

    unit = "tokens"

    def __init__(self, args):
        self.n_layer, self.n_head, self.n_embd, self.block_size = args.gpt
        self.global_batch = args.batch or 32
        ids, self.vocab = char_corpus()
        x, y = windows(ids, self.block_size)
        need = BATCHES * self.global_batch
        if len(x) < need:
            raise UsageError(f"bench train: the corpus has {len(x)} windows of "
                             f"{self.block_size}; --batch {self.global_batch} needs {need}; "
                             "use a smaller --batch or --gpt block size")
        self.x, self.y = np.ascontiguousarray(x[:need]), np.ascontiguousarray(y[:need])
        self.config = {}
        self.loss_fn, self.per_step = cross_entropy_tokens, self.global_batch * self.block_size

    def describe(self):
        """See ``MLPWorkload.describe``."""
        return (f"GPT {self.n_layer} layers x {self.n_head} heads, width {self.n_embd}, context "
                f"{self.block_size}, vocabulary {len(self.vocab)}")

    def meta_model(self, xp=np):
        """See ``MLPWorkload.meta_model``."""
        return gpt(len(self.vocab), self.block_size, self.n_layer, self.n_head, self.n_embd,
                   seed=SEED, dtype=np.float32, xp=xp)

    def torch_model(self):
        """Return (model, units): TorchGPT with the same weights, and its blocks as FSDP units."""
        from meta_dist.models.torch_gpt import twin

        model = twin(self.meta_model(), len(self.vocab), self.block_size, self.n_layer,
                     self.n_head, self.n_embd)
        return model, list(model.h)

    def torch_loss(self, logits, y):
        """See ``MLPWorkload.torch_loss``."""
        import torch.nn.functional as F

        return F.cross_entropy(logits.view(-1, len(self.vocab)), y.view(-1))


def count_params(model):
    """Return the number of parameters of a meta_dist model; a tied array counts once."""
    arrays = {id(a): a for layer in model.layers for a in layer.params.values()}
    return sum(a.size for a in arrays.values())

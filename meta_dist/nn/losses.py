"""Loss functions returning ``(loss, dinput)``: softmax cross-entropy, NLL and mean squared error.

Leaf module: imports numpy, ``meta_dist.xp`` and ``nn.grad_blocks`` only; the trainer and the
tests import it. Each loss is the mean over the batch (axis 0; every token for
``cross_entropy_tokens``) and is returned as a 0-d array of the input's array module, never a
Python float: converting would force a host sync on the GPU every step.
"""

from __future__ import annotations

import numpy as np

from meta_dist.nn.grad_blocks import in_float32
from meta_dist.xp import array_module, is_cupy_array


def _check_labels(api: str, scores, labels) -> None:
    """Raise unless ``scores`` is (N, C) and ``labels`` holds N integer class indices in [0, C)."""
    if scores.ndim != 2:
        raise ValueError(f"{api}: input must be 2-D; got shape {tuple(scores.shape)}, "
                         f"expected (N, C)")
    n, c = scores.shape
    if labels.shape != (n,):
        raise ValueError(f"{api}: labels have the wrong shape; got {tuple(labels.shape)}, "
                         f"expected ({n},) to match input {tuple(scores.shape)}")
    if not np.issubdtype(labels.dtype, np.integer):
        raise TypeError(f"{api}: labels must be integer class indices; got dtype {labels.dtype}, "
                        f"expected an integer dtype")
    # The range check reads the labels back; on the GPU that is a host sync, so it runs on the
    # host only.
    if n and not is_cupy_array(labels):
        low, high = int(labels.min()), int(labels.max())
        if low < 0 or high >= c:
            raise ValueError(f"{api}: label out of range; got labels in [{low}, {high}], "
                             f"expected every label in [0, {c - 1}]")


def softmax_cross_entropy(logits, labels):
    """Return the mean cross-entropy of ``softmax(logits)`` against integer labels, and its grad.

    Uses a stable log-sum-exp (the row max is subtracted before ``exp``). 16-bit logits are
    taken in float32 (as PyTorch's autocast does): the loss and ``dlogits`` come back in
    float32, for the caller to scale (fp16's loss scale) before it rounds them, since
    ``1 / N`` of a probability underflows float16 for large N.

    Args:
        logits: (N, C) float array.
        labels: (N,) integer class indices in [0, C).

    Returns:
        ``(loss, dlogits)``: a 0-d array, and ``(softmax(logits) - onehot(labels)) / N``.

    Raises:
        ValueError: logits are not 2-D, labels are not shape (N,), or (host arrays only) a
            label is outside [0, C).
        TypeError: labels are not integers.
    """
    _check_labels("softmax_cross_entropy", logits, labels)
    xp = array_module(logits)
    logits = in_float32(logits)
    n = logits.shape[0]
    rows = xp.arange(n)
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_norm = xp.log(xp.exp(shifted).sum(axis=1, keepdims=True))
    log_probs = shifted - log_norm
    loss = xp.asarray(-log_probs[rows, labels].mean())
    dlogits = xp.exp(log_probs)
    dlogits[rows, labels] -= 1.0
    dlogits /= n
    return loss, dlogits


def cross_entropy_tokens(logits, targets):
    """Return the mean cross-entropy over every token of a sequence batch, and its grad.

    The language-model loss (nanoGPT's ``F.cross_entropy(logits.view(-1, V), targets.view(-1))``):
    ``softmax_cross_entropy`` on the B*T rows.

    Args:
        logits: (B, T, V) float array.
        targets: (B, T) integer token ids in [0, V).

    Returns:
        ``(loss, dlogits)``: a 0-d array, and (B, T, V) ``(softmax(logits) - onehot) / (B*T)``.

    Raises:
        ValueError: logits are not 3-D, targets are not (B, T), or (host arrays only) a target
            is outside [0, V).
        TypeError: targets are not integers.
    """
    if logits.ndim != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(f"cross_entropy_tokens: shapes do not match; got logits "
                         f"{tuple(logits.shape)} and targets {tuple(targets.shape)}, expected "
                         f"(B, T, V) and (B, T)")
    rows, labels = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    _check_labels("cross_entropy_tokens", rows, labels)  # so errors name this function
    loss, dlogits = softmax_cross_entropy(rows, labels)
    return loss, dlogits.reshape(logits.shape)


def nll_loss(log_probs, labels):
    """Return the mean negative log-likelihood of integer labels under ``log_probs``, and its grad.

    Args:
        log_probs: (N, C) log-probabilities (e.g. the output of ``LogSoftmax``).
        labels: (N,) integer class indices in [0, C).

    Returns:
        ``(loss, dlog_probs)``: a 0-d array, and an array that is ``-1/N`` at each sample's label
        and 0 elsewhere (16-bit input: both in float32, as for ``softmax_cross_entropy``).

    Raises:
        ValueError: log_probs are not 2-D, labels are not shape (N,), or (host arrays only) a
            label is outside [0, C).
        TypeError: labels are not integers.
    """
    _check_labels("nll_loss", log_probs, labels)
    xp = array_module(log_probs)
    log_probs = in_float32(log_probs)
    n = log_probs.shape[0]
    rows = xp.arange(n)
    loss = xp.asarray(-log_probs[rows, labels].mean())
    dlog_probs = xp.zeros_like(log_probs)
    dlog_probs[rows, labels] = -1.0 / n
    return loss, dlog_probs


def mse_loss(pred, target):
    """Return the mean squared error over all elements, and its grad w.r.t. ``pred``.

    Args:
        pred: float array of any shape.
        target: array of the same shape.

    Returns:
        ``(loss, dpred)``: a 0-d array ``mean((pred - target)**2)``, and
        ``2 * (pred - target) / pred.size`` (16-bit pred: both in float32, as for
        ``softmax_cross_entropy``; a 16-bit square overflows past 256).

    Raises:
        ValueError: the shapes differ.
    """
    if pred.shape != target.shape:
        raise ValueError(f"mse_loss: pred and target shapes differ; got {tuple(pred.shape)} and "
                         f"{tuple(target.shape)}, expected equal shapes")
    xp = array_module(pred)
    diff = in_float32(pred) - in_float32(target)
    loss = xp.asarray((diff * diff).mean())
    dpred = diff * (2.0 / diff.size)
    return loss, dpred

"""Composite: a layer made of named child layers, their parameters under qualified names.

Leaf module: imports ``nn.layers`` only; ``nn.dropout``, ``nn.transformer`` and
``meta_dist.models`` import it. ``ChildParams`` is the view that makes
``block.params["attn.c_attn.weight"]`` the same entry as ``block.attn.c_attn.params["weight"]``,
so ZeRO can rebind a Composite's parameters as it rebinds any layer's.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping

from meta_dist.nn.layers import Layer

RESERVED_NAMES = frozenset({"params", "grads", "children"})  # set by Composite.__init__


class ChildParams(MutableMapping):
    """The ``params`` (or ``grads``) of a Composite: the children's, under qualified names.

    Reads and writes go through to the child's own dict, so rebinding
    ``block.params["attn.c_attn.weight"]`` rebinds ``block.attn.c_attn.params["weight"]``.
    Names are listed in the order backward writes them: children last to first. Names cannot
    be added or removed.
    """

    def __init__(self, children: dict[str, Layer], kind: str) -> None:
        self._children, self._kind = children, kind

    def _locate(self, key: str) -> tuple[MutableMapping, str]:
        head, _, rest = key.partition(".")
        child = self._children.get(head)
        if child is None or rest not in getattr(child, self._kind):
            raise KeyError(f"Composite.{self._kind}: no parameter {key!r}; expected one of "
                           f"{', '.join(self)}")
        return getattr(child, self._kind), rest

    def __getitem__(self, key: str):
        table, rest = self._locate(key)
        return table[rest]

    def __setitem__(self, key: str, value) -> None:
        table, rest = self._locate(key)
        table[rest] = value

    def __delitem__(self, key: str) -> None:
        raise TypeError(f"Composite.{self._kind}: cannot remove {key!r}; a layer's parameters "
                        f"are fixed when it is built")

    def __iter__(self) -> Iterator[str]:
        for name, child in reversed(self._children.items()):
            for rest in getattr(child, self._kind):
                yield f"{name}.{rest}"

    def __len__(self) -> int:
        return sum(len(getattr(child, self._kind)) for child in self._children.values())

    def __repr__(self) -> str:
        return f"ChildParams({self._kind}: {', '.join(self)})"


class Composite(Layer):
    """A layer made of named child layers, run in order by default (last to first in backward).

    ``params`` and ``grads`` are ``ChildParams`` views of the children's. Setting ``training``
    sets it on every child; setting ``input_grad`` sets it on the first child, the one that
    sees the input. Subclasses with another data flow (residuals) override forward/backward and
    must write the children's grads last child first, the order of ``params``. Children may not
    hold buffers (BatchNorm's running statistics): the trainer looks for those on the model's
    own layers only.
    """

    def __init__(self, **children: Layer) -> None:
        """Adopt ``children`` (keyword order is forward order) as attributes of the same name.

        Raises:
            TypeError: a child is not a Layer.
            ValueError: no children, or a child holds buffers.
        """
        api = type(self).__name__
        if not children:
            raise ValueError(f"{api}: no child layers; got none, expected at least one")
        for name, child in children.items():
            if not isinstance(child, Layer):
                raise TypeError(f"{api}: child {name!r} is not a Layer; got "
                                f"{type(child).__name__}")
            if name in RESERVED_NAMES or hasattr(type(self), name):
                raise ValueError(f"{api}: child name {name!r} is taken by an attribute of the "
                                 f"layer; expected another name")
            if child.buffer_names:
                raise ValueError(f"{api}: child {name!r} holds buffers {child.buffer_names}; "
                                 f"expected none; put that layer in the Sequential directly")
        self.children = dict(children)
        self.__dict__.update(children)
        super().__init__()
        self.params = ChildParams(self.children, "params")
        self.grads = ChildParams(self.children, "grads")

    @property
    def training(self) -> bool:
        """Training mode; setting it sets every child's."""
        return self._training

    @training.setter
    def training(self, mode: bool) -> None:
        self._training = mode
        for child in self.children.values():
            child.training = mode

    @property
    def input_grad(self) -> bool:
        """Whether backward returns dx; setting it sets the first child's."""
        return self._input_grad

    @input_grad.setter
    def input_grad(self, value: bool) -> None:
        self._input_grad = value
        next(iter(self.children.values())).input_grad = value

    @property
    def grad_rows(self) -> bool:
        """True when every child with parameters writes its grads by rows (``write_grad``)."""
        return all(child.grad_rows for child in self.children.values() if len(child.params))

    def named_leaves(self, prefix: str = "") -> Iterator[tuple[str, Layer]]:
        """Yield (qualified name, layer) for every non-Composite descendant, in forward order."""
        for name, child in self.children.items():
            if isinstance(child, Composite):
                yield from child.named_leaves(f"{prefix}{name}.")
            else:
                yield f"{prefix}{name}", child

    def forward(self, x):
        """Return the children applied in order."""
        for child in self.children.values():
            x = child.forward(x)
        return x

    def backward(self, dout):
        """Backpropagate through the children last to first; return dx (or None)."""
        for child in reversed(self.children.values()):
            dout = child.backward(dout)
        return dout

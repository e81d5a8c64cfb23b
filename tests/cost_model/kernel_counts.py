"""A dispatch mode that counts the kernels and bytes a rank's ATen calls make, for the tests that
hold the cost model's prices to them (the vocabulary-parallel loss, the expert routing)."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from autotp.cost_model.routing import sort_bytes, sort_launches


def tensor_bytes(tensors) -> int:
    """The bytes of every tensor in ``tensors`` (any nesting)."""
    return sum(t.numel() * t.element_size() for t in tree_leaves(tensors) if isinstance(t, torch.Tensor))


class KernelCounter(TorchDispatchMode):
    """Each non-view ATen call a kernel, with the bytes it touches: its tensor arguments read and
    its results written, except that a fill reads nothing, a copy reads its source alone (the
    destination it writes is its result), a gather (and the ops named in ``picks``:
    ``index_select``, ``index`` of rows) reads only the entries it picks, an in-place scatter,
    ``index_copy_`` or ``index_put_`` writes (and a scatter-add reads) only the entries it writes
    (a scatter of one value: an entry an index entry), and a sort is the radix sort a GPU runs.
    Collectives are communication, allocations no kernel, and ``_unsafe_view`` a view (a
    reshape's of a copy: autograd's aliasing does not mark it one)."""

    def __init__(self, fills: tuple[str, ...], allocations: tuple[str, ...] = (),
                 picks: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.fills, self.allocations = fills, allocations   # op names: filled without a read; no kernel
        self.picks = picks   # op names of gathers that read only the entries they pick (rows, as priced)
        self.launches, self.bytes, self.calls = 0, 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if func.is_view or func.namespace in ("c10d", "_c10d_functional") or name in self.allocations \
                or name == "_unsafe_view":
            return out
        launches = 1
        if name in self.fills:
            moved = tensor_bytes(out)
        elif name == "scatter_" and not isinstance(args[3], torch.Tensor):   # one value: an entry an index
            moved = tensor_bytes(args[2]) + args[2].numel() * args[0].element_size()
        elif name == "scatter_":
            moved = tensor_bytes((args[2], args[3])) + tensor_bytes(args[3])
        elif name == "gather":
            moved = tensor_bytes(args[2]) + 2 * tensor_bytes(out)
        elif name in self.picks:   # index_select(x, dim, index), index(x, [index]): the index, the rows picked
            moved = tensor_bytes(args[1:]) + 2 * tensor_bytes(out)
        elif name == "copy_":   # its source read, its destination written (not read)
            moved = tensor_bytes(args[1]) + tensor_bytes(out)
        elif name == "index_copy_":
            moved = tensor_bytes(args[2]) + 2 * tensor_bytes(args[3])
        elif name == "index_put_":
            moved = tensor_bytes(args[1]) + 2 * tensor_bytes(args[2])
        elif name == "scatter_add_":
            moved = tensor_bytes((args[2], args[3])) + 2 * tensor_bytes(args[3])
        elif name == "sort":
            keys = args[0]
            moved, launches = sort_bytes(keys.numel(), keys.element_size()), sort_launches(keys.element_size())
        else:
            moved = tensor_bytes((args, kwargs)) + tensor_bytes(out)
        self.launches += launches
        self.bytes += moved
        self.calls.append((name, moved))
        return out

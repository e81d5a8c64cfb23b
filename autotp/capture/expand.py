"""Cut and expand: capture a model's stack of alike blocks at three blocks (later: one), then grow the graph.

torch.export costs time in proportion to the ops it traces, and most of a transformer's ops
are its N alike blocks. This module exports the model with every such stack cut to its first
few blocks, then writes the rest into the graph by copying the last kept blocks' nodes, so the
result is the graph a full export gives (same placeholders in the same order, same ops, same
inputs and outputs).

A stack's blocks may repeat with a **period** p > 1 rather than each alike the one before:
gpt-oss and Gemma 2 alternate sliding-window and full attention (p = 2), Gemma 3 has five
sliding layers to a full one (p = 6), ModernBERT a global layer every three (p = 3). What is
said of blocks below is said of periods then; p = 1 is the plain stack. With N blocks, the
first capture keeps ``kept = h + 2p`` of them (:meth:`Stack.kept`): a *head* of
``h = 1 + (N - 1) % p`` blocks (block 0, and as many more as leave the rest whole periods: 1
for p = 1), *period 1* (blocks ``h..h+p-1``) and *period 2* (``h+p..kept-1``), which must
repeat period 1 and is the template of the rest. For p = 1 that is :data:`KEEP` = 3 blocks.

1. **Find the stacks** (:func:`find_stacks`): an ``nn.ModuleList`` of more than ``KEEP``
   modules of one class, whose blocks 1..N-1 repeat with the smallest period p (up to
   :data:`MAX_PERIOD`) for which the stack has more blocks than the cut keeps: block i is alike
   block i - p, i.e. the same submodule tree and classes, parameter and buffer names, shapes
   and dtypes, and the same plain attributes, except ints that count with the block
   (``layer_idx``: block i holds ``i + c``). The period is read off these descriptions (a
   sliding window set on the odd layers' attention), never off a model's name. Block 0 may
   differ (T5's relative attention bias, ModernBERT's missing attention norm). No block's
   tensors or modules may be shared with the rest of the model, and no module may have hooks.
2. **Cut** (:func:`cut`): each stack is replaced by a ``ModuleList`` of its first ``kept``
   blocks; in every HuggingFace config the model holds, an int field named like a layer count
   (``n_layer``, ``num_hidden_layers``, ``num_decoder_layers``) equal to a stack's length is set
   to ``kept``, and a per-layer list (``layer_types``) of that length is cut to its first
   ``kept`` entries; its entries 1..N-1 must repeat with the stack's period (entry i equal to
   entry i - p: for p = 1, all equal), since a forward may read it (gpt-oss picks each layer's
   mask by ``layer_types[i]``). Everything is restored afterwards.
3. **Check** (:func:`expand`): in the cut graph, block i's *segment* runs from the node after
   block i-1's last node to block i's last node (a block's nodes are those whose module path
   is under ``stack.i``; the parent's per-iteration ops fall in between), and a period's is
   its blocks' segments in turn. Period 2's segment must repeat period 1's node for node:
   same op, same constant arguments, the module path shifted by p blocks, parameters of block
   i replaced by block i + p's, nodes of period 1 by their counterparts, and every other input
   either the very same node (shared: a mask, rotary tables, T5's position bias) or,
   consistently, a node of period 1 standing for one before it (the recurrence: the hidden
   state); each node's value has its counterpart's shape and dtype (the copies take period
   2's). No node of period 1 may be used after period 2, and no node may follow the stack
   with a module path inside it.
4. **Expand**: blocks ``kept..N-1`` are copies of period 2's segment, a period at a time, with
   its parameters renamed to the blocks' FQNs (placeholders named as torch.export names them,
   ``p_`` + the FQN with dots as underscores, checked on the cut graph), its recurrent inputs
   taken from the previous copy and its module paths shifted; what followed the stack reads the
   last copy.

:func:`expand` takes ``keep``: a model captured before, whose three-block check held, is cut
further where its stacks have a period of 1 and block 0 is alike the rest
(:attr:`Stack.uniform`; see :func:`autotp.capture._export_cut`):

* to **one** block where that first capture learned a :class:`Template` of the stack's block
  calls (from torch.export's record of each block call's arguments and results: which argument
  every block shares, which it takes from the block before). Block 0's call must match it, its
  ops read nothing but its call's arguments, parameters, buffers and sizes, and what
  follows the stack reads its results where the template's capture read the last block's
  (:func:`_one_block`); blocks 1..N-1 are copies of block 0;
* else to **two**, and block 1's segment is checked against block 0's own nodes.

A stack with a period over 1 stays at its first cut (head and two periods) on later captures
too: two periods from block 0 fail the check wherever block 0 computes a size every block
then reads (gpt-oss's experts: a product of symbolic sizes), so the try would
cost a wasted export; and one period would need a template of a period's calls. gpt-oss-20b
(24 layers) is exported with 6 of them: its capture at tp 8 takes 2.8-3.3 s against 6.9 s
whole (``benchmarks/moe_plan_speed.md``).

Any check that fails raises :class:`NotExpandable`, and :func:`autotp.capture.capture` exports
the whole model instead (logged at debug level). ``tests/test_capture_expand.py`` compares the
result with a full capture (graph, outputs, plan) for GPT-2, Llama, BERT and T5, and for
gpt-oss, Gemma 2, Gemma 3 and ModernBERT (periods of 2, 2, 6 and 3).
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import fx, nn

from .program import module_path
from .structure import _TORCH_BOOKKEEPING, Uncacheable, _describe, _qualname

#: blocks kept per stack of period 1 in the first cut capture: block 0 (may differ), block 1,
#: and block 2 that must repeat block 1 and is the template of the rest; also the name of that
#: cut for any period (:meth:`Stack.kept`)
KEEP = 3

#: config fields that count a stack's layers
_LAYER_COUNT = re.compile(r"(^|_)(n_layers?|num_layers|num_hidden_layers|num_\w*_layers|n_\w*_layers?)$")


class NotExpandable(Exception):
    """The model or its cut graph does not allow cut and expand; capture it whole."""


#: the longest period of blocks looked for (gpt-oss and Gemma 2 alternate two kinds, Gemma 3 six)
MAX_PERIOD = 8


@dataclass
class Stack:
    path: str                # "transformer.h"
    parent: nn.Module
    attr: str
    blocks: list             # the full list's modules
    original: nn.ModuleList
    uniform: bool = False    # block 0 is alike block ``period`` too (T5's is not)
    period: int = 1          # block i is alike block i - period (i > period)

    @property
    def n(self) -> int:
        return len(self.blocks)

    def kept(self, keep: int = KEEP) -> int:
        """The blocks the cut ``keep`` keeps: for :data:`KEEP`, a head of 1..period blocks
        (block 0, and as many more as align the rest to whole periods) and two periods; 2 and
        1 (the later captures' cuts) for a period of 1 only."""
        p = self.period
        if keep == KEEP:
            return 1 + (self.n - 1) % p + 2 * p
        if keep in (1, 2) and p == 1:
            return keep
        raise NotExpandable(f"{self.path}: its blocks repeat every {p}; it is cut to three periods only")


# ---- 1. finding the stacks -----------------------------------------------------------------

def find_stacks(model: nn.Module) -> list[Stack]:
    """The model's cuttable stacks, outermost first (empty when it has none)."""
    modules = dict(model.named_modules(remove_duplicate=False))
    if any(m._forward_hooks or m._forward_pre_hooks or getattr(m, "_backward_hooks", None)
           or getattr(m, "_backward_pre_hooks", None) for m in modules.values()):
        return []
    owners: dict[int, list[str]] = {}
    for path, m in modules.items():
        owners.setdefault(id(m), []).append(path)
    tensor_owners: dict[int, list[str]] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        tensor_owners.setdefault(id(t), []).append(name)
    stacks: list[Stack] = []
    for path, mod in modules.items():
        if type(mod) is not nn.ModuleList or len(mod) <= KEEP or not path:
            continue
        if any(path.startswith(s.path + ".") for s in stacks) or len(owners[id(mod)]) != 1:
            continue
        blocks = list(mod)
        if len({type(b) for b in blocks}) != 1 or not _own(path, blocks, owners, tensor_owners):
            continue
        try:
            described = [_describe_block(b) for b in blocks]
        except Uncacheable:
            continue
        period = _period(described)
        if period is None:
            continue
        parent_path, _, attr = path.rpartition(".")
        stacks.append(Stack(path, modules[parent_path] if parent_path else model, attr, blocks, mod,
                            uniform=_alike(described, (0, period)), period=period))
    return stacks


def _period(described: list) -> int | None:
    """The smallest period p (up to :data:`MAX_PERIOD`) with which blocks 1.. repeat (block i
    alike block i - p), among those where the stack has more blocks than a cut keeps."""
    n = len(described)
    for p in range(1, MAX_PERIOD + 1):
        if n > 1 + (n - 1) % p + 2 * p and _repeats(described, 1, p):
            return p
    return None


def _own(path: str, blocks: list, owners: dict, tensor_owners: dict) -> bool:
    """No block shares a module or a tensor with the rest of the model."""
    for i, block in enumerate(blocks):
        prefix = f"{path}.{i}"
        for sub in block.modules():
            if any(not (p == prefix or p.startswith(prefix + ".")) for p in owners.get(id(sub), [])):
                return False   # a module shared with the rest of the model
        for _, t in [*block.named_parameters(remove_duplicate=False), *block.named_buffers(remove_duplicate=False)]:
            if any(not n.startswith(prefix + ".") for n in tensor_owners.get(id(t), [])):
                return False   # a tied tensor
    return True


def _repeats(described: list, start: int, period: int = 1) -> bool:
    """Blocks ``start..`` of ``described`` (one description per block) repeat with ``period``:
    each is alike the block ``period`` before it (:func:`_alike`)."""
    return all(_alike(described, range(r, len(described), period)) for r in range(start, start + period))


def _alike(described: list, indices: Any) -> bool:
    """The blocks at ``indices`` are alike: the same entries, equal but for ints that count with
    the block (block i holds ``i + c``)."""
    indices = list(indices)
    first = described[indices[0]]
    if any(len(described[i]) != len(first) for i in indices[1:]):
        return False
    for k, (key, text, _) in enumerate(first):
        column = [described[i][k] for i in indices]
        if any(c[0] != key for c in column):
            return False
        if all(c[1] == text for c in column):
            continue
        values = [c[2] for c in column]   # allowed to differ: an int that counts with the block
        if not all(type(v) is int for v in values):
            return False
        if len({v - i for i, v in zip(indices, values)}) != 1:
            return False
    return True


def _describe_block(block: nn.Module) -> list[tuple[str, str, Any]]:
    out: list[tuple[str, str, Any]] = []
    for rel, m in block.named_modules(remove_duplicate=False):
        out.append((f"M {rel}", f"{_qualname(type(m))} training={m.training}", None))
        for attr, value in sorted(vars(m).items()):
            if attr not in _TORCH_BOOKKEEPING:
                out.append((f"A {rel}.{attr}", _describe(value, f"{rel}.{attr}"), value))
    for name, p in block.named_parameters(remove_duplicate=False):
        out.append((f"P {name}", f"{tuple(p.shape)} {p.dtype} {p.device.type} {p.requires_grad}", None))
    for name, b in block.named_buffers(remove_duplicate=False):
        out.append((f"B {name}", f"{tuple(b.shape)} {b.dtype} {b.device.type}", None))
    return out


# ---- 2. cutting ----------------------------------------------------------------------------

def _configs(model: nn.Module) -> list[Any]:
    seen: dict[int, Any] = {}
    for m in model.modules():
        for value in vars(m).values():
            if hasattr(value, "to_json_string") and hasattr(value, "to_dict"):
                seen.setdefault(id(value), value)
    for cfg in list(seen.values()):   # sub-configs (text_config, encoder/decoder configs)
        for value in vars(cfg).values():
            if hasattr(value, "to_json_string") and hasattr(value, "to_dict"):
                seen.setdefault(id(value), value)
    return list(seen.values())


def _config_patches(model: nn.Module, stacks: list[Stack], keep: int = KEEP) -> list[tuple[Any, str, Any]]:
    by_length: dict[int, set] = {}
    for s in stacks:
        by_length.setdefault(s.n, set()).add((s.kept(keep), s.period))
    patches = []
    for cfg in _configs(model):
        for name, value in vars(cfg).items():
            counts = type(value) is int and value in by_length and _LAYER_COUNT.search(name)
            listed = isinstance(value, (list, tuple)) and len(value) in by_length and "layer" in name.lower()
            if not (counts or listed):
                continue
            cuts = by_length[len(value) if listed else value]
            if len(cuts) != 1:
                raise NotExpandable(f"config field {name} counts stacks of {value} layers cut to different lengths")
            ((kept, period),) = cuts
            if counts:
                patches.append((cfg, name, kept))
                continue
            first = 0 if keep < 2 else 1   # block 0 is the template of the rest when it is kept alone
            if any(value[i] != value[i - period] for i in range(first + period, len(value))):
                raise NotExpandable(f"config field {name} differs between layers"
                                    + (f" (not every {period} layers alike)" if period > 1 else ""))
            patches.append((cfg, name, type(value)(value[:kept])))
    return patches


@contextlib.contextmanager
def cut(model: nn.Module, stacks: list[Stack], keep: int = KEEP) -> Iterator[None]:
    """``model`` with every stack cut to its first ``keep`` blocks (and its configs to match).

    A forward that hooks the model's modules while it runs (HuggingFace's output capturing,
    when a config asks for every layer's hidden states or attention weights, hooks each module
    once and marks the model hooked) would hook the kept blocks alone and leave the model
    marked: those hooks and marks are taken off again, and the cut raises
    :class:`NotExpandable` (the whole model is exported, and hooked, instead)."""
    patches = _config_patches(model, stacks, keep)
    saved = [(cfg, name, cfg.__dict__[name]) for cfg, name, _ in patches]
    modules = list(model.modules())
    before = [(m, set(vars(m)), {k: set(d) for k, d in _hook_dicts(m)}) for m in modules]
    try:
        for s in stacks:
            short = nn.ModuleList(s.blocks[:s.kept(keep)])
            short.training = s.original.training
            s.parent._modules[s.attr] = short
        for cfg, name, value in patches:
            cfg.__dict__[name] = value   # past HF's __setattr__: its checks see a half-patched config
        yield
    finally:
        for s in stacks:
            s.parent._modules[s.attr] = s.original
        for cfg, name, value in saved:
            cfg.__dict__[name] = value
        hooked = _unhook(before)
    if hooked:
        raise NotExpandable(f"the forward hooked {hooked} while the model was cut")


def _hook_dicts(m: nn.Module) -> list[tuple[str, dict]]:
    return [(k, v) for k, v in vars(m).items() if k.startswith(("_forward", "_backward")) and isinstance(v, dict)]


def _unhook(before: list) -> str | None:
    """Take off the hooks and attributes a forward added to the modules of ``before``; the
    first such module's description, or None when none was added."""
    found = None
    for m, attrs, hooks in before:
        added = [k for k in vars(m) if k not in attrs]
        for k, d in _hook_dicts(m):
            for key in [key for key in d if key not in hooks.get(k, set())]:
                del d[key]
                added.append(k)
        for k in added:
            if k in vars(m) and k not in attrs:
                delattr(m, k)
        if added and found is None:
            found = f"{type(m).__name__} ({', '.join(sorted(set(added)))})"
    return found


# ---- 3./4. checking and expanding the graph ------------------------------------------------

def placeholder_name(kind: str, fqn: str) -> str:
    """torch.export's placeholder name for a lifted parameter ("p_"), buffer ("b_") or constant ("c_")."""
    return kind + re.sub(r"[^a-zA-Z0-9]", "_", fqn).lower()


def _shift(text: str, stack: str, src: int, dst: Any, period: int = 1) -> str:
    """``text`` with the paths of blocks ``src..src+period-1`` of ``stack`` moved to
    ``dst..``; a str ``dst`` is a marker: block ``src + j`` becomes ``dst + j + dst``."""
    if period == 1:
        return re.sub(rf"(?<![^._]){re.escape(stack)}\.{src}(?=\.|$)", f"{stack}.{dst}", text)

    def moved(m: re.Match) -> str:
        j = int(m.group(1)) - src
        if not 0 <= j < period:
            return m.group(0)
        return f"{stack}.{dst}{j}{dst}" if isinstance(dst, str) else f"{stack}.{dst + j}"

    return re.sub(rf"(?<![^._]){re.escape(stack)}\.(\d+)(?=\.|$)", moved, text)


def _shift_fqn(fqn: str, stack: str, src: int, dst: int, period: int = 1) -> str | None:
    """The FQN ``fqn`` of block ``src + j`` (``0 <= j < period``) as block ``dst + j``'s; None
    for any other."""
    if period == 1:
        prefix = f"{stack}.{src}."
        return f"{stack}.{dst}.{fqn[len(prefix):]}" if fqn.startswith(prefix) else None
    if not fqn.startswith(stack + "."):
        return None
    head, _, rest = fqn[len(stack) + 1:].partition(".")
    if not (head.isdigit() and rest and 0 <= int(head) - src < period):
        return None
    return f"{stack}.{dst + int(head) - src}.{rest}"


@dataclass
class Expanded:
    graph_module: fx.GraphModule
    params: dict[str, str]     # placeholder name -> FQN, full model's order
    buffers: dict[str, str]
    constants: dict[str, str]
    stacks: tuple              # the stacks' paths
    #: stack path -> its :class:`Template` (None where none was learned); from a program cut
    #: to :data:`KEEP` blocks only
    templates: dict


def expand(ep: torch.export.ExportedProgram, model: nn.Module, stacks: list[Stack], keep: int = KEEP,
           templates: dict | None = None) -> Expanded:
    """The full model's graph from the program ``ep`` of the model cut to ``keep`` blocks (see
    the module docs). ``keep`` 1 needs each stack's :class:`Template` (``templates``: stack
    path -> template) and ``ep`` exported with block 0's call signature preserved; a program
    cut to :data:`KEEP` blocks whose blocks' signatures were preserved gives its stacks'
    templates in :attr:`Expanded.templates`."""
    from torch.export.graph_signature import InputKind

    kinds = {InputKind.PARAMETER: "p_", InputKind.BUFFER: "b_"}
    cut_params: dict[str, str] = {}
    cut_buffers: dict[str, str] = {}
    consts: dict[str, str] = {}
    for spec in ep.graph_signature.input_specs:
        if spec.kind in kinds:
            if spec.arg.name != placeholder_name(kinds[spec.kind], spec.target):
                raise NotExpandable(f"placeholder {spec.arg.name} is not named after {spec.target}")
            (cut_params if spec.kind == InputKind.PARAMETER else cut_buffers)[spec.target] = spec.arg.name
        elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
            consts[spec.arg.name] = spec.target
        elif spec.kind != InputKind.USER_INPUT:
            raise NotExpandable(f"input kind {spec.kind}")

    def dropped(fqn: str) -> bool:
        return any(fqn.startswith(f"{s.path}.{k}.") for s in stacks for k in range(s.kept(keep), s.n))

    full_params = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    full_buffers = [n for n, _ in model.named_buffers(remove_duplicate=False)]
    if [n for n in full_params if not dropped(n)] != list(cut_params):
        raise NotExpandable("the cut program's parameters are not the model's in order")
    if [n for n in full_buffers if not dropped(n)] != list(cut_buffers):
        raise NotExpandable("the cut program's buffers are not the model's in order")

    old = ep.graph_module.graph
    old_ph = {n.name: n for n in old.nodes if n.op == "placeholder"}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    params: dict[str, str] = {}
    buffers: dict[str, str] = {}
    by_fqn: dict[str, fx.Node] = {}
    for kind, names, cut_names, out in (("p_", full_params, cut_params, params),
                                        ("b_", full_buffers, cut_buffers, buffers)):
        for fqn in names:
            if fqn in cut_names:
                node = graph.node_copy(old_ph[cut_names[fqn]])
                env[old_ph[cut_names[fqn]]] = node
            else:
                stack = next(s for s in stacks if fqn.startswith(s.path + "."))
                k = int(fqn[len(stack.path) + 1:].split(".", 1)[0])
                kept, p = stack.kept(keep), stack.period   # block k is a copy of this one
                template = old_ph[cut_names[_shift_fqn(fqn, stack.path, k, kept - p + (k - kept) % p)]]
                node = graph.placeholder(placeholder_name(kind, fqn))
                if node.name != placeholder_name(kind, fqn):
                    raise NotExpandable(f"placeholder name {placeholder_name(kind, fqn)} is taken")
                node.meta = dict(template.meta)
            out[node.name] = fqn
            by_fqn[fqn] = node
    lifted = set(cut_params.values()) | set(cut_buffers.values())
    for n in old.nodes:
        if n.op == "placeholder" and n.name not in lifted:
            env[n] = graph.node_copy(n)
        elif n.op != "placeholder":
            env[n] = graph.node_copy(n, lambda a: env[a])
    fqn_of = {node: fqn for fqn, node in by_fqn.items()}
    calls = {e.fqn: e.signature for e in ep.module_call_graph if e.signature is not None}
    learned = {}
    for stack in stacks:
        learned[stack.path] = _expand_stack(graph, stack, by_fqn, fqn_of, keep, calls,
                                            (templates or {}).get(stack.path))
    graph.lint()
    # the cut program's module takes the grown graph: it holds the submodules its get_attr nodes
    # name; its code is generated once, by capture's last step (fx's graph setter would
    # generate it here too, for a graph that capture then edits)
    gm = ep.graph_module
    gm._graph = graph
    graph.owning_module = gm
    return Expanded(gm, params, buffers, consts, tuple(s.path for s in stacks),
                    learned if keep == KEEP else {})


def _block_of(node: fx.Node, stack: str) -> int | None:
    path = module_path(node)
    if path.startswith(stack + "."):
        head = path[len(stack) + 1:].split(".", 1)[0]
        if head.isdigit():
            return int(head)
    return None


def _segments(graph: fx.Graph, stack: Stack, keep: int) -> tuple[list, list[int], list[int]]:
    """The graph's nodes, and the first and last position of each of the ``keep`` blocks' ops."""
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    block = {n: _block_of(n, stack.path) for n in nodes if n.op == "call_function"}
    ends, starts = [], []
    for i in range(keep):
        mine = [pos[n] for n, b in block.items() if b == i]
        if not mine:
            raise NotExpandable(f"{stack.path}.{i} has no ops in the graph")
        starts.append(min(mine))
        ends.append(max(mine))
    if any(b is not None and b >= keep for b in block.values()):
        raise NotExpandable(f"{stack.path} has ops of blocks past {keep - 1}")
    for i in range(1, keep):
        if starts[i] <= ends[i - 1]:
            raise NotExpandable(f"{stack.path}.{i} interleaves with the block before it")
    return nodes, starts, ends


def _compare(seg1: list, seg2: list, stack: Stack, one: int, two: int, by_fqn: dict,
             fqn_of: dict, period: int = 1) -> tuple[dict, dict]:
    """Check that ``seg2`` (the segment of blocks ``two..two+period-1``) repeats ``seg1`` (that
    of blocks ``one..``) node for node; return ``phi`` (seg1 node -> its seg2 counterpart) and
    ``rec`` (an input of seg1 from before it -> the seg1 node seg2 reads in its place: the
    recurrence)."""
    if len(seg1) != len(seg2) or not seg2:
        raise NotExpandable(f"{stack.path}: block {two}'s segment has {len(seg2)} nodes, block {one}'s {len(seg1)}")
    in1, in2 = set(seg1), set(seg2)
    phi: dict[fx.Node, fx.Node] = {}
    rec: dict[fx.Node, fx.Node] = {}

    def match(xa: Any, xb: Any) -> bool:
        if isinstance(xa, fx.Node) or isinstance(xb, fx.Node):
            if not (isinstance(xa, fx.Node) and isinstance(xb, fx.Node)):
                return False
            if xa in in1:
                return phi.get(xa) is xb
            if xa.op == "placeholder" and xa in fqn_of:   # a parameter or buffer: block one's is block two's
                shifted = _shift_fqn(fqn_of[xa], stack.path, one, two, period)
                return xb is (by_fqn.get(shifted) if shifted is not None else xa)
            if xb is xa:
                return True
            if xb in in1 and rec.setdefault(xa, xb) is xb:
                return True
            return False
        if type(xa) is not type(xb):
            return False
        if isinstance(xa, (list, tuple)):
            return len(xa) == len(xb) and all(match(a, b) for a, b in zip(xa, xb))
        if isinstance(xa, dict):
            return xa.keys() == xb.keys() and all(match(xa[k], xb[k]) for k in xa)
        return xa == xb

    for a, b in zip(seg1, seg2):
        if a.op != "call_function" or b.op != "call_function" or a.target != b.target:
            raise NotExpandable(f"{stack.path}: {b.name} ({b.target}) does not repeat {a.name} ({a.target})")
        if [_shift(p, stack.path, one, two, period) for p in _stack_paths(a)] != _stack_paths(b):
            raise NotExpandable(f"{stack.path}: {b.name}'s module path does not repeat {a.name}'s")
        if not (match(a.args, b.args) and match(a.kwargs, b.kwargs)):
            raise NotExpandable(f"{stack.path}: the inputs of {b.name} do not repeat those of {a.name}")
        if _shape_key(a) != _shape_key(b):   # the copies take segment 2's shapes
            raise NotExpandable(f"{stack.path}: {b.name} is {_shape_key(b)}, {a.name} {_shape_key(a)}")
        phi[a] = b
    for n in seg1:
        if any(u not in in1 and u not in in2 for u in n.users):
            raise NotExpandable(f"{stack.path}: {n.name} of block {one} is used after block {two}")
    return phi, rec


def _expand_stack(graph: fx.Graph, stack: Stack, by_fqn: dict, fqn_of: dict, keep: int,
                  calls: dict | None = None, template: "Template | None" = None) -> "Template | None":
    """Blocks ``kept..`` of ``stack`` (``kept``: :meth:`Stack.kept`) written into ``graph`` as
    copies of the segment of its last kept period (*seg2* below), once it is checked to repeat
    the period before (*seg1*), a period at a time.

    ``keep`` 1 takes the recurrence from ``template`` and the block's call signature
    (``calls``: block path -> its signature in the export), see :func:`_one_block`. Where
    ``keep`` is :data:`KEEP` and the signatures were recorded, returns the stack's
    :class:`Template` (None if its blocks' calls do not allow one; always for a period over 1)."""
    kept, p = stack.kept(keep), stack.period
    nodes, starts, ends = _segments(graph, stack, kept)
    two = kept - p   # the first block of seg2
    learned = None
    if keep == 1:
        seg2 = nodes[starts[0]: ends[0] + 1]
        tail = nodes[ends[0] + 1:]
        feeds = _one_block(seg2, tail, stack, calls or {}, template, fqn_of)
    else:
        one = two - p   # the first block of seg1; the blocks before it are the head, kept as they are
        # block 0's segment is its own ops: what comes before it is the parent's, run once
        seg1 = nodes[(ends[one - 1] + 1 if one else starts[0]): ends[two - 1] + 1]
        seg2 = nodes[ends[two - 1] + 1: ends[kept - 1] + 1]
        tail = nodes[ends[kept - 1] + 1:]
        phi, rec = _compare(seg1, seg2, stack, one, two, by_fqn, fqn_of, p)
        # segment 2 reads a segment-1 node where segment 1 read one from before it; copy k reads
        # copy k-1's counterpart of that node
        feeds = {b: phi[b] for b in rec.values()}
        if keep == KEEP and calls and p == 1:
            learned = _learn(nodes, starts, ends, tail, stack, calls, by_fqn, fqn_of)

    marker = "\0"   # where the block index goes in segment 2's module paths (block two + j: marker j marker)
    stacks_of = {n: [(_shift(key, stack.path, two, marker, p), _shift(path, stack.path, two, marker, p), t)
                     for key, (path, t) in (n.meta.get("nn_module_stack") or {}).items()] for n in seg2}
    last = {n: n for n in seg2}
    anchor = tail[0]
    for k in range(kept, stack.n, p):   # the copy of blocks k..k+p-1
        copies: dict[fx.Node, fx.Node] = {}
        previous = {read: last[src] for read, src in feeds.items()}

        def arg(x: fx.Node) -> fx.Node:
            if x in copies:
                return copies[x]
            if x in previous:
                return previous[x]
            if x.op == "placeholder" and x in fqn_of:
                shifted = _shift_fqn(fqn_of[x], stack.path, two, k, p)
                if shifted is not None:
                    return by_fqn[shifted]
            return x

        indices = [(f"{marker}{j}{marker}" if p > 1 else marker, str(k + j)) for j in range(p)]

        def moved(text: str) -> str:
            for mark, index in indices:
                text = text.replace(mark, index)
            return text

        with graph.inserting_before(anchor):
            for n in seg2:
                c = graph.node_copy(n, arg)
                c.meta = dict(n.meta)
                if stacks_of[n]:
                    c.meta["nn_module_stack"] = {moved(key): (moved(path), t) for key, path, t in stacks_of[n]}
                copies[n] = c
        last = copies
    after = set(tail)
    for n in seg2:
        for user in list(n.users):
            if user in after:
                user.replace_input_with(n, last[n])
    return learned


# ---- one block: the recurrence from an earlier capture's block calls -----------------------------

@dataclass(frozen=True)
class Template:
    """How a stack's parent calls its blocks, learned from a capture cut to :data:`KEEP` blocks
    whose check held (and whose block 0 repeats block 1 too): the call's argument and result
    structure, and for each flat argument whether every block gets the same value
    (``("shared",)``, ``("const", value)``) or the previous block's result number ``o``
    (``("rec", o)``). ``tail``: where what follows the stack reads each result of the last
    block, and each recurrent argument of the first (:func:`_tail_reads`)."""
    in_spec: Any
    out_spec: Any
    inputs: tuple
    tail: tuple


def _call_args(sig: Any) -> list[tuple]:
    """A block call's flat arguments (or results) as ("t", node name) for a tensor or symbolic
    value, ("c", value) for a constant."""
    from torch.export.graph_signature import ConstantArgument

    out = []
    for a in sig:
        if isinstance(a, ConstantArgument):
            out.append(("c", a.value))
        elif type(a).__name__ in ("TensorArgument", "SymIntArgument", "SymFloatArgument", "SymBoolArgument"):
            out.append(("t", a.name))
        else:
            raise NotExpandable(f"a block call's argument is a {type(a).__name__}")
    return out


def _tail_reads(tail: list, node: fx.Node | None) -> tuple:
    """Where the nodes of ``tail`` read ``node``: (op, place in its arguments) for each read,
    sorted (a model that collects every block's result reads the last one at another place)."""
    if node is None:
        return ()
    after = set(tail)
    found: list[tuple] = []

    def walk(a: Any, user: fx.Node, path: tuple) -> None:
        if a is node:
            found.append((user.op, str(user.target), path))
        elif isinstance(a, (list, tuple)):
            for i, x in enumerate(a):
                walk(x, user, path + (i,))
        elif isinstance(a, dict):
            for k, x in a.items():
                walk(x, user, path + (k,))

    for user in node.users:
        if user in after:
            walk(user.args, user, ("args",))
            walk(user.kwargs, user, ("kwargs",))
    return tuple(sorted(found, key=repr))


def _learn(nodes: list, starts: list, ends: list, tail: list, stack: Stack, calls: dict,
           by_fqn: dict, fqn_of: dict) -> "Template | None":
    """The stack's :class:`Template` from a capture cut to :data:`KEEP` blocks (checked), or
    None where block 0's segment does not repeat in block 1 or its calls do not fit one."""
    sigs = [calls.get(f"{stack.path}.{i}") for i in range(KEEP)]
    if any(s is None for s in sigs) or len({(str(s.in_spec), str(s.out_spec)) for s in sigs}) != 1:
        return None
    try:
        _compare(nodes[starts[0]: ends[0] + 1], nodes[ends[0] + 1: ends[1] + 1], stack, 0, 1, by_fqn, fqn_of)
        ins = [_call_args(s.inputs) for s in sigs]
        outs = [_call_args(s.outputs) for s in sigs]
    except NotExpandable:
        return None
    named = {n.name: n for n in nodes}
    kinds, recurrent = [], []
    for a0, a1, a2 in zip(*ins):
        if a0[0] == a1[0] == a2[0] == "c" and a0[1] == a1[1] == a2[1] and type(a0[1]) in _CONSTANTS:
            kinds.append(("const", a0[1]))
        elif a0[0] == a1[0] == a2[0] == "t" and a0[1] == a1[1] == a2[1]:
            kinds.append(("shared",))
        elif a0[0] == a1[0] == a2[0] == "t" and a1 in outs[0] and a2 in outs[1] \
                and outs[0].index(a1) == outs[1].index(a2):
            kinds.append(("rec", outs[0].index(a1)))
            recurrent.append(named.get(a0[1]))
        else:
            return None
    if not any(k[0] == "rec" for k in kinds):
        return None
    tail_reads = tuple(_tail_reads(tail, named.get(o[1]) if o[0] == "t" else None) for o in outs[2])
    return Template(sigs[0].in_spec, sigs[0].out_spec, tuple(kinds),
                    tail_reads + tuple(_tail_reads(tail, x) for x in recurrent))


#: constant block arguments a template compares by value
_CONSTANTS = (type(None), bool, int, float, str)


def _one_block(seg: list, tail: list, stack: Stack, calls: dict, template: "Template | None",
               fqn_of: dict) -> dict:
    """The recurrence of a capture cut to one block: ``{argument node: result node}`` for
    each argument the next block takes from this block's results, read off block 0's call
    signature where it matches ``template``. Refused (:class:`NotExpandable`) unless block 0's
    ops read nothing from outside but its call's arguments, its own and the model's parameters
    and buffers, and sizes; each recurrent argument has its result's shape and dtype; and what
    follows the stack reads the block's results (and the stack's input) as the template's
    capture did."""
    sig = calls.get(f"{stack.path}.0")
    if template is None or sig is None:
        raise NotExpandable(f"{stack.path}: no template of its block calls")
    if (str(sig.in_spec), str(sig.out_spec)) != (str(template.in_spec), str(template.out_spec)):
        raise NotExpandable(f"{stack.path}: block 0 is called with another argument structure")
    ins, outs = _call_args(sig.inputs), _call_args(sig.outputs)
    if len(ins) != len(template.inputs):
        raise NotExpandable(f"{stack.path}: block 0 takes {len(ins)} arguments, the template {len(template.inputs)}")
    named = {n.name: n for n in seg}
    before = {n.name: n for n in seg[0].graph.nodes}
    feeds: dict[fx.Node, fx.Node] = {}
    passed: set[fx.Node] = set()
    recurrent = []
    for (kind, value), want in zip(ins, template.inputs):
        if want[0] == "const":
            if kind != "c" or type(value) is not type(want[1]) or value != want[1]:
                raise NotExpandable(f"{stack.path}: block 0 takes {value!r} where the template's took {want[1]!r}")
            continue
        if kind != "t" or value not in before:
            raise NotExpandable(f"{stack.path}: block 0 takes {value!r} where the template's took a tensor")
        passed.add(before[value])
        if want[0] == "rec":
            o = outs[want[1]] if want[1] < len(outs) else ("c", None)
            if o[0] != "t" or o[1] not in named:
                raise NotExpandable(f"{stack.path}: block 0's result {want[1]} is not one of its ops")
            x, y = before[value], named[o[1]]
            if _shape_key(x) != _shape_key(y):   # a block that changes the shape reads sizes of its own
                raise NotExpandable(f"{stack.path}: block 0 turns {_shape_key(x)} into {_shape_key(y)}")
            feeds[x] = y
            recurrent.append(x)
    inside = set(seg)
    for n in seg:
        if n.op != "call_function" or _block_of(n, stack.path) != 0:
            raise NotExpandable(f"{stack.path}: {n.name} in block 0's segment is not one of its ops")
        for x in n.all_input_nodes:
            if x in inside or x in passed or not isinstance(x.meta.get("val"), torch.Tensor):
                continue   # its own, an argument, or a size
            if x.op == "placeholder" and x in fqn_of:
                if fqn_of[x].startswith(f"{stack.path}.") and not fqn_of[x].startswith(f"{stack.path}.0."):
                    raise NotExpandable(f"{stack.path}: block 0 reads {fqn_of[x]}")
                continue   # its own parameter or buffer (each copy reads its block's), or the model's
            # a lifted constant may be made per block (torch.tensor(self.layer_idx)): one block
            # cannot tell, two can (they read one node or two)
            raise NotExpandable(f"{stack.path}: block 0 reads {x.name}, which its call does not pass")
    results = {named[o[1]] for o in outs if o[0] == "t" and o[1] in named}
    after = set(tail)
    for n in seg:
        if n not in results and any(u in after for u in n.users):
            raise NotExpandable(f"{stack.path}: {n.name} of block 0 is read after the stack")
    reads = tuple(_tail_reads(tail, named.get(o[1]) if o[0] == "t" else None) for o in outs) \
        + tuple(_tail_reads(tail, x) for x in recurrent)
    if reads != template.tail:
        raise NotExpandable(f"{stack.path}: what follows the stack reads block 0's results {reads}, "
                            f"the template's capture {template.tail}")
    return feeds


def _shape_key(node: fx.Node) -> Any:
    """What a node's value is: shape (symbolic sizes as text) and dtype, for each tensor."""
    def key(val: Any) -> Any:
        if isinstance(val, torch.Tensor):
            return str(tuple(val.shape)), val.dtype
        if isinstance(val, (list, tuple)):
            return tuple(key(v) for v in val)
        return str(val) if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)) else type(val).__name__

    return key(node.meta.get("val"))


def _stack_paths(node: fx.Node) -> list[str]:
    stack = node.meta.get("nn_module_stack") or {}
    return [p for p, _ in stack.values()]

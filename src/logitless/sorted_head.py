"""A head that keeps its rows in decreasing softmax-mass order while it trains, with nothing asked of the user but
one call in each training forward (the targets, mapped).

The skipping backward (`skip_threshold`) leaves out (token block, vocabulary tile) pairs whose mass is negligible,
and finds most tiles cold when the rows are stored by mass (`VocabOrder`, docs/design/self_sorting.md).
`SortedHead` learns that order from the training forwards' own hidden states and keeps the head stored in it:

- `targets(hidden, target)` (in every training forward): the targets as stored positions, and a copy of at most
  `rows` rows of `hidden` (strided) kept in a buffer of the head's own. Tensor ops only, no host value read: under
  `torch.compile` it is part of the graph (no graph break, no guard on the schedule).
- After each step of an optimizer that updates the head (a global step post-hook; `after_step()` for loops without a
  torch optimizer), on the schedule: the softmax mass of each class over the kept sample, decayed across refreshes;
  its argsort is the new order, applied at once, in place, to the weight, the bias, their gradients and the position
  table. The rows move between steps, where no graph holds them; the optimizer's state follows at its next step.
- Everything outside sees class order: targets and input ids are mapped to positions (`map_ids`, and a pre-hook on
  a tied input embedding), the state_dict of the module given is unsorted, a state_dict loaded into it is sorted,
  and an optimizer's state_dict is in class order (hooks on every optimizer that steps one of these parameters).
- `restore()` puts everything back in class order and removes every hook.

Nothing here synchronises with the device: the schedule counts optimizer steps on the host, and an order is applied
by index_select/copy_ whatever its values.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from .vocab import VocabOrder

__all__ = ["SortedHead"]

# A new order is computed and applied after these optimizer steps, then after every REFRESH_EVERY-th: early while
# the model's distribution moves, rarely once it has settled.
REFRESH_AT = (1, 16, 32, 64, 128, 256, 512, 1024)
REFRESH_EVERY = 1024
SAMPLE_ROWS = 1024
DECAY = 0.5  # weight of the mass kept from earlier refreshes
_BLOCK = 1 << 24  # logits per block of the mass pass (64 MiB in float32), never rows x V for a large V

# Parameter -> a weak reference to the SortedHead that stores it, read by the optimizer step pre-hook. Weak both
# ways (the head holds the parameter): a model dropped without unpatch is freed with its head.
_HEADS = WeakIdKeyDictionary()  # keyed by identity: tensors compare elementwise
_STEP_HOOKS = None


def _before_optimizer_step(optimizer, args, kwargs):
    """Global step pre-hook: the state of a sorted parameter is moved to the order the parameter is in now."""
    for p, ref in list(_HEADS.items()):
        head = ref()
        if head is not None:
            head._sync_state(optimizer, p)


def _after_optimizer_step(optimizer, args, kwargs):
    """Global step post-hook: each head whose weight this optimizer updates counts a step (and refreshes on its
    schedule)."""
    for p, ref in list(_HEADS.items()):
        head = ref()
        if head is not None and p is head.weight and head._updated_by(optimizer):
            head.after_step()


def _install_step_hook():
    global _STEP_HOOKS
    if _STEP_HOOKS is None:
        _STEP_HOOKS = (register_optimizer_step_pre_hook(_before_optimizer_step),
                       register_optimizer_step_post_hook(_after_optimizer_step))


def _remove_step_hook_if_unused():
    global _STEP_HOOKS
    if _STEP_HOOKS is not None and not len(_HEADS):
        for h in _STEP_HOOKS:
            h.remove()
        _STEP_HOOKS = None


class SortedHead:
    """The rows of one head (weight (V, D), optional bias (V,)) kept in a vocabulary order, learned from training.

    Args:
        weight: the head's weight parameter (V, D); permuted in place (same object, same storage).
        bias: its bias (V,), or None.
        module: the module whose ``state_dict`` holds these parameters (the model): its ``state_dict`` returns
            them in class order and ``load_state_dict`` takes them in class order; an embedding inside it
            that holds ``weight`` (a tied input embedding; any submodule but an ``nn.Linear`` holding it as its
            ``weight``) gets its input ids mapped to positions by a forward pre-hook.
        order: a fixed :class:`VocabOrder`, applied now and never changed; None learns the order.
        rows: hidden-state rows kept from each training forward (a float32 (rows, D) buffer) for the next refresh.
        refresh_at, refresh_every: the schedule in optimizer steps (counted by ``after_step``); default
            ``REFRESH_AT`` and ``REFRESH_EVERY``.
        decay: weight of the mass of earlier refreshes in the next order.
        softcap, bias_scale: the logits the loss sees are ``softcap(hidden W^T + bias_scale * bias)`` for the
            ``hidden`` given to ``targets`` (None: no cap).

    Each refresh costs one pass over the sample (2 x rows x V x D FLOPs, in blocks of at most 2**24 logits), and
    each applied order one V x D permutation of the weight, of its gradient if present, and of each optimizer
    state tensor shaped like it (at that optimizer's next step). An order is applied after an optimizer step, so
    every loss computed before it must have been backpropagated by then (the usual loop, gradient accumulation
    included): a loss whose backward is still to come was computed in the order before.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, module: nn.Module | None = None,
                 order: VocabOrder | None = None, rows: int = SAMPLE_ROWS, refresh_at=None,
                 refresh_every: int | None = None, decay: float = DECAY, softcap: float | None = None,
                 bias_scale: float = 1.0):
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise TypeError(f"weight must be a (V, D) tensor, got {type(weight).__name__}"
                            + (f" of shape {tuple(weight.shape)}" if isinstance(weight, torch.Tensor) else ""))
        V = weight.shape[0]
        if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (V,)):
            raise ValueError(f"bias must be a ({V},) tensor, got "
                             f"{tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__}")
        if order is not None and not isinstance(order, VocabOrder):
            raise TypeError(f"order must be a logitless.VocabOrder or None, got {type(order).__name__}")
        if order is not None and len(order) != V:
            raise ValueError(f"order has {len(order)} classes, the head {V}")
        if not isinstance(rows, int) or rows < 1:
            raise ValueError(f"rows must be a positive int, got {rows!r}")
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay!r}")
        for p in (weight, bias):
            if p is not None and p in _HEADS and _HEADS[p]() is not None:
                raise ValueError("this parameter is already stored by a SortedHead; restore() that one first")
        self.weight, self.bias = weight, bias
        self.learn = order is None
        self.rows, self.decay = rows, float(decay)
        self.softcap, self.bias_scale = softcap, float(bias_scale)
        self.refresh_at = frozenset(REFRESH_AT if refresh_at is None else refresh_at)
        self.refresh_every = REFRESH_EVERY if refresh_every is None else int(refresh_every)
        device = weight.device
        self._arange = torch.arange(V, device=device)
        self.ids = self._arange.clone()  # stored position k holds class ids[k]; updated in place
        self.positions = self._arange.clone()  # class c sits at positions[c]; updated in place
        self.order = object.__new__(VocabOrder)  # a view of the live tables, for VocabOrder's methods
        self.order.ids, self.order.positions = self.ids, self.positions
        self.version = 0  # orders applied; 0 is class order
        self.steps = 0  # optimizer steps counted by after_step
        self._mass = None
        # The last training forward's sample (targets' copy): float32 rows and, per row, 1 where the loss counts it.
        n = rows if self.learn else 0
        self._sample = torch.zeros(n, weight.shape[1], dtype=torch.float32, device=device)
        self._sample_valid = torch.zeros(n, dtype=torch.float32, device=device)
        self._restored = False
        self._handles = []
        self._pin_class = None  # a tied embedding's padding_idx, whose row its backward leaves out
        self._init_optimizer_tracking()
        if module is not None:
            self._hook_module(module)
        self._register()
        if order is not None:
            self._apply(self._pinned(order.ids.to(device)))

    # ------------------------------------------------------------------ copies (deepcopy, pickle)
    def __getstate__(self):
        state = dict(self.__dict__)
        for k in ("_marks", "_opt_handles", "_snapshot"):  # tied to optimizers of the original
            state.pop(k)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._init_optimizer_tracking()
        if not self._restored:
            self._register()

    def _init_optimizer_tracking(self):
        # optimizer -> {param: (version, positions)}: the order its state for that param is in (absent: class order)
        self._marks = weakref.WeakKeyDictionary()
        self._opt_handles = []
        self._snapshot = None

    def _params(self):
        return [p for p in (self.weight, self.bias) if p is not None]

    def _register(self):
        for p in self._params():
            _HEADS[p] = weakref.ref(self)
        _install_step_hook()

    # ------------------------------------------------------------------ what the training loop calls
    def targets(self, hidden: torch.Tensor, target: torch.Tensor, *, ignore_index: int = -100) -> torch.Tensor:
        """``target`` mapped to stored positions, for the loss; keeps a strided sample of ``hidden`` (as the loss
        multiplies it with the weight: (..., D)) and of which of its rows the loss counts (target not
        ``ignore_index``, within the vocabulary) for the next refresh. Tensor ops whatever the values: inside a
        compiled graph it stays in the graph."""
        if self.learn and not self._restored:
            self._keep(hidden, target, ignore_index)
        return self.map_ids(target)

    @torch.no_grad()
    def _keep(self, hidden, target, ignore_index) -> None:
        D = self._sample.shape[1]
        x = hidden.detach().reshape(-1, D)
        stride = max(1, -(-x.shape[0] // self.rows))
        x = x[::stride]
        n = x.shape[0]
        t = target.detach().reshape(-1)[::stride].to(x.device)
        self._sample[:n].copy_(x)
        self._sample_valid[:n].copy_((t != ignore_index) & (t >= 0) & (t < self.weight.shape[0]))
        if n < self.rows:
            self._sample_valid[n:].zero_()

    def after_step(self) -> None:
        """Count an optimizer step; on the schedule, compute a new order from the last kept sample and apply it.
        Called by a global optimizer step post-hook for every torch optimizer that updates the weight; a loop that
        updates the head otherwise calls it after each update."""
        if not self.learn or self._restored:
            return
        self.steps += 1
        n = self.steps
        if n not in self.refresh_at and not (n > max(self.refresh_at, default=0) and n % self.refresh_every == 0):
            return
        mass = self._mass_of()
        if torch.distributed.is_available() and torch.distributed.is_initialized() \
                and torch.distributed.get_world_size() > 1:
            # Data-parallel replicas must store the same order: their gradients are summed row by row.
            torch.distributed.all_reduce(mass)
        self._mass = mass if self._mass is None else self._mass.mul_(self.decay).add_(mass)
        self._apply(self._pinned(torch.argsort(self._mass, descending=True, stable=True)))

    def _updated_by(self, optimizer) -> bool:
        # Asked at each step (a group may be added later): a scan of the optimizer's parameter lists.
        return any(q is self.weight for g in optimizer.param_groups for q in g["params"])

    def map_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Class ids (targets, input ids of a tied embedding) to their stored positions; others left as they are."""
        return self.order.map_ids(ids)

    def unsort(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """A tensor along the stored vocabulary (logits along ``dim=-1``) back in class order."""
        return self.order.unsort(tensor, dim)

    # ------------------------------------------------------------------ the order
    @torch.no_grad()
    def _mass_of(self) -> torch.Tensor:
        """Softmax mass per class (float64, class order), averaged over the kept sample's rows the loss counts."""
        w = self.weight.detach()
        V, D = w.shape
        x, valid = self._sample, self._sample_valid
        b = None if self.bias is None else self.bias.detach().float() * self.bias_scale
        mass = torch.zeros(V, dtype=torch.float64, device=w.device)
        block = max(1, _BLOCK // V)
        for i in range(0, x.shape[0], block):
            z = (x[i:i + block].to(w.dtype) @ w.T).float()
            if b is not None:
                z += b
            if self.softcap is not None:
                z = self.softcap * torch.tanh(z / self.softcap)
            mass += (valid[i:i + block] @ torch.softmax(z, dim=1)).double()
        mass /= valid.sum().clamp(min=1)
        return mass.index_select(0, self.positions)  # stored order to class order

    def _pinned(self, ids: torch.Tensor) -> torch.Tensor:
        """`ids` with the pinned class moved to its own position, the others in their order. A tied embedding's
        backward drops the gradient of row padding_idx, which must stay the padding class's."""
        p = self._pin_class
        if p is None:
            return ids
        rank = torch.empty_like(ids).scatter_(0, ids, self._arange)
        rank[p] = -1
        first = torch.argsort(rank, stable=True)  # the pinned class, then the others in `ids` order
        V = len(ids)
        idx = torch.cat([self._arange[1:p + 1], self._arange[:1], self._arange[p + 1:V]])
        return first.index_select(0, idx)

    @torch.no_grad()
    def _apply(self, new_ids: torch.Tensor) -> None:
        """Store the rows in `new_ids` order (position k holds class new_ids[k]), in place."""
        rel = self.positions[new_ids]  # where each class of the new order sits now
        for p in self._params():
            p.copy_(p.index_select(0, rel))
            if p.grad is not None:
                p.grad.copy_(p.grad.index_select(0, rel))
        self.ids.copy_(new_ids)
        self.positions.scatter_(0, new_ids, self._arange)
        self.version += 1

    def restore(self) -> None:
        """Put the rows, their gradients and every tracked optimizer's state back in class order, and remove every
        hook. The object is inert afterwards."""
        if self._restored:
            return
        with torch.no_grad():
            for optimizer, marks in list(self._marks.items()):
                for p, (_, positions) in marks.items():
                    self._permute_state(optimizer, p, positions)
            self._marks.clear()
            self._apply(self._arange.clone())
        for h in (*self._handles, *self._opt_handles):
            h.remove()
        self._handles, self._opt_handles = [], []
        self._restored = True
        for p in self._params():
            if p in _HEADS and _HEADS[p]() is self:
                del _HEADS[p]
        _remove_step_hook_if_unused()

    # ------------------------------------------------------------------ module hooks
    def _hook_module(self, module: nn.Module) -> None:
        names = [(name, p) for name, p in module.named_parameters(remove_duplicate=False)
                 if p is self.weight or (self.bias is not None and p is self.bias)]
        if not any(p is self.weight for _, p in names):
            raise ValueError(f"module {type(module).__name__} does not hold the head's weight")
        post = functools.partial(_state_dict_in_class_order, self, tuple(names))
        # The public post-hook (in-place edits only) where this torch has it; the older private one otherwise.
        register = getattr(module, "register_state_dict_post_hook", None) or module._register_state_dict_hook
        self._handles.append(register(post))
        pre = functools.partial(_load_in_stored_order, self, tuple(names))
        self._handles.append(module.register_load_state_dict_pre_hook(pre))
        for sub in module.modules():  # a tied input embedding: its rows are the head's
            if not isinstance(sub, nn.Linear) and sub._parameters.get("weight") is self.weight:
                hook = functools.partial(_map_input_ids, self)
                self._handles.append(sub.register_forward_pre_hook(hook, with_kwargs=True))
                pad = getattr(sub, "padding_idx", None)
                if isinstance(pad, int):
                    self._pin_class = pad % self.weight.shape[0]

    # ------------------------------------------------------------------ optimizer state
    def _snap(self):
        if self._snapshot is None or self._snapshot[0] != self.version:
            self._snapshot = (self.version, self.positions.clone())
        return self._snapshot

    def _marks_of(self, optimizer) -> dict:
        marks = self._marks.get(optimizer)
        if marks is None:
            marks = self._marks[optimizer] = {}
            self._opt_handles.append(optimizer.register_state_dict_post_hook(
                functools.partial(_optimizer_state_in_class_order, self)))
            self._opt_handles.append(optimizer.register_load_state_dict_post_hook(
                functools.partial(_optimizer_state_loaded, self)))
        return marks

    def _sync_state(self, optimizer, p) -> None:
        if self._restored:
            return
        state = optimizer.state.get(p)
        if not state:
            if optimizer in self._marks or any(q is p for g in optimizer.param_groups for q in g["params"]):
                self._marks_of(optimizer)[p] = self._snap()  # state this step creates is in the current order
            return
        marks = self._marks_of(optimizer)
        version, positions = marks.get(p, (0, None))
        if version == self.version:
            return
        with torch.no_grad():
            # State in the order of `positions` (None: class order) to the current one.
            rel = self.ids if positions is None else positions[self.ids]
            for t in state.values():
                if isinstance(t, torch.Tensor) and t.shape == p.shape:
                    t.copy_(t.index_select(0, rel.to(t.device)))
        marks[p] = self._snap()

    @staticmethod
    def _permute_state(optimizer, p, positions) -> None:
        """Optimizer state of `p` from the order of `positions` to class order."""
        for t in optimizer.state.get(p, {}).values():
            if isinstance(t, torch.Tensor) and t.shape == p.shape:
                t.copy_(t.index_select(0, positions.to(t.device)))


# Hooks are partials of module-level functions, not closures: a deepcopy of the model copies them bound to the
# copy's SortedHead.
def _map_input_ids(head, module, args, kwargs):
    if args:
        return (head.map_ids(args[0]),) + tuple(args[1:]), kwargs
    key = next((k for k in ("input", "input_ids") if k in kwargs), None)
    if key is not None:
        kwargs = dict(kwargs, **{key: head.map_ids(kwargs[key])})
    return args, kwargs


def _state_dict_in_class_order(head, names, module, state_dict, prefix, local_metadata):
    if head.version == 0 or head._restored:
        return
    done = {}
    with torch.no_grad():
        for name, p in names:
            key = prefix + name
            if key in state_dict:
                if id(p) not in done:  # a tied weight's two names keep sharing one tensor
                    done[id(p)] = head.unsort(state_dict[key].detach())
                state_dict[key] = done[id(p)]


def _load_in_stored_order(head, names, module, state_dict, prefix, *args):
    if head.version == 0 or head._restored:
        return
    with torch.no_grad():
        for name, _ in names:
            t = state_dict.get(prefix + name)
            if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == len(head.ids):
                state_dict[prefix + name] = t.index_select(0, head.ids.to(t.device))


def _optimizer_state_in_class_order(head, optimizer, state_dict):
    marks = head._marks.get(optimizer)
    if not marks:
        return None
    index = {}
    for group, packed in zip(optimizer.param_groups, state_dict["param_groups"], strict=True):
        for p, i in zip(group["params"], packed["params"], strict=True):
            index[id(p)] = i
    with torch.no_grad():
        for p, (version, positions) in marks.items():
            entry = state_dict["state"].get(index.get(id(p)))
            if version == 0 or not entry:
                continue
            state_dict["state"][index[id(p)]] = {
                k: (t.index_select(0, positions.to(t.device)) if isinstance(t, torch.Tensor) and t.shape == p.shape
                    else t)
                for k, t in entry.items()
            }
    return state_dict


def _optimizer_state_loaded(head, optimizer):
    marks = head._marks.get(optimizer)
    if marks is not None:
        marks.clear()  # a loaded state is in class order

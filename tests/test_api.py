"""The public API, pinned: each public name of the package's public modules with its parameters (names, kinds,
defaults, as inspect.signature gives them, without annotations), the public methods and properties of its classes,
and kernels.Tuning's fields with their defaults. An API change fails here with a message naming what changed: if
the change is meant, update PINNED in the same commit (and README.md and docs/ where they show it)."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect

# The modules a user imports, and their public names: __all__ where the module has one, else the names it defines
# itself without a leading underscore.
MODULES = ("logitless", "logitless.distributed", "logitless.nn", "logitless.integrations.hf",
           "logitless.integrations.trl")


def _signature(obj) -> str:
    sig = inspect.signature(obj)
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


def _public_names(module) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is None:  # the functions, classes and constants the module's own top level defines
        tree = ast.parse(inspect.getsource(module))
        names = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        names += [t.id for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                  for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)]
        names = [n for n in names if not n.startswith("_")]
    return sorted(names)


def _describe(name: str, obj) -> dict[str, str]:
    """name -> what is pinned of obj: a function's signature, a class's constructor and its own public methods and
    properties, an exception's bases, or a constant's type and value."""
    if inspect.isclass(obj):
        if issubclass(obj, BaseException):
            return {name: f"exception({', '.join(b.__name__ for b in obj.__bases__)})"}
        out = {name: f"class{_signature(obj)}"}
        for attr, member in sorted(vars(obj).items()):
            if attr.startswith("_"):
                continue
            if isinstance(member, property):
                out[f"{name}.{attr}"] = "property"
            elif isinstance(member, (staticmethod, classmethod)):
                out[f"{name}.{attr}"] = f"{type(member).__name__}{_signature(member.__func__)}"
            elif inspect.isfunction(member):
                out[f"{name}.{attr}"] = _signature(member)
        return out
    if callable(obj):
        return {name: _signature(obj)}
    return {name: f"{type(obj).__name__} {obj!r}"}


def surface() -> dict[str, str]:
    out = {}
    for mod_name in MODULES:
        module = importlib.import_module(mod_name)
        for name in _public_names(module):
            out.update(_describe(f"{mod_name}.{name}", getattr(module, name)))
    from logitless.kernels import Tuning

    for field in dataclasses.fields(Tuning):
        out[f"logitless.kernels.Tuning.{field.name}"] = repr(field.default)
    return out


# Today's API, written from surface() and read by hand (`python -m tests.test_api` prints surface(), a line a name).
PINNED = {
    "logitless.CrossEntropyLoss": (
        "class(weight=None, *, reduction='mean', ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None, "
        "inplace_backward=False, backend='auto')"
    ),
    "logitless.CrossEntropyLoss.forward": "(self, logits, target)",
    "logitless.LinearCrossEntropyLoss": (
        "class(weight=None, *, reduction='mean', ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None, "
        "backend='auto', skip_threshold='auto', vocab_order='none', workspace_bytes=None, deterministic=False)"
    ),
    "logitless.LinearCrossEntropyLoss.forward": "(self, input, linear_weight, target, linear_bias=None)",
    "logitless.SortedHead": (
        "class(weight, bias=None, *, module=None, order=None, rows=1024, refresh_at=None, refresh_every=None, "
        "decay=0.5, softcap=None, bias_scale=1.0)"
    ),
    "logitless.SortedHead.after_step": "(self)",
    "logitless.SortedHead.map_ids": "(self, ids)",
    "logitless.SortedHead.restore": "(self)",
    "logitless.SortedHead.targets": "(self, hidden, target, *, ignore_index=-100)",
    "logitless.SortedHead.unsort": "(self, tensor, dim=0)",
    "logitless.VocabOrder": "class(ids)",
    "logitless.VocabOrder.by_counts": "classmethod(cls, counts)",
    "logitless.VocabOrder.by_mass": (
        "classmethod(cls, hidden, weight, bias=None, *, softcap=None, temperature=1.0, rows=1024)"
    ),
    "logitless.VocabOrder.map_ids": "(self, ids)",
    "logitless.VocabOrder.sort": "(self, tensor, dim=0)",
    "logitless.VocabOrder.to": "(self, device)",
    "logitless.VocabOrder.unmap_ids": "(self, positions)",
    "logitless.VocabOrder.unsort": "(self, tensor, dim=0)",
    "logitless.cross_entropy": (
        "(logits, target, *, weight=None, reduction='mean', ignore_index=-100, label_smoothing=0.0, z_loss=0.0, "
        "softcap=None, inplace_backward=False, return_lse=False, backend='auto')"
    ),
    "logitless.linear_cross_entropy": (
        "(input, linear_weight, target, *, linear_bias=None, weight=None, reduction='mean', ignore_index=-100, "
        "label_smoothing=0.0, z_loss=0.0, softcap=None, backend='auto', deterministic=False, skip_threshold='auto', "
        "vocab_order='none', workspace_bytes=None, process_group=None, options=None)"
    ),
    "logitless.linear_jsd": (
        "(student_input, student_weight, teacher_input, teacher_weight, *, beta=0.5, target=None, ignore_index=-100, "
        "temperature=1.0, reduction='mean', student_bias=None, teacher_bias=None, softcap=None, backend='auto', "
        "workspace_bytes=None, skip_threshold=None)"
    ),
    "logitless.linear_kl_div": (
        "(student_input, student_weight, teacher_input, teacher_weight, *, target=None, ignore_index=-100, "
        "temperature=1.0, direction='forward', reduction='mean', student_bias=None, teacher_bias=None, softcap=None, "
        "backend='auto', workspace_bytes=None, skip_threshold=None)"
    ),
    "logitless.linear_log_probs": (
        "(input, linear_weight, target, *, linear_bias=None, softcap=None, temperature=1.0, ignore_index=-100, "
        "return_entropy=False, backend='auto', skip_threshold='auto', workspace_bytes=None, process_group=None)"
    ),
    "logitless.linear_logsumexp": (
        "(input, linear_weight, *, linear_bias=None, softcap=None, temperature=1.0, backend='auto', "
        "workspace_bytes=None, process_group=None)"
    ),
    "logitless.linear_soft_cross_entropy": (
        "(input, linear_weight, target_input, target_weight, *, target=None, ignore_index=-100, temperature=1.0, "
        "reduction='none', linear_bias=None, target_bias=None, softcap=None, backend='auto', workspace_bytes=None, "
        "skip_threshold=None)"
    ),
    "logitless.patch": (
        "(model, *, z_loss=0.0, label_smoothing=0.0, ignore_index=-100, backend='auto', workspace_bytes=None, "
        "skip_threshold='auto', vocab_order='learn')"
    ),
    "logitless.unpatch": "(model)",
    "logitless.distributed.linear_cross_entropy": (
        "(input, linear_weight, target, *, linear_bias=None, weight=None, reduction='mean', ignore_index=-100, "
        "label_smoothing=0.0, z_loss=0.0, softcap=None, backend='auto', skip_threshold='auto', vocab_order='none', "
        "workspace_bytes=None, deterministic=False, process_group, vocab_start=None, vocab_size=None)"
    ),
    "logitless.distributed.linear_log_probs": (
        "(input, linear_weight, target, *, linear_bias=None, softcap=None, temperature=1.0, ignore_index=-100, "
        "return_entropy=False, backend='auto', skip_threshold='auto', workspace_bytes=None, process_group, "
        "vocab_start=None, vocab_size=None)"
    ),
    "logitless.distributed.linear_logsumexp": (
        "(input, linear_weight, *, linear_bias=None, softcap=None, temperature=1.0, backend='auto', "
        "workspace_bytes=None, process_group, vocab_start=None, vocab_size=None)"
    ),
    "logitless.nn.CrossEntropyLoss": (
        "class(weight=None, *, reduction='mean', ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None, "
        "inplace_backward=False, backend='auto')"
    ),
    "logitless.nn.CrossEntropyLoss.forward": "(self, logits, target)",
    "logitless.nn.LinearCrossEntropyLoss": (
        "class(weight=None, *, reduction='mean', ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None, "
        "backend='auto', skip_threshold='auto', vocab_order='none', workspace_bytes=None, deterministic=False)"
    ),
    "logitless.nn.LinearCrossEntropyLoss.forward": "(self, input, linear_weight, target, linear_bias=None)",
    "logitless.integrations.hf.patch": (
        "(model, *, z_loss=0.0, label_smoothing=0.0, ignore_index=-100, backend='auto', workspace_bytes=None, "
        "skip_threshold='auto', vocab_order='learn')"
    ),
    "logitless.integrations.hf.unpatch": "(model)",
    "logitless.integrations.trl.FIELDS": "tuple ('log_probs', 'entropy', 'log_sum_sq_probs', 'mean_logits', 'is_top1')",
    "logitless.integrations.trl.UnsupportedModelError": "exception(NotImplementedError)",
    "logitless.integrations.trl.is_patched": "(model)",
    "logitless.integrations.trl.patch": (
        "(trainer, *, backend='auto', workspace_bytes=None, skip_threshold='auto', compact=True, strict=False)"
    ),
    "logitless.integrations.trl.unpatch": "(trainer)",
    "logitless.kernels.Tuning.fast_launch": "True",
    "logitless.kernels.Tuning.linear_config": "None",
    "logitless.kernels.Tuning.scratch_bytes": "8388608",
    "logitless.kernels.Tuning.own_accumulator": "None",
    "logitless.kernels.Tuning.torch_products": "None",
    "logitless.kernels.Tuning.stash_logits": "True",
    "logitless.kernels.Tuning.stash_min_flop": "500000000000.0",
    "logitless.kernels.Tuning.stash_tma": "True",
    "logitless.kernels.Tuning.fwd_fp_fusion": "False",
    "logitless.kernels.Tuning.narrow_d": "8",
    "logitless.kernels.Tuning.row_chunks": "None",
    "logitless.kernels.Tuning.row_chunk_min_d": "1024",
    "logitless.kernels.Tuning.row_chunk_min_rows": "1024",
    "logitless.kernels.Tuning.row_chunk_max_bf16": "4",
    "logitless.kernels.Tuning.row_chunk_f32_dw": "None",
    "logitless.kernels.Tuning.debug_poison": "False",
    "logitless.kernels.Tuning.debug_plans": "None",
    "logitless.kernels.Tuning.debug_backwards": "None",
    "logitless.kernels.Tuning.skip_group_rows": "True",
    "logitless.kernels.Tuning.skip_plan_kernels": "True",
    "logitless.kernels.Tuning.skip_dz_hot_list": "True",
    "logitless.kernels.Tuning.skip_wide": "None",
    "logitless.kernels.Tuning.skip_dx_first": "True",
    "logitless.kernels.Tuning.skip_dx_split": "4",
    "logitless.kernels.Tuning.skip_dx_deal_pct": "15.0",
    "logitless.kernels.Tuning.skip_dx_deal": "'share'",
    "logitless.kernels.Tuning.skip_budget_scale": "1.0",
    "logitless.kernels.Tuning.skip_min_share": "0.35",
    "logitless.kernels.Tuning.skip_min_share_row_chunks": "0.5",
    "logitless.kernels.Tuning.skip_min_share_small": "0.5",
    "logitless.kernels.Tuning.skip_small_flop": "2000000000000.0",
    "logitless.kernels.Tuning.skip_probe_every": "8",
    "logitless.kernels.Tuning.skip_probe_max": "1024",
    "logitless.kernels.Tuning.two_heads_config": "None",
    "logitless.kernels.Tuning.two_heads_dz": "None",
    "logitless.kernels.Tuning.two_heads_dz_store_tma": "True",
    "logitless.kernels.Tuning.two_heads_dz_persistent": "True",
    "logitless.kernels.Tuning.two_heads_fused_k": "False",
    "logitless.kernels.Tuning.ce_tile_elems": "8192",
    "logitless.kernels.Tuning.ce_tiles_per_program": "4",
    "logitless.kernels.Tuning.ce_min_block_v": "1024",
    "logitless.kernels.Tuning.ce_inplace_lag_bytes": "8388608",
    "logitless.kernels.Tuning.ce_inplace_lag_seconds": "1.8e-06",
    "logitless.kernels.Tuning.ce_inplace_tiles_per_program": "2",
    "logitless.kernels.Tuning.ce_stats_tile_elems": "4096",
    "logitless.kernels.Tuning.ce_stats_tiles": "8",
    "logitless.kernels.Tuning.ce_stats_stages": "3",
}


def _changes(pinned: dict[str, str], now: dict[str, str]) -> list[str]:
    out = [f"removed: {k} {pinned[k]}" for k in pinned if k not in now]
    out += [f"added: {k} {now[k]}" for k in now if k not in pinned]
    out += [f"changed: {k}\n  pinned: {pinned[k]}\n  now:    {now[k]}" for k in pinned if k in now
            and pinned[k] != now[k]]
    return out


def test_public_api_is_pinned():
    changes = _changes(PINNED, surface())
    assert not changes, "the public API changed (update PINNED if that is meant):\n" + "\n".join(changes)


def test_changes_are_named():
    # A change of a default, of a parameter's kind, a new name and a removed one are each reported by name.
    now = dict(PINNED)
    now["logitless.linear_logsumexp"] = now["logitless.linear_logsumexp"].replace("temperature=1.0", "temperature=2.0")
    now["logitless.unpatch"] = "(model, /)"
    now["logitless.new_op"] = "(x)"
    del now["logitless.kernels.Tuning.narrow_d"]
    found = _changes(PINNED, now)
    assert [line.split("\n")[0] for line in found] == [
        "removed: logitless.kernels.Tuning.narrow_d 8", "added: logitless.new_op (x)",
        "changed: logitless.linear_logsumexp", "changed: logitless.unpatch"]


if __name__ == "__main__":  # prints today's surface, one line per name (compare it with PINNED)
    for key, value in surface().items():
        print(f"{key}: {value}")

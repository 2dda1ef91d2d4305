"""Weight stashing: keep a stage's cached autograd graphs valid across an inner step.

Stage 0 (and a middle stage) keeps the graph of every micro-batch that is downstream, for
its backward. An inner step changes the weights in place while some are still away; the
graphs hold the parameters themselves (autograd saves them for the input gradients), so
they would then differentiate at weights other than the ones the forward ran with, and
autograd refuses that. Without a stash every such micro-batch ran its forward again at
the new weights (with the defaults about half of stage 0's micro-batches).

`WeightStash` is a pair of saved-tensor hooks installed around the stage's forward. A
saved tensor that lives in a parameter's storage is held through a `_Saved` record;
`freeze(version)`, called just before the weights change, gives every record of that
version a copy of its current value (one copy per distinct parameter view, shared by all
graphs), so those graphs' backwards run exactly at the weights their forward used: the
gradient is one inner step stale, as in PipeDream's weight stashing, instead of mixing
two weight versions. The copies live as long as the graphs that need them.

Under bf16 autocast the graphs mostly keep autocast's bf16 casts of the weight matrices
(new tensors, untouched by the step), so a freeze copies only the fp32 norm weights.
"""

from __future__ import annotations

import weakref

import torch


class _Saved:
    """A saved tensor that is (a view of) a parameter, as one graph holds it."""

    __slots__ = ("__weakref__", "frozen", "tensor", "version")

    def __init__(self, tensor: torch.Tensor, version: int) -> None:
        self.tensor = tensor  # the parameter (view), or once frozen its value at `version`
        self.version = version  # the stage's weights version at the forward
        self.frozen = False


def _view_key(t: torch.Tensor) -> tuple[int, int, tuple[int, ...], tuple[int, ...], str]:
    return (
        t.untyped_storage().data_ptr(),
        int(t.storage_offset()),
        tuple(t.shape),
        tuple(t.stride()),
        str(t.dtype),
    )


class WeightStash:
    def __init__(self, params: list[torch.Tensor]) -> None:
        self._storages = {p.untyped_storage().data_ptr() for p in params}
        self._live: weakref.WeakSet[_Saved] = weakref.WeakSet()
        self.version = 0  # the weights version forwards run at now (`advance` moves it)
        self.frozen: set[int] = set()  # versions whose live graphs hold copies
        self.copied_bytes = 0  # bytes copied by the last freeze
        self.saved_bytes = 0  # bytes of the other tensors graphs saved, since creation

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The context to run a forward in."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> torch.Tensor | _Saved:
        # Detached: a node that saves its own output would otherwise hold that tensor,
        # whose grad_fn is the node, a cycle through autograd that Python's collector
        # does not see. Backward frees it; a graph let go without one (stale after an
        # outer merge) stayed, with all its activations. Backward reads only the values.
        t = t.detach()
        if t.layout != torch.strided or t.untyped_storage().data_ptr() not in self._storages:
            self.saved_bytes += t.numel() * t.element_size()
            return t
        saved = _Saved(t, self.version)
        self._live.add(saved)
        return saved

    @staticmethod
    def _unpack(s: torch.Tensor | _Saved) -> torch.Tensor:
        return s.tensor if isinstance(s, _Saved) else s

    def freeze(self, version: int) -> None:
        """The weights are about to change in place: graphs of `version` keep a copy of
        the parameters they saved. Only the latest frozen version stays usable (the
        owner drops the graphs of older ones and recomputes them), so at most one copy of
        the weights is added."""
        copies: dict[tuple[int, int, tuple[int, ...], tuple[int, ...], str], torch.Tensor] = {}
        for s in list(self._live):
            if s.version == version and not s.frozen:
                key = _view_key(s.tensor)
                if key not in copies:
                    copies[key] = s.tensor.detach().clone()
                s.tensor, s.frozen = copies[key], True
        self.copied_bytes = sum(c.numel() * c.element_size() for c in copies.values())
        self.frozen = {version}

    def advance(self, *, stashed: bool) -> None:
        """The weights changed in place: after a `freeze` of the current version (an inner
        step) that version's graphs stay usable; without one (an outer merge) no earlier
        graph is."""
        if not stashed:
            self.frozen = set()
        self.version += 1

    def usable(self, version: int) -> bool:
        """Whether a graph built at weights `version` may run its backward now."""
        return version == self.version or version in self.frozen

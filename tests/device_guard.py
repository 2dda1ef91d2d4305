"""A torch function mode that catches tensors created on the wrong device, on a CPU box.

A CUDA bug of the stage (a CPU `torch.zeros` fed into a CUDA model, CPU coefficients
multiplied by a CUDA basis, a CPU snapshot subtracted from CUDA parameters) shows only
on a GPU. `DeviceGuard` finds the same bugs without one: the stage runs on the device
object `STAGE_DEVICE` (`cpu:0`), which computes on the CPU like the wire's `cpu` but is
a different object in every call that names it. The guard gives each tensor a virtual
device:

- a factory call (`torch.zeros`, `torch.from_numpy`, ...) without `device=` makes a
  `cpu` tensor, with `device=STAGE_DEVICE` a `stage` one; so do `.cpu()`, `.to("cpu")`
  and `.to(STAGE_DEVICE)`;
- `adopt(module)` marks a module's parameters and buffers `stage` (`Module.to` swaps
  `param.data`, which no function mode sees);
- every other op gives its outputs the virtual device of its tensor inputs, and raises
  `DeviceMix` when two inputs disagree, as CUDA would. Tensors the guard never saw
  (autograd's `.grad`) agree with either; 0-dim CPU tensors mix with anything, as in
  torch; `copy_` may cross devices, and an index may live on the CPU.
- `.numpy()` of a `stage` tensor raises too: on CUDA it would have to be copied first;
- a `stage` tensor's `.device` is `STAGE_DEVICE`, so code that moves a tensor to where
  another lives (`x.to(p.device)`) is checked as well.

`torch.from_numpy` and `torch.frombuffer` bypass function modes, so while the guard is
on they are wrapped to make `cpu` tensors.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

STAGE_DEVICE = torch.device("cpu", 0)  # the stage's device: the CPU under another name
WIRE = torch.device("cpu")
_TAG = "_agora_virtual_device"

FACTORIES = {
    torch.zeros, torch.ones, torch.empty, torch.full, torch.rand, torch.randn,
    torch.randint, torch.randperm, torch.arange, torch.linspace, torch.eye,
    torch.tensor, torch.as_tensor, torch.empty_strided,
}  # fmt: skip
UNSEEN_FACTORIES = ("from_numpy", "frombuffer")  # no function mode sees these
CROSSING = {torch.Tensor.copy_}  # ops that may take inputs from another device
_DEVICE_GETTER = torch.Tensor.device.__get__  # type: ignore[attr-defined]


class DeviceMix(RuntimeError):
    """An op got tensors from two devices (it would fail on CUDA)."""


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)


def virtual_device(t: torch.Tensor) -> str | None:
    return getattr(t, _TAG, None)


def _tag(obj: Any, dev: str) -> None:
    for t in _tensors(obj):
        try:
            setattr(t, _TAG, dev)
        except (AttributeError, RuntimeError):  # e.g. a tensor without a __dict__
            pass


def _name(dev: Any) -> str | None:
    """The virtual device a `device=` argument names, or None if it names none."""
    if isinstance(dev, (str, torch.device)):
        d = torch.device(dev)
        if d == STAGE_DEVICE:
            return "stage"
        if d.type == "cpu":
            return "cpu"
        return d.type
    return None


def _on_cpu(factory: Any) -> Any:
    def made_on_cpu(*args: Any, **kwargs: Any) -> Any:
        out = factory(*args, **kwargs)
        _tag(out, "cpu")
        return out

    return made_on_cpu


class DeviceGuard(TorchFunctionMode):
    """See the module docstring. `ops` counts the calls it checked."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> DeviceGuard:
        for name in UNSEEN_FACTORIES:
            real = self._saved[name] = getattr(torch, name)
            setattr(torch, name, _on_cpu(real))
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        for name, real in self._saved.items():
            setattr(torch, name, real)
        self._saved.clear()

    @staticmethod
    def adopt(module: torch.nn.Module) -> None:
        _tag(list(module.parameters()) + list(module.buffers()), "stage")

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        self.ops += 1
        if func == _DEVICE_GETTER and args and virtual_device(args[0]) == "stage":
            return STAGE_DEVICE  # code that asks a tensor where it lives is told the truth
        target = self._target(func, args, kwargs)
        if func is torch.Tensor.numpy and args and virtual_device(args[0]) == "stage":
            raise DeviceMix("numpy() of a tensor on the stage's device (copy it to the CPU)")
        if target is None and func not in CROSSING:
            target = self._common(func, args, kwargs)
        out = func(*args, **kwargs)
        if func in CROSSING:
            return out
        if target is not None:
            _tag(out, target)
        return out

    def _target(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """Where an op that names a device puts its result."""
        if "device" in kwargs and kwargs["device"] is not None:
            return _name(kwargs["device"])
        if func is torch.Tensor.cpu:
            return "cpu"
        if func is torch.Tensor.to:
            for a in args[1:]:
                if isinstance(a, torch.Tensor):
                    return virtual_device(a)
                named = _name(a)
                if named is not None:
                    return named
            return None  # a dtype change stays where it is
        if func in FACTORIES:
            if func in (torch.tensor, torch.as_tensor) and args:
                inner = [virtual_device(t) for t in _tensors(args[0])]
                if any(inner):
                    return next(d for d in inner if d)
            return "cpu"
        return None

    def _common(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """The one virtual device of an op's inputs; raises `DeviceMix` if they disagree."""
        if func is torch.Tensor.__getitem__:  # an index may live on the CPU
            inputs: Any = args[:1]
        elif func is torch.Tensor.__setitem__:
            inputs = (args[0], args[2:])
        else:
            inputs = (args, kwargs)
        seen: dict[str, tuple[int, ...]] = {}
        for t in _tensors(inputs):
            dev = virtual_device(t)
            if dev is None or (dev == "cpu" and t.dim() == 0):
                continue
            seen.setdefault(dev, tuple(t.shape))
        if len(seen) > 1:
            where = ", ".join(f"{d} {list(s)}" for d, s in seen.items())
            raise DeviceMix(f"{getattr(func, '__qualname__', func)} got tensors on {where}")
        return next(iter(seen), None)

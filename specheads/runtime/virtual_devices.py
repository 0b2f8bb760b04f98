"""A device sanitizer for machines without GPUs: every tensor is a real CPU tensor tagged with the device it
would live on, and any operation that mixes tensors of two devices fails, naming the operation and both
devices.

``with VirtualGPUs(2) as vg:`` makes this process look like a node of two CUDA GPUs to the code it runs:
``torch.cuda.is_available()`` is true, ``torch.zeros(3, device="cuda:1")`` is a CPU tensor whose ``.device``
reads ``cuda:1``, ``x.to("cuda:0")`` moves the tag (a copy, as on a GPU), ``torch.Generator(device=...)``
draws on its tag, and Transformers' ``from_pretrained(device_map=...)`` places the model's modules the way
accelerate does on GPUs: each module of the map gets its device, its inputs are moved there before its
forward, its outputs stay there (a split model takes its inputs on its first device and gives its logits on
its last). ``vg.split(model, n)`` does the same for a model already in memory.

The rules are PyTorch's on CUDA: operands of one operation share a device, except zero-dimensional CPU
tensors (Python-number-like) and CPU index tensors; ``copy_`` and ``.to`` cross devices; a generator draws
only for tensors of its device type; ``.numpy()`` needs a CPU tensor. Arithmetic runs on the CPU in the
model's dtype, so results equal an unsplit run's exactly.

A :class:`~torch.overrides.TorchFunctionMode` sees every call of the torch API from Python, composite
functions at their entry (their insides run unchecked, as one operation); ``vg.ops`` counts the operations
checked. It is a test tool: each operation costs a few microseconds of Python.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections import Counter
from collections.abc import Callable, Iterator
from types import GetSetDescriptorType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

CPU = torch.device("cpu")
_TAG = "_virtual_device"
_TB = torch._C.TensorBase


class DeviceMismatch(RuntimeError):
    """Two devices met in one operation (what PyTorch raises on GPUs as "Expected all tensors to be on the
    same device")."""

    def __init__(self, op: str, devices: list[torch.device], what: list[str] | None = None):
        self.op, self.devices = op, devices
        named = [f"{d} ({w})" for d, w in zip(devices, what)] if what else [str(d) for d in devices]
        super().__init__(f"{op} mixes devices {', '.join(named)}")


def device_of(t: torch.Tensor) -> torch.device:
    """The virtual device of a tensor (its real one, the CPU, when untagged)."""
    return getattr(t, _TAG, CPU)


def _tag(t: torch.Tensor, device: torch.device) -> None:
    try:
        setattr(t, _TAG, device)
    except (AttributeError, RuntimeError):  # a few internal tensor types take no attributes
        pass


def _as_device(d: Any) -> torch.device | None:
    if d is None:
        return None
    if isinstance(d, int):
        return torch.device("cuda", d)
    d = torch.device(d)
    return torch.device("cuda", 0) if d.type == "cuda" and d.index is None else d


def _tensors(x: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, (list, tuple)):
        for y in x:
            _tensors(y, out)
    elif isinstance(x, dict):
        for y in x.values():
            _tensors(y, out)
    return out


def _name(func: Callable) -> str:
    owner = getattr(func, "__self__", None)
    if isinstance(owner, GetSetDescriptorType):  # a property: Tensor.device, Tensor.data, ...
        return f"Tensor.{owner.__name__}"
    qual = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    mod = getattr(func, "__module__", "") or ""
    if qual.startswith(("TensorBase.", "Tensor.")):
        return "Tensor." + qual.split(".", 1)[1]
    qual = qual.replace("_VariableFunctionsClass.", "")
    mod = {"torch._C._nn": "torch.nn.functional", "torch._C._VariableFunctions": "torch", "": "torch"}.get(mod, mod)
    return f"{mod}.{qual}"


# Operations whose operands may sit on different devices (a copy between them), and index-taking ones that
# accept CPU index tensors.
_CROSS = {"Tensor.copy_", "Tensor.to", "Tensor.cuda", "Tensor.cpu", "Tensor.data", "Tensor.set_", "Tensor.__repr__"}
_INDEXING = {"Tensor.__getitem__", "Tensor.__setitem__"}
_GETTERS = {"Tensor.device", "Tensor.is_cuda", "Tensor.is_cpu", "Tensor.get_device"}


class _VirtualGenerator(torch.Generator):
    """A CPU generator that says it is on ``device`` (a GPU's generator draws for that GPU's tensors)."""

    def __new__(cls, device: Any = "cpu"):
        g = super().__new__(cls)
        g._vdev = _as_device(device) or CPU
        return g

    def __init__(self, device: Any = "cpu"):
        pass

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self._vdev


class VirtualGPUs(TorchFunctionMode):
    """``n`` virtual CUDA GPUs on the CPU; see the module's docstring.

    Attributes:
        ops: operations checked, by name.
        moves: ``.to``/``.cuda`` calls that changed a tensor's device.
    """

    def __init__(self, n: int = 2):
        super().__init__()
        if n < 1:
            raise ValueError("VirtualGPUs needs at least one device")
        self.n = n
        self.ops: Counter[str] = Counter()
        self.moves = 0
        self._stack = contextlib.ExitStack()

    # -- the process as a node of n GPUs ------------------------------------------------------------------
    def __enter__(self):
        from unittest import mock

        s = self._stack
        free = 64 << 30
        cuda = torch.cuda
        for name, value in {
            "is_available": lambda: True,
            "device_count": lambda: self.n,
            "current_device": lambda: 0,
            "set_device": lambda d: None,
            "synchronize": lambda device=None: None,
            "empty_cache": lambda: None,
            "is_bf16_supported": lambda *a, **k: False,  # fp32 stays fp32: results equal the CPU's bit for bit
            "get_device_name": lambda device=None: "virtual GPU",
            "mem_get_info": lambda device=None: (free, free),
            "manual_seed": lambda seed: None,
            "manual_seed_all": lambda seed: None,
            "get_rng_state_all": lambda: [],
            "set_rng_state_all": lambda states: None,
            "memory_allocated": lambda device=None: 0,
            "max_memory_allocated": lambda device=None: 0,
            "reset_peak_memory_stats": lambda device=None: None,
        }.items():
            s.enter_context(mock.patch.object(cuda, name, value))
        s.enter_context(mock.patch.object(torch, "Generator", _VirtualGenerator))
        new_parameter = torch.nn.Parameter.__new__

        def parameter(cls, data=None, requires_grad=True):  # Parameter(t) wraps t's storage: t's device
            p = new_parameter(cls, data, requires_grad)
            if data is not None:
                _tag(p, device_of(data))
            return p

        s.enter_context(mock.patch.object(torch.nn.Parameter, "__new__", parameter))
        s.enter_context(self._placing_from_pretrained())
        super().__enter__()
        return self

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._stack.close()

    @contextlib.contextmanager
    def _placing_from_pretrained(self) -> Iterator[None]:
        """``from_pretrained(device_map=...)`` loads on the CPU, then places the modules as accelerate would."""
        from transformers import PreTrainedModel

        real = PreTrainedModel.from_pretrained.__func__  # type: ignore[attr-defined]
        mode = self

        def from_pretrained(cls, *args, **kwargs):
            device_map = kwargs.pop("device_map", None)
            model = real(cls, *args, **kwargs)
            if device_map is not None:
                mode.split(model, device_map)
            return model

        with contextlib.ExitStack() as s:
            from unittest import mock

            s.enter_context(mock.patch.object(PreTrainedModel, "from_pretrained", classmethod(from_pretrained)))
            yield

    # -- placement -------------------------------------------------------------------------------------
    def split(self, model: torch.nn.Module, device_map: Any = "auto") -> dict[str, torch.device]:
        """Places ``model``'s modules over the virtual GPUs as accelerate does: ``"auto"`` (or a GPU count)
        cuts a causal LM's decoder layers into contiguous runs, one per GPU, the embeddings with the first and
        the final norm and output layer with the last; a dict maps module names to devices. Each module of
        the map moves its inputs to its device inside its forward (after its forward pre-hooks, as accelerate's
        wrapped forward does: a pre-hook sees the tensor where the previous module left it). Returns the map."""
        if device_map in ("auto", "balanced", "sequential") or isinstance(device_map, int):
            device_map = self.layer_map(model, self.n if not isinstance(device_map, int) else device_map)
        placed = {name: _as_device(d) or CPU for name, d in dict(device_map).items()}
        modules = dict(model.named_modules())
        for name, dev in sorted(placed.items(), key=lambda kv: len(kv[0])):  # inner entries win
            mod = modules.get(name)
            if mod is None:
                raise ValueError(f"device_map names {name!r}, which the model does not have")
            for t in list(mod.parameters()) + list(mod.buffers()):
                _tag(t, dev)
            _align(mod, dev)
        model.hf_device_map = {k: (v.index if v.type == "cuda" else v.type) for k, v in placed.items()}
        return placed

    @staticmethod
    def layer_map(model: torch.nn.Module, n: int) -> dict[str, torch.device]:
        """The map of :meth:`split` for ``n`` GPUs."""
        names = [k for k, _ in model.named_modules()]
        layers = sorted(
            (k for k in names if re.fullmatch(r"(.*\.)?(layers|h|blocks)\.\d+", k)),
            key=lambda k: int(k.rsplit(".", 1)[1]),
        )
        if not layers:
            raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")
        per = -(-len(layers) // n)
        out: dict[str, torch.device] = {k: torch.device("cuda", i // per) for i, k in enumerate(layers)}
        last = torch.device("cuda", (len(layers) - 1) // per)
        first = torch.device("cuda", 0)
        prefix = layers[0].rsplit(".", 2)[0]  # model.layers.0 -> model
        for k, mod in model.named_modules():
            if k in out or not k or any(k.startswith(x + ".") for x in out):
                continue
            if k.count(".") != prefix.count(".") + 1 and k != "lm_head" and "." in k:
                continue
            if k == prefix or k.endswith(".layers"):
                continue
            if mod is model.get_input_embeddings():
                out[k] = first
            elif not list(mod.children()) or k == "lm_head" or k.endswith(("rotary_emb", "norm")):
                out[k] = last
        return out

    # -- the check -------------------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        if name in _GETTERS:
            d = device_of(args[0])
            return {
                "Tensor.device": d,
                "Tensor.is_cuda": d.type == "cuda",
                "Tensor.is_cpu": d.type == "cpu",
                "Tensor.get_device": d.index if d.type == "cuda" else -1,
            }[name]
        prop = isinstance(getattr(func, "__self__", None), GetSetDescriptorType)
        if prop and not (name == "Tensor.data" and len(args) == 2):
            return func(*args, **kwargs)  # shape, dtype, grad, ...: no device involved (data is a view: below)
        self.ops[name] += 1
        if name in ("Tensor.to", "Tensor.cuda", "Tensor.cpu"):
            return self._move(func, name, args, kwargs)
        if name == "Tensor.pin_memory":
            return args[0]
        if name == "Tensor.data" and len(args) == 2:  # param.data = value: the parameter takes its device
            func(*args, **kwargs)
            _tag(args[0], device_of(args[1]))
            return None
        if name.endswith("._parse_to"):  # Module.to's parser: the device as given (a device object, no allocation)
            return func(*args, **kwargs)
        target = _as_device(kwargs.get("device")) if "device" in kwargs else None
        if "device" in kwargs:
            kwargs = {**kwargs, "device": CPU if kwargs["device"] is not None else None}
        if name.endswith(".numpy") and device_of(args[0]).type != "cpu":
            raise DeviceMismatch(name, [device_of(args[0]), CPU])
        devices = self._check(name, args, kwargs)
        gen = kwargs.get("generator")
        out = func(*args, **kwargs)
        where = target or (devices[0] if devices else CPU)
        if isinstance(gen, _VirtualGenerator) and gen.device.type != where.type:
            raise DeviceMismatch(f"{name} (generator)", [gen.device, where])
        if name in ("Tensor.new_tensor", "Tensor.new_zeros", "Tensor.new_ones", "Tensor.new_empty", "Tensor.new_full"):
            where = target or device_of(args[0])
        for t in _tensors(out, []):
            if not any(t is a for a in _tensors((args, kwargs), [])):
                _tag(t, where)
        return out

    def _check(self, name: str, args, kwargs) -> list[torch.device]:
        """The devices of an operation's operands (the first one's first); raises on a mix."""
        tensors = _tensors((args, kwargs), [])
        last = name.rsplit(".", 1)[-1]
        if name in _CROSS or not tensors or (last.startswith("_") and not last.startswith("__")):  # torch's internals
            return [device_of(tensors[0])] if tensors else []
        index = None
        if name in _INDEXING:  # CPU index tensors are allowed; the indexed tensor (and a value) set the device
            base = args[0]
            index = _tensors(args[1], [])
            # a value set through basic indexing (ints, slices) is a copy_ into a view: from any device
            others = [base] + (_tensors(args[2:], []) if index or name != "Tensor.__setitem__" else [])
            tensors = others + [t for t in index if device_of(t).type != "cpu"]
        seen: list[torch.device] = []
        first: list[torch.Tensor] = []
        for t in tensors:
            d = device_of(t)
            if d.type == "cpu" and t.dim() == 0 and len(tensors) > 1:  # a CPU scalar joins any device
                continue
            if d not in seen:
                seen.append(d)
                first.append(t)
        if len(seen) > 1:
            raise DeviceMismatch(name, seen, [f"{list(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in first])
        if not seen:
            return [device_of(tensors[0])]
        return seen

    def _move(self, func, name: str, args, kwargs):
        """``.to`` / ``.cuda`` / ``.cpu``: the dtype (and copy) on the CPU, the device as a tag on a copy."""
        t, dest, dtype = args[0], None, kwargs.get("dtype")
        if name == "Tensor.cpu":
            dest = CPU
        elif name == "Tensor.cuda":
            dest = _as_device(args[1] if len(args) > 1 else kwargs.get("device", 0))
        else:
            dest = _as_device(kwargs["device"]) if kwargs.get("device") is not None else None
            for a in args[1:]:
                if isinstance(a, torch.Tensor):
                    dest, dtype = device_of(a), a.dtype
                elif isinstance(a, torch.dtype):
                    dtype = a
                elif _is_device_like(a):
                    dest = _as_device(a)
        out = _TB.to(t, dtype=dtype, copy=bool(kwargs.get("copy"))) if dtype is not None or kwargs.get("copy") else t
        src = device_of(t)
        if dest is None or dest == src:
            if out is not t:
                _tag(out, src)
            return out
        if out is t:
            out = t.clone()
        self.moves += 1
        _tag(out, dest)
        return out


def _is_device_like(a: Any) -> bool:
    return isinstance(a, (str, torch.device, int)) and not isinstance(a, bool)


def _align(module: torch.nn.Module, dev: torch.device) -> None:
    """accelerate's AlignDevicesHook in short: the module's forward moves its tensor inputs to ``dev``."""

    def move(x):
        if isinstance(x, torch.Tensor):
            return x if device_of(x) == dev else x.to(dev)
        if isinstance(x, tuple) and not hasattr(x, "_fields"):
            return tuple(move(y) for y in x)
        if isinstance(x, list):
            return [move(y) for y in x]
        return x

    inner = module.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        return inner(*move(args), **{k: move(v) for k, v in kwargs.items()})

    module.forward = forward

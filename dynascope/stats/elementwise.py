"""Element-wise statistics: one function per statistic, evaluated on chunk tensors or compiled into a fused pass.

A statistic whose partial results are sums, sums of squares or maxima of per-element terms declares that
term once, as ``Statistic.element``: ``fn(ops, <names>...) -> tuple`` with one term per output, in the
order of ``outputs`` (a bool to count for a "sum" column, a square for a "norm" one, a value ≥ 0 for a
"max" one). Its parameters name what it reads of each input, and the per-tensor scalars it needs:

* ``new``, ``old``, ``ref``, ``grad``: the element's value, widened (fp32 for 16-bit weights);
* ``<input>_bits``: its bits in the input's own dtype, as a signed integer of that width;
* ``<input>_key``: the bits of its bf16 cast (PyTorch's round-to-nearest-even; every NaN to one pattern);
* any name ``Statistic.scalars(chunk)`` returns (η, a threshold), fixed over the tensor.

The same function runs two ways, so each statistic's maths is written once:

* here, on whole chunk tensors with ``TORCH_OPS`` (vectorised ATen ops: any dtype, any device; the path
  on accelerators and wherever numba is missing);
* in ``stats.fused``, compiled by numba into one loop over the elements of every statistic of a pass, with
  numba's ``ops``: each element of every input is read once, nothing tensor-sized is allocated.

The function is therefore written in what both understand: arithmetic, comparisons, ``&``/``|`` on
booleans, ``abs``, ``math.inf``, plus ``ops.bf16_value(key)`` (the fp32 value of a bf16 pattern) and
``ops.bf16_round(x)`` (an fp32 value rounded to bf16, as a bf16 subtraction rounds its result). A helper
it calls is compiled along with it (``stats.fused`` compiles the plain functions it names).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor

    from dynascope.stats.base import Chunk, Statistic

__all__ = ["TORCH_OPS", "arguments", "element_kernel", "reduce_terms", "reduces_of"]


def _bf16_value(key: Tensor) -> Tensor:
    import torch

    return key.view(torch.bfloat16).float()


def _bf16_round(x: Tensor) -> Tensor:
    import torch

    return x.to(torch.bfloat16).float()


TORCH_OPS = SimpleNamespace(bf16_value=_bf16_value, bf16_round=_bf16_round)


def arguments(fn: Callable[..., Any]) -> tuple[str, ...]:
    """The names an element function reads, after ``ops``."""
    return tuple(inspect.signature(fn).parameters)[1:]


def _view(name: str, x: Chunk, scalars: dict[str, Any]) -> Any:
    """One argument of an element function, from a chunk's tensors (see the module docstring)."""
    import torch

    from dynascope.stats.kernels import INT_VIEW, wide

    if name in scalars:
        return scalars[name]
    base, _, what = name.partition("_")
    if base == "k":  # k_snapshot_<what>
        base, _, what = name.partition("_")[2].partition("_")
        base = "k_" + base
    t = getattr(x, base)
    if what == "":
        return wide(t)
    if what == "bits":
        return t.view(INT_VIEW[t.element_size()])
    if what == "key":
        return (t if t.dtype == torch.bfloat16 else t.to(torch.bfloat16)).view(torch.int16)
    raise ValueError(f"element argument {name!r}: expected an input, <input>_bits, <input>_key or a scalar")


def reduce_terms(terms: tuple[Any, ...], reduces: list[str]) -> list[Tensor]:
    """Each term tensor reduced over the chunk: counted (sum of a bool), ‖·‖ of the root of a sum of
    squares (float64), or its maximum (0 for an empty chunk; NaN propagates)."""
    import torch

    out: list[Tensor] = []
    for t, how in zip(terms, reduces, strict=True):
        if how == "sum":
            out.append(torch.count_nonzero(t) if t.dtype == torch.bool else t.sum(dtype=torch.float64))
        elif how == "norm":
            out.append(t.sum(dtype=torch.float64).sqrt())
        elif t.numel() == 0:
            out.append(torch.zeros((), dtype=torch.float64, device=t.device))
        else:
            out.append(t.amax())
    return out


def reduces_of(outputs: tuple[str, ...]) -> list[str]:
    """How each output combines ("sum", "norm", "max"), as its column declares."""
    from dynascope.stats.registry import REGISTRY  # at run time: the registry is built from the statistics

    return [REGISTRY.column[c].reduce or "sum" for c in outputs]


def element_kernel(s: Statistic) -> Callable[[Chunk], list[Tensor]]:
    """The chunk kernel of an element-wise statistic: its element function on the chunk's tensors."""
    fn = s.element
    assert fn is not None
    names = arguments(fn)

    def kernel(x: Chunk) -> list[Tensor]:
        import torch

        scalars = s.scalars(x) if s.scalars is not None else {}
        terms = fn(TORCH_OPS, *(_view(n, x, scalars) for n in names))
        out = reduce_terms(terms, reduces_of(s.outputs))
        if s.bitwise and len({getattr(x, i).dtype for i in s.inputs}) > 1:  # bits of different dtypes: undefined
            nan = torch.full((), float("nan"), dtype=torch.float64, device=out[0].device)
            out = [nan if c in s.bitwise else v for c, v in zip(s.outputs, out, strict=True)]
        return out

    return kernel
